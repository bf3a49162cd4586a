"""The Kimi-K3 half of the GPU check (benchmarks/gpu_check.sh runs it on the device): a Kimi-K3 at
one TP8 rank's real widths (hidden 7168; 12 MLA heads over a 512 + 64 latent; 12 KDA heads of
128; MXFP4 experts of 384 columns in a 3584-wide latent; a rank's 20,480 rows of the vocabulary),
4 layers (3 KDA, 1 MLA) and 32 experts (top 16), with a 5-layer DFlash2-MLA drafter at a rank's
width (8 heads; window 256). Random weights but a peaked head (dflash_batch/testing/kimi_pair.py
peaked_head, scaled HEAD_SCALE), so greedy argmaxes mostly have margins; a round's time here is its cost, not a
speed-up. For one backend, with each criterion's verdict in --out as soon as its section ends:

- the GPU's prefill logits against the CPU's float32 forward of the same checkpoint: within
  LOGITS_BOUND of the largest (the GPU runs bfloat16: 8 significant bits, each rounding up to
  2^-9 relative, over 4 layers and the head);
- graph == eager on every sequence (the same kernels in the same order: bit for bit);
- speculative greedy == target-only greedy on every sequence, each compared up to its first step
  whose top-2 margin in the target-only run is under MARGIN nats (verify widths change the
  GEMMs' shapes, so bfloat16 rounds differently: a near tie may flip there and prove nothing),
  with at least COMPARED of the steps compared (else the head is too flat to tell);
- the median round time at batch 1/2/4/16 under CUDA graphs beside the bandwidth floor: the bytes a
  round must read (resident weights but the embedding, each sequence's latent rows and KDA
  states) over the copy bandwidth measured here.

`--schedule` prints instead the speculation schedule's cost table (engine/schedule.py): a round's
time under CUDA graphs at batch 1, 4, 16 and 64 for each number of verified drafts k = 0..7, as
an auto bucket times it, and for the model card's acceptance lengths (5.9 GSM8K, 4.6 MATH-500,
2.8 AIME; each drafted position accepted alike) the k auto would pick and its tokens/s against
k = 0 and k = 7: where on this GPU the crossover lies, at one TP8 rank's widths.

`--small` runs the tiny pair instead (and on a CPU, without graphs): a check of the script itself.
`--dir` keeps the checkpoints for the next run (`--make-only`: write them and stop; the GPU check
writes them while its other stages run).

python benchmarks/kimi_gpu_check.py [--backend torch|flashinfer] [--small] [--schedule] [--dir D [--make-only]] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_batch.engine.cache import SeqRows, build_meta  # noqa: E402
from dflash_batch.engine.engine import Engine  # noqa: E402
from dflash_batch.engine.pair import attach_drafter  # noqa: E402
from dflash_batch.engine.request import Request, SamplingParams  # noqa: E402
from dflash_batch.models.loader import load_model  # noqa: E402
from dflash_batch.plan.buckets import Bucket  # noqa: E402
from dflash_batch.testing.kimi_pair import make_kimi_pair  # noqa: E402

TP = 8
TARGET = dict(hidden_size=7168, vocab_size=163840 // TP, num_hidden_layers=4, intermediate_size=33792 // TP,
              num_attention_heads=96 // TP, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128, num_experts=32, num_experts_per_token=16, num_shared_experts=2,
              moe_intermediate_size=3072 // TP, routed_expert_hidden_size=3584, attn_res_block_size=12,
              max_position_embeddings=131072, linear_attn_config=dict(num_heads=96 // TP, head_dim=128))
DRAFTER = dict(hidden=7168, heads=64 // TP, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, inter=14336 // TP,
               layers=5, conv_taps=2, conv_group=16, rank=256)
# The drafter's window is the published 4096 cut to 256, so that prompts of 512 tokens exercise
# its sliding layers' edge (flashinfer_latent.py) at real widths.
WINDOW, BATCHES, PROMPT = 256, (1, 2, 4, 16), 512
# bfloat16 logits of two verify widths differ by a few hundredths at most (their GEMMs round in
# another order; one bfloat16 ulp is 2^-8 of a logit of ~3); a head scaled 10x keeps most greedy
# steps farther apart than MARGIN (the tiny pair on a CPU: 68% of 384 steps compared at 0.1).
LOGITS_BOUND, MARGIN, COMPARED, HEAD_SCALE = 5e-2, 0.1, 0.5, 10.0


def make_pair(d: Path, small: bool) -> tuple[Path, Path]:
    """The pair's (target, drafter) checkpoints under d, written once (d/done marks them complete)."""
    if not (d / "done").exists():
        if small:
            make_kimi_pair(d, window=10, head_scale=HEAD_SCALE)
        else:
            make_kimi_pair(d, window=WINDOW, head_scale=HEAD_SCALE, drafter_dims=DRAFTER, **TARGET)
        (d / "done").touch()
    return d / "target", d / "drafter_prefix"


def load_pair(dirs: tuple[Path, Path], dtype: torch.dtype, device: str):
    target, drafter = load_model(dirs[0], dtype, device), load_model(dirs[1], dtype, device)
    attach_drafter(target, drafter)
    return target, drafter


def prompts(n: int, vocab: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, vocab - 2, (length,), generator=g).tolist() for _ in range(n)]


def generate(engine: Engine, batch: int, new: int, vocab: int, speculation: bool = True,
             logprobs: int | None = None) -> tuple[float, dict, int]:
    """(seconds, completions by key, rounds of the longest sequence) of `batch` prompts decoded together."""
    reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=new, seed=i, logprobs=logprobs))
            for i, p in enumerate(prompts(batch, vocab, PROMPT))]
    bucket = Bucket(0, "0-2048", 2048, batch, speculation, None)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    outs = list(engine.generate(reqs, bucket))
    sync()
    rounds = max(len(c.spec.per_round) if c.spec else len(c.token_ids) - 1 for c in outs)
    return time.perf_counter() - t, {c.key: c for c in outs}, rounds


def round_ms(engine: Engine, batch: int, vocab: int) -> float:
    """The median time of the engine's rounds (host work and read-back included) over `batch`
    sequences decoding together, after a warm-up run (captures, compiles); prefill is not a round."""
    generate(engine, batch, 8, vocab)
    times, run_round = [], engine._round

    def timed(*args):
        start = time.perf_counter()
        kept = run_round(*args)
        times.append(time.perf_counter() - start)
        return kept

    engine._round = timed
    try:
        generate(engine, batch, 48, vocab)
    finally:
        del engine._round
    return 1e3 * statistics.median(times)


def agree_to_near_ties(got: dict, plain: dict) -> tuple[int, int, int]:
    """(sequences whose tokens equal the target-only run's, steps compared, steps): each compared up
    to its first step whose top-2 margin in `plain` (logprobs=2) is under MARGIN."""
    agree = compared = steps = 0
    for key, c in plain.items():
        margins = [top[0] - top[1] for top in c.logprobs.top]
        n = next((i for i, m in enumerate(margins) if m < MARGIN), len(margins))
        agree += got[key].token_ids[:n] == c.token_ids[:n]
        compared, steps = compared + n, steps + len(margins)
    return agree, compared, steps


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second a device-to-device copy moves (read + write)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * 10 * nbytes / (time.perf_counter() - t)


def floor_bytes(target, drafter, batch: int, context: int) -> int:
    """What a round must read: every resident weight but the embedding (a few rows), and per
    sequence the latent rows its MLA layers attend to and its KDA states (read by the verify,
    read and written by the commit)."""
    weights = sum(p.nbytes for n, p in target.named_parameters() if "embed_tokens" not in n)
    weights += sum(p.nbytes for p in drafter.parameters())
    latent = target.model.layers[-1].self_attn.cache.shape[-1] * target.model.layers[-1].self_attn.cache.element_size()
    mla = sum(not layer.is_kda for layer in target.model.layers)
    kda = [layer.self_attn for layer in target.model.layers if layer.is_kda]
    state = sum(a.state[0].nbytes for a in kda)
    sliding = [layer.self_attn for layer in drafter.layers if layer.self_attn.window]
    full = len(drafter.layers) - len(sliding)
    window = sliding[0].window if sliding else 0
    per_seq = latent * (context * (mla + full) + min(context, window) * len(sliding)) + 3 * state
    return weights + batch * per_seq


CARD = {"GSM8K": 5.9, "MATH-500": 4.6, "AIME": 2.8}  # acc_len on the model card (k = 7)


def rate_for(acc_len: float, drafts: int = 7) -> float:
    """The per-position acceptance p with 1 + p + ... + p^drafts = acc_len (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        p = (low + high) / 2
        low, high = (p, high) if sum(p ** j for j in range(drafts + 1)) < acc_len else (low, p)
    return (low + high) / 2


def schedule_table(target, drafter, kw: dict, vocab: int, cuda: bool) -> dict:
    """The auto bucket's cost table at batch 1, 4, 16, 64, and what it implies at the card's acceptance."""
    sizes = [1, 4, 16, 64]
    engine = Engine(target, drafter, cuda_graphs=cuda, capture_sizes=sizes if cuda else None, **kw)
    reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=4)) for i, p in enumerate(prompts(4, vocab, 64))]
    list(engine.generate(reqs, Bucket(0, "auto", 2048, max(sizes), "auto", None)))  # times the costs
    schedule = engine.schedules["auto"]
    costs = {size: [schedule.costs[size][k] for k in range(schedule.block)] for size in schedule.sizes}
    out = {"ms_per_round": {s: [round(1e3 * c, 3) for c in row] for s, row in costs.items()}, "card": {}}
    for name, acc_len in CARD.items():
        p = rate_for(acc_len)
        tokens = [sum(p ** j for j in range(k + 1)) for k in range(schedule.block)]
        per_size = {}
        for size, row in costs.items():
            rate = [size * t / c for t, c in zip(tokens, row)]
            best = max(range(len(rate)), key=rate.__getitem__)
            per_size[size] = {"best k": best, "vs k=0": rate[best] / rate[0], "vs k=7": rate[best] / rate[-1]}
        out["card"][name] = per_size
    return out


def print_schedule(table: dict) -> None:
    ms = table["ms_per_round"]
    print("\n| batch | " + " | ".join(f"k={k} ms" for k in range(len(next(iter(ms.values()))))) + " |")
    print("|---|" + "---|" * len(next(iter(ms.values()))))
    for size, row in ms.items():
        print(f"| {size} | " + " | ".join(f"{c:.2f}" for c in row) + " |")
    print("\n| acceptance (card) | " + " | ".join(f"batch {s}: best k, vs k=0, vs k=7" for s in ms) + " |")
    print("|---|" + "---|" * len(ms))
    for name, per_size in table["card"].items():
        print(f"| {name} {CARD[name]} | " + " | ".join(
            f"{v['best k']}, {v['vs k=0']:.2f}x, {v['vs k=7']:.2f}x" for v in per_size.values()) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="torch", choices=["torch", "flashinfer"])
    ap.add_argument("--small", action="store_true", help="the tiny pair (checks the script; runs on a CPU)")
    ap.add_argument("--dir", help="where the pair's checkpoints are (made there if absent; default: a new "
                    "temporary directory)")
    ap.add_argument("--make-only", action="store_true", help="write the checkpoints to --dir and stop")
    ap.add_argument("--schedule", action="store_true", help="only the speculation schedule's cost table")
    ap.add_argument("--out")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    d = Path(a.dir or tempfile.mkdtemp())
    t0 = time.time()
    dirs = make_pair(d, a.small)
    if a.make_only:
        return
    table = {"backend": a.backend, "device": torch.cuda.get_device_name() if cuda else "cpu",
             "checkpoints_s": round(time.time() - t0, 1)}
    print(json.dumps(table), flush=True)

    def save() -> None:
        """--out rewritten whole as each section ends: a run cut off keeps what it finished."""
        if a.out:
            Path(a.out).write_text(json.dumps(table) + "\n")

    target, drafter = load_pair(dirs, dtype, device)
    vocab = target.vocab_size
    ids = torch.tensor(prompts(1, vocab, 64)[0])
    if a.schedule:
        attention = None
        if a.backend == "flashinfer":
            from dflash_batch.backends.flashinfer_attention import FlashInferAttention

            attention = FlashInferAttention(device)
        kw = dict(device=device, dtype=dtype, **({"attention": attention} if attention else {}))
        table["schedule"] = schedule_table(target, drafter, kw, vocab, cuda)
        print_schedule(table["schedule"])
        save()
        return

    def prefill_logits(model, on: str) -> torch.Tensor:
        model.allocate_cache(128, model.embed_tokens.weight.dtype, on)
        if hasattr(model, "allocate_state"):
            model.allocate_state(2, 1, 8, on)
        meta = build_meta([SeqRows(list(range(128 // 16)), 0, len(ids), len(ids))], 16, None, on, [0])
        with torch.no_grad():
            return model(ids.to(on), meta)[0].float().cpu()

    table["criteria"] = {}

    def judged(name: str, value, ok: bool, want: str) -> None:
        """One criterion, written out at once (benchmarks/gpu_check_verdict.py reads it)."""
        table["criteria"][name] = {"value": value, "want": want, "pass": bool(ok)}
        print(json.dumps({name: table["criteria"][name]}), flush=True)
        save()

    got = prefill_logits(target, device)
    reference = prefill_logits(load_model(dirs[0], torch.float32, "cpu"), "cpu")
    diff = float((got - reference).abs().max() / reference.abs().max())
    table["argmax agreement"] = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
    judged("logits vs CPU", diff, diff <= LOGITS_BOUND, f"max abs diff / max abs <= {LOGITS_BOUND}")

    attention = None
    if a.backend == "flashinfer":
        from dflash_batch.backends.flashinfer_attention import FlashInferAttention

        attention = FlashInferAttention(device)
    kw = dict(device=device, dtype=dtype, **({"attention": attention} if attention else {}))
    eager = Engine(target, drafter, **kw)
    graphs = Engine(target, drafter, cuda_graphs=cuda, capture_sizes=list(BATCHES), **kw)
    _, want, _ = generate(eager, 16, 24, vocab)
    _, got_graph, _ = generate(graphs, 16, 24, vocab)
    same = sum(got_graph[k].token_ids == want[k].token_ids for k in want)
    judged("graph == eager", f"{same}/{len(want)}", same == len(want), "every sequence")
    _, plain, _ = generate(graphs, 16, 24, vocab, speculation=False, logprobs=2)
    agree, compared, steps = agree_to_near_ties(got_graph, plain)
    judged("spec greedy == target-only", f"{agree}/{len(plain)} over {compared} of {steps} steps",
           agree == len(plain) and compared >= COMPARED * steps,
           f"every sequence, up to its first top-2 margin under {MARGIN} nats; at least {COMPARED:.0%} of steps")

    bandwidth = copy_bandwidth(device, 1 << 30 if cuda else 1 << 26)
    table["copy GB/s"] = bandwidth / 1e9
    table["rounds"] = []
    for batch in BATCHES:
        ms = round_ms(graphs, batch, vocab)
        floor = 1e3 * floor_bytes(target, drafter, batch, PROMPT + 48) / bandwidth
        row = {"batch": batch, "ms_per_round": ms, "floor_ms": floor, "floor / measured": floor / ms}
        table["rounds"].append(row)
        print(json.dumps(row), flush=True)
        save()
    print(f"\n| batch | median ms/round ({'graphs' if cuda else 'eager'}, {a.backend}) | bandwidth floor ms | floor / "
          f"measured |\n|---|---|---|---|")
    for r in table["rounds"]:
        print(f"| {r['batch']} | {r['ms_per_round']:.2f} | {r['floor_ms']:.2f} | {r['floor / measured']:.2f} |")


if __name__ == "__main__":
    main()
