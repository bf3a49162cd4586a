"""Pipeline stages on the CPU: one process vs TP2 vs PP2 (two stages of one rank) vs PP2 x TP2,
each with one micro-batch and (PP2) in two interleaved lanes (engine.micro_batches 2,
engine/lanes.py), gloo ranks on this host, the tiny Kimi-K3 + DFlash2-MLA pair (testing/kimi_pair.py, --layers
deep), --prompts prompts of --length tokens decoding --new tokens greedily with
speculation, max_num_seqs = prompts. Prints each layout's wall time (the median of --repeats
generate calls, after one warm-up), generated tokens per second, the bytes a rank hands the next
stage and takes back from the last over one generate call (parallel.tallied: prefill and rounds),
and whether its tokens equal one process's on every rank.

No speed claim for a GPU: the CPU shows that the layouts decode the same tokens, what stages
cost where nothing overlaps (one micro-batch: the stages take turns) and what lanes win back
where each rank has a core of its own, not what a GPU node does.

usage: python benchmarks/pipeline_cpu.py [--prompts 8] [--length 64] [--new 32] [--repeats 3]
                                         [--layers 8] [--wide] [--layouts "one process;PP2;PP2, 2 lanes"]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_batch import parallel  # noqa: E402
from dflash_batch.engine.engine import Engine  # noqa: E402
from dflash_batch.engine.request import Request, SamplingParams  # noqa: E402
from dflash_batch.plan.buckets import Bucket  # noqa: E402
from dflash_batch.testing.kimi_pair import VOCAB, load_pair, make_kimi_pair  # noqa: E402

# --wide: the pair at 8x the tiny width, so that a forward's time follows its rows (at the tiny
# width it is mostly per-op overhead, the same for a lane as for a whole round).
WIDE_TARGET = dict(hidden_size=512, intermediate_size=768, num_attention_heads=8, q_lora_rank=128, kv_lora_rank=64,
                   qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=256,
                   routed_expert_hidden_size=384, linear_attn_config=dict(num_heads=8, head_dim=32))
WIDE_DRAFTER = dict(hidden=512, heads=8, q_lora=128, kv_lora=64, nope=32, rope=16, v=32, inter=1024)
# (name, TP, stages, lanes)
LAYOUTS = [("one process", 1, 1, 1), ("TP2", 2, 1, 1), ("PP2", 1, 2, 1), ("PP2, 2 lanes", 1, 2, 2),
           ("PP2 x TP2", 2, 2, 1), ("PP2 x TP2, 2 lanes", 2, 2, 2)]


def decode(pair: tuple[Path, Path], args: argparse.Namespace, lanes: int = 1) -> dict:
    """This rank's tokens, median seconds and the stage traffic of the generate calls."""
    target, drafter = load_pair(*pair)
    engine = Engine(target, drafter, dtype=torch.float32, micro_batches=lanes)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB - 1, (args.length,), generator=gen).tolist() for _ in range(args.prompts)]
    bucket = Bucket(0, "bench", args.length + args.new + 16, args.prompts, True, None)
    times, tokens, traffic = [], None, {}
    for i in range(args.repeats + 1):
        reqs = [Request((str(j), 0), p, SamplingParams(max_new_tokens=args.new)) for j, p in enumerate(prompts)]
        parallel.barrier()
        started = time.perf_counter()
        with parallel.tallied() as tally:
            done = {c.key: c.token_ids for c in engine.generate(iter(reqs), bucket)}
        if i:  # the first call warms up
            times.append(time.perf_counter() - started)
        tokens, traffic = [done[r.key] for r in reqs], dict(tally)
    return {"tokens": tokens, "seconds": statistics.median(times), "traffic": traffic}


def rank_main(rank: int, world: int, stages: int, lanes: int, port: int, pair: tuple[Path, Path], args,
              out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    parallel.form_stages(stages)
    torch.set_num_threads(1)
    try:
        torch.save(decode(pair, args, lanes), out / f"rank{rank}.pt")
    finally:
        parallel.leave_stages()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--wide", action="store_true", help="the pair 8x wider (hidden 512)")
    p.add_argument("--layouts", default=None, help="the layouts to run, by name, ;-separated (default: all; "
                   "the first is the reference whose tokens the others must equal)")
    args = p.parse_args()
    layouts = [lay for lay in LAYOUTS if args.layouts is None or lay[0] in args.layouts.split(";")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wide = dict(drafter_dims=WIDE_DRAFTER, **WIDE_TARGET) if args.wide else dict(moe_intermediate_size=64)
        pair = make_kimi_pair(tmp / "pair", num_hidden_layers=args.layers, slices=2, **wide)
        torch.set_num_threads(1)
        rows, reference = [], None
        for name, tp, stages, lanes in layouts:
            out = tmp / "".join(c for c in name if c.isalnum())
            out.mkdir()
            if tp * stages == 1:
                results = [decode(pair, args)]
            else:
                with socket.socket() as s:  # a free port
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                mp.spawn(rank_main, args=(tp * stages, stages, lanes, port, pair, args, out), nprocs=tp * stages)
                results = [torch.load(out / f"rank{r}.pt") for r in range(tp * stages)]
            reference = reference or results[0]["tokens"]
            seconds = max(r["seconds"] for r in results)
            generated = sum(map(len, results[0]["tokens"]))
            handed = max(r["traffic"].get("hand_off", 0) for r in results)
            back = max(r["traffic"].get("from_last_stage", 0) for r in results)
            same = all(r["tokens"] == reference for r in results)
            rows.append((name, tp * stages, seconds, generated / seconds, handed, back, same))
    print(f"{args.prompts} prompts x {args.length} tokens, {args.new} new (greedy, speculative), Kimi-K3 pair of "
          f"{args.layers} layers, hidden {512 if args.wide else 64}; median of {args.repeats}, one torch thread a rank")
    print(f"{'layout':<18} {'ranks':>5} {'wall s':>8} {'tok/s':>8} {'handed on MB':>13} {'back MB':>8}  same tokens")
    for name, ranks, seconds, rate, handed, back, same in rows:
        print(f"{name:<18} {ranks:>5} {seconds:>8.2f} {rate:>8.1f} {handed / 2**20:>13.2f} {back / 2**20:>8.2f}  "
              f"{'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
