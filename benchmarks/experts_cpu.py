"""Experts across ranks on the CPU: one process vs TP2 (every expert cut across both ranks) vs DP2 x
TP1 + EP2 (two data-parallel groups, each its half of the prompts, the routed experts whole, four
on each rank, the latent rows dispatched to both), gloo ranks on this host, the tiny Kimi-K3 +
DFlash2-MLA pair (testing/kimi_pair.py), --prompts prompts of --length tokens decoding --new
tokens greedily with speculation. Prints each layout's wall time (the median of --repeats
generate calls after a warm-up, the slowest rank's), target forwards (a group's, counted at the
model), the collectives a rank runs and the bytes it hands them per target forward
(parallel.tallied, by kind: the groups' dispatch and combine apart), the forwards a group served
the other with no rows of its own, and whether every prompt's tokens equal one process's.

No speed claim: at the tiny width a forward is per-op overhead, every rank here shares two cores,
and on the CPU the experts of a rank run on every dispatched row (weight 0 where another rank
serves it). The table shows the collectives a round costs in each layout and that the tokens do
not change.

usage: python benchmarks/experts_cpu.py [--prompts 8] [--length 48] [--new 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_batch import parallel  # noqa: E402
from dflash_batch.engine.engine import Engine  # noqa: E402
from dflash_batch.engine.pair import attach_drafter  # noqa: E402
from dflash_batch.engine.request import Request, SamplingParams  # noqa: E402
from dflash_batch.models.layers.expert_parallel import Placement  # noqa: E402
from dflash_batch.models.loader import load_model  # noqa: E402
from dflash_batch.plan.buckets import Bucket  # noqa: E402
from dflash_batch.testing.kimi_pair import VOCAB, make_kimi_pair  # noqa: E402

LAYOUTS = [("one process", 1, 1), ("TP2", 2, 1), ("DP2 x TP1 + EP2", 1, 2)]  # (name, TP, groups)
EXPERTS = 8


def decode(pair: tuple[Path, Path], args: argparse.Namespace, groups: int) -> dict:
    """This rank's group's prompts (every groups-th), decoded --repeats + 1 times: tokens by prompt,
    median seconds, target forwards, and per kind the collectives run and the bytes handed them."""
    group, ranks = parallel.data_parallel()[0], parallel.expert_rank()[1]
    placement = Placement(EXPERTS, ranks, 0, {}) if groups > 1 else None
    target, drafter = load_model(pair[0], torch.float32, "cpu", placement), load_model(pair[1], torch.float32)
    attach_drafter(target, drafter)
    forwards, layers = [0], target.run_layers
    target.run_layers = lambda carry, meta: (forwards.__setitem__(0, forwards[0] + 1), layers(carry, meta))[1]
    calls, add = Counter(), parallel._add
    parallel._add = lambda kind, x, share=1: (calls.update([kind]), add(kind, x, share))[1]
    engine = Engine(target, drafter, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB - 1, (args.length,), generator=gen).tolist() for _ in range(args.prompts)]
    mine = list(range(group, args.prompts, groups))
    bucket = Bucket(0, "bench", args.length + args.new + 16, args.prompts, True, None)
    times = []
    for i in range(args.repeats + 1):
        reqs = [Request((str(j), 0), prompts[j], SamplingParams(max_new_tokens=args.new)) for j in mine]
        if dist.is_initialized():
            dist.barrier()
        forwards[0], idle = 0, parallel.idle_forwards
        calls.clear()
        started = time.perf_counter()
        with parallel.tallied() as tally:
            done = {c.key: c.token_ids for c in engine.generate(iter(reqs), bucket)}
            if placement is not None:
                target.serve_experts()
        if i:  # the first call warms up
            times.append(time.perf_counter() - started)
        tokens = {int(r.key[0]): done[r.key] for r in reqs}
        per_forward = {k: (calls[k] / forwards[0], tally[k] / forwards[0]) for k in calls}
    return {"tokens": tokens, "seconds": statistics.median(times), "forwards": forwards[0],
            "per_forward": per_forward, "idle": parallel.idle_forwards - idle}


def rank_main(rank: int, world: int, groups: int, port: int, pair: tuple[Path, Path], args, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    parallel.form_data_parallel(groups)
    torch.set_num_threads(1)
    try:
        torch.save(decode(pair, args, groups), out / f"rank{rank}.pt")
    finally:
        parallel.leave_data_parallel()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=48)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pair = make_kimi_pair(tmp / "pair", stream="attn_res", moe_intermediate_size=64, slices=2)
        torch.set_num_threads(1)
        reference = None
        for name, tp, groups in LAYOUTS:
            out = tmp / "".join(c for c in name if c.isalnum())
            out.mkdir()
            if tp * groups == 1:
                results = [decode(pair, args, 1)]
            else:
                with socket.socket() as s:  # a free port
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                mp.spawn(rank_main, args=(tp * groups, groups, port, pair, args, out), nprocs=tp * groups)
                results = [torch.load(out / f"rank{r}.pt") for r in range(tp * groups)]
            tokens = {i: t for r in results for i, t in r["tokens"].items()}
            reference = reference or tokens
            same = tokens == reference and all(r["tokens"] == {i: tokens[i] for i in r["tokens"]} for r in results)
            rows.append((name, tp * groups, max(r["seconds"] for r in results),
                         "/".join(str(r["forwards"]) for r in results[::tp]), results[0]["per_forward"],
                         "/".join(str(r["idle"]) for r in results[::tp]) if groups > 1 else "-", same))
    print(f"{args.prompts} prompts x {args.length} tokens, {args.new} new (greedy, speculative), the tiny Kimi-K3 "
          f"pair ({EXPERTS} experts, top-2); median of {args.repeats}, one torch thread a rank")
    print(f"{'layout':<16} {'ranks':>5} {'wall s':>7} {'forwards':>9} {'idle':>6}  same tokens  "
          "collectives a target forward, a rank's: calls x kind (KB handed)")
    for name, ranks, seconds, forwards, per_forward, idle, same in rows:
        kinds = ", ".join(f"{n:.1f} {k} ({b / 1024:.1f})" for k, (n, b) in sorted(per_forward.items())) or "none"
        print(f"{name:<16} {ranks:>5} {seconds:>7.2f} {forwards:>9} {idle:>6}  {'yes' if same else 'NO':<11}  {kinds}")


if __name__ == "__main__":
    main()
