"""The GPU path against the CPU path's oracles (skipped without CUDA; flashinfer tests also
without flashinfer): flashinfer attention == the torch backend on the same caches and layouts
(ragged prefill, causal verify, non-causal sliding draft); the torch backend on the GPU == on
the CPU; a CUDA-graph round == the eager round, token for token and round for round; speculative
greedy == target-only greedy under graphs; the same for the tiny Kimi-K3 + DFlash2-MLA pair through
its GPU kernels (fla's KDA, the Triton MXFP4 MoE and AttnRes), and fla's chunked KDA == the torch
form. Run by benchmarks/gpu_check.sh."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_batch.testing import checkpoints
from dflash_batch.backends.meta import AttnMeta
from dflash_batch.backends.torch_attention import TORCH
from dflash_batch.engine import choice
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.pair import attach_drafter
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.models.loader import load_model
from dflash_batch.plan.buckets import Bucket

CUDA = torch.cuda.is_available()
FLASHINFER = CUDA and importlib.util.find_spec("flashinfer") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
needs_flashinfer = pytest.mark.skipif(not FLASHINFER, reason="needs flashinfer")
# flashinfer's kernels take head_dim 64/128/256: the GPU pair has 64-wide heads.
SHAPE = dict(vocab=64, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512)


HEAD_SCALE = 10.0  # the pairs' heads: peaked enough that few greedy steps are near ties (compared_to_near_ties)


def qwen_pair(d: Path) -> tuple[Path, Path]:
    """The Qwen3 pair, its target's head replaced by a peaked one (kimi_pair.peaked_head: eight
    likely tokens spread along one direction) so that greedy argmaxes mostly have margins."""
    from dflash_batch.testing.kimi_pair import ACTIVE, peaked_head

    target = checkpoints.qwen3_checkpoint(d / "target", layers=4, **SHAPE)
    weights = load_file(target / "model.safetensors")
    weights["lm_head.weight"] = peaked_head(0, HEAD_SCALE, ACTIVE, SHAPE["vocab"], hidden=SHAPE["hidden"])
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target, checkpoints.dflash_checkpoint(d / "drafter", version=1, layers=2, sliding_window=24, **SHAPE)


def kimi_pair(d: Path) -> tuple[Path, Path]:
    from dflash_batch.testing.kimi_pair import make_kimi_pair

    return make_kimi_pair(d, head_scale=HEAD_SCALE)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return qwen_pair(tmp_path_factory.mktemp("gpu_pair"))


def load(pair, device: str, dtype=torch.float32, speculative: bool = True):
    target = load_model(pair[0], dtype, device)
    drafter = None
    if speculative:
        drafter = load_model(pair[1], dtype, device)
        attach_drafter(target, drafter)
    return target, drafter


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 63, (int(k),), generator=g).tolist() for k in torch.randint(1, 90, (n,), generator=g)]


def completions(engine: Engine, n: int, max_num_seqs: int = 6, speculation: bool = True, **sampling) -> dict:
    reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=5 + 7 * (i % 5), seed=40 + i, **sampling))
            for i, p in enumerate(prompts(n))]
    return {c.key: c for c in engine.generate(reqs, Bucket(0, "0-256", 256, max_num_seqs, speculation, None))}


def outcome(c) -> tuple:
    return c.token_ids, c.spec.per_round if c.spec else None


def outcomes(engine: Engine, n: int, max_num_seqs: int = 6, speculation: bool = True, **sampling) -> dict:
    return {key: outcome(c) for key, c in completions(engine, n, max_num_seqs, speculation, **sampling).items()}


# Greedy runs that round differently (bfloat16 through other kernels or verify widths; TF32 in
# fla's chunked prefill against the CPU's float32) can flip a near tie and prove nothing there:
# such a comparison goes up to each sequence's first step whose top-2 margin in the reference run
# is under the margin, which a peaked head keeps to few steps (tests/test_gpu_check_plan.py counts
# them on the CPU).
BF16_MARGIN = 0.1   # nats: bfloat16 keeps 8 significant bits; logits of ~3 move by a few hundredths
TF32_MARGIN = 0.05  # nats: TF32 keeps 10; the tiny Kimi pair's logits move by under 0.01
MOSTLY = 0.5        # of the steps, at least, compared (on the CPU: 64-94% with these heads)


def compared_to_near_ties(got: dict, want: dict, margin: float) -> int:
    """Steps compared: each sequence of `got` (outcomes) against `want` (completions with
    logprobs=2) up to its first step whose margin in `want` is under `margin`, its accepted drafts
    per round too where there is none."""
    compared = 0
    for key, c in want.items():
        margins = [top[0] - top[1] for top in c.logprobs.top]
        n = next((i for i, m in enumerate(margins) if m < margin), len(margins))
        assert got[key][0][:n] == c.token_ids[:n], f"{key}: tokens differ before any near tie"
        if n == len(margins):
            assert got[key][1] == outcome(c)[1], f"{key}: accepted drafts differ"
        compared += n
    return compared


def steps(runs: dict) -> int:
    return sum(len(c.token_ids) for c in runs.values())


# -- flashinfer attention == torch attention -------------------------------------------------------
def caches(slots: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(slots, 2, 64, generator=g, device="cuda").to(dtype),
            torch.randn(slots, 2, 64, generator=g, device="cuda").to(dtype))


def ragged_meta(seqs: list[tuple[int, int, list[int]]], page: int) -> AttnMeta:
    """(context length, new rows, pages) per sequence: rows at positions context..context+new-1."""
    from dflash_batch.engine.cache import SeqRows, build_meta
    rows = [SeqRows(pages, ctx, new, ctx + new) for ctx, new, pages in seqs]
    return build_meta(rows, page, None, "cuda", name="prefill")


PREFILL = [(0, 37, list(range(0, 4))), (70, 1, list(range(10, 16))), (100, 9, list(range(20, 28))), (5, 8, [33])]
# A draft: blocks of 8 rows after their context; a window longer than the block (the two
# backends' windows differ on the right of a query, which a block shorter than it never reaches).
DRAFT = [(0, 8, [0]), (70, 8, list(range(10, 16))), (100, 8, list(range(20, 28))), (30, 8, [33, 34, 35])]


@needs_flashinfer
@pytest.mark.parametrize("causal, window, rows", [(True, None, PREFILL), (False, None, PREFILL), (False, 24, DRAFT)],
                         ids=["causal", "full", "sliding_draft"])
def test_flashinfer_attention_matches_torch(causal, window, rows):
    from dflash_batch.backends.flashinfer_attention import FlashInferAttention

    page = 16
    k, v = caches(40 * page)
    meta = ragged_meta(rows, page)
    q = torch.randn(meta.num_rows, 4, 64, device="cuda").to(torch.bfloat16)
    fi = FlashInferAttention("cuda")
    fi.plan(meta)
    got = fi.attend(q, k, v, meta, 64 ** -0.5, causal, window).float()
    meta.backend = TORCH
    want = TORCH.attend(q.float(), k.float(), v.float(), meta, 64 ** -0.5, causal, window)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@needs_flashinfer
@pytest.mark.parametrize("seqs, causal, window", [
    ([(37, 0), (1, 70), (9, 100), (8, 5)], True, None),   # ragged prefill chunks and a verify
    ([(8, 0), (8, 70), (8, 13), (8, 31)], False, None),   # the drafter's full layer
    ([(8, 3), (8, 70), (8, 13), (8, 29)], False, 21),     # a sliding layer: window and edge strip
], ids=["prefill_causal", "draft_full", "draft_window"])
def test_flashinfer_latent_matches_torch(seqs, causal, window):
    """Absorbed MLA at Kimi-K3's latent (512 + 64, 16 heads), bf16, through flashinfer's MLA
    wrapper == the torch backend on the same cache (tests/test_flashinfer_latent.py checks the
    same cases on the CPU with the wrapper emulated)."""
    from dflash_batch.backends.flashinfer_attention import FlashInferAttention
    from tests.paged_layouts import scattered_meta

    page, g = 16, torch.Generator(device="cuda").manual_seed(len(seqs))
    meta = scattered_meta(seqs, page, "cuda")
    cache = torch.randn(64 * page, 1, 576, generator=g, device="cuda").to(torch.bfloat16)
    q = torch.randn(meta.num_rows, 16, 576, generator=g, device="cuda").to(torch.bfloat16)
    fi = FlashInferAttention("cuda")
    fi.plan(meta)
    got = fi.attend_latent(q, cache, 512, meta, 192 ** -0.5, causal, window).float()
    meta.backend = TORCH
    want = TORCH.attend_latent(q.float(), cache.float(), 512, meta, 192 ** -0.5, causal, window)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@needs_flashinfer
def test_flashinfer_latent_split_halves_merge_to_the_whole_under_graphs():
    """The latent split on one GPU (tests/latent_halves.py): flashinfer's MLA attention (bf16, Kimi-K3's
    512 + 64 latent) over a cache's interleaved halves, each captured in a CUDA graph and replayed,
    merged by the log-sum-exps it returns == over the whole cache; averaged without them, not."""
    import flashinfer

    from tests.latent_halves import split_halves_error

    merged, lse, plain = split_halves_error(flashinfer.mla.BatchMLAPagedAttentionWrapper, "cuda", graphs=True)
    assert merged < 2e-2 and lse < 1e-2 and plain > 0.1, (merged, lse, plain)

# -- engines ---------------------------------------------------------------------------------------
def test_torch_backend_on_gpu_matches_cpu(pair):
    cpu = outcomes(Engine(*load(pair, "cpu")), 7)
    gpu = outcomes(Engine(*load(pair, "cuda"), device="cuda"), 7)
    assert gpu == cpu


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, top_p=0.9)], ids=["greedy", "sampled"])
def test_cuda_graphs_equal_eager_torch_backend(pair, sampling):
    models = load(pair, "cuda")
    eager = outcomes(Engine(*models, device="cuda"), 9, **sampling)
    graphs = outcomes(Engine(*models, device="cuda", cuda_graphs=True, capture_sizes=[1, 2, 4, 8]), 9, **sampling)
    assert graphs == eager
    assert any(n for _, rounds in eager.values() for n in rounds), "no draft accepted"


@needs_flashinfer
def test_flashinfer_engine_matches_torch_engine(pair):
    from dflash_batch.backends.flashinfer_attention import FlashInferAttention

    models = load(pair, "cuda", torch.bfloat16)
    ref = completions(Engine(*models, device="cuda", dtype=torch.bfloat16), 7, logprobs=2)
    got = outcomes(Engine(*models, device="cuda", dtype=torch.bfloat16, attention=FlashInferAttention("cuda")), 7)
    assert compared_to_near_ties(got, ref, BF16_MARGIN) >= MOSTLY * steps(ref)


@needs_flashinfer
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, top_p=0.9)], ids=["greedy", "sampled"])
def test_cuda_graphs_equal_eager_flashinfer(pair, sampling):
    from dflash_batch.backends.flashinfer_attention import FlashInferAttention

    models = load(pair, "cuda", torch.bfloat16)

    def engine(**kw) -> Engine:
        return Engine(*models, device="cuda", dtype=torch.bfloat16, attention=FlashInferAttention("cuda"), **kw)

    eager = outcomes(engine(), 9, **sampling)
    graphs = outcomes(engine(cuda_graphs=True, capture_sizes=[1, 2, 4, 8]), 9, **sampling)
    assert graphs == eager


@needs_flashinfer
def test_flashinfer_speculative_greedy_equals_target_greedy_under_graphs(pair):
    from dflash_batch.backends.flashinfer_attention import FlashInferAttention

    models = load(pair, "cuda", torch.bfloat16)
    engine = Engine(*models, device="cuda", dtype=torch.bfloat16, attention=FlashInferAttention("cuda"),
                    cuda_graphs=True, capture_sizes=[1, 2, 4, 8])
    spec = {key: (tokens, None) for key, (tokens, _) in outcomes(engine, 9).items()}
    plain = completions(engine, 9, speculation=False, logprobs=2)
    assert compared_to_near_ties(spec, plain, BF16_MARGIN) >= MOSTLY * steps(plain)


# -- Kimi-K3 + DFlash2-MLA: KDA through fla, Triton MXFP4 MoE and AttnRes, torch attention -------------
needs_fla = pytest.mark.skipif(not (CUDA and importlib.util.find_spec("fla") is not None), reason="needs fla-core")


@needs_fla
@pytest.mark.parametrize("T", [1, 100, 1000])
def test_kda_chunked_kernel_equals_torch(T):
    """fla's chunk_kda (prefill) in our layouts == the torch chunked form in float64, at Kimi-K3's
    head size. On sm_90 its float32 dots run as TF32 (Triton's default for a float32 tl.dot, and
    fla asks 'tf32' for its triangular solve): 10 significant bits, so 3e-3 of the largest value
    rather than float32's rounding."""
    from dflash_batch.kernels import kda
    from dflash_batch.models.layers.kda import kda_chunked, l2norm

    g = torch.Generator().manual_seed(T)
    H, d = 4, 128
    q, k = (l2norm(torch.randn(T, H, d, generator=g)) for _ in range(2))
    v = torch.randn(T, H, d, generator=g)
    gate, beta, state = -5 * torch.rand(T, H, d, generator=g), torch.rand(T, H, generator=g), torch.randn(H, d, d)
    want_o, want_S = kda_chunked(*(x.double() for x in (q, k, v, gate, beta, state)))
    o, S = kda.chunked(*(x.cuda() for x in (q, k, v, gate, beta, state)))
    torch.testing.assert_close(o.cpu().double(), want_o, atol=3e-3 * want_o.abs().max().item(), rtol=0)
    torch.testing.assert_close(S.cpu().double(), want_S, atol=3e-3 * want_S.abs().max().item(), rtol=0)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return kimi_pair(tmp_path_factory.mktemp("kimi_pair"))


def kimi_outcomes(engine: Engine, n: int = 9, speculation: bool = True, **sampling) -> dict:
    return outcomes(engine, n, 6, speculation, **sampling)


@needs_fla
def test_kimi_on_gpu_matches_cpu(kimi):
    """Every GPU kernel of the pair (fla KDA, Triton MoE and AttnRes) against the CPU's float32
    torch path: the same tokens and accepted drafts. fla's chunked prefill runs its float32 dots
    as TF32 on sm_90 (10 significant bits; everything else here stays float32: torch keeps TF32
    off for float32 matmuls, the MoE kernel asks IEEE), so each sequence is compared up to its
    first greedy step whose margin on the CPU is under TF32_MARGIN; the peaked head keeps that
    to a few steps (tests/test_gpu_check_plan.py counts them on the CPU)."""
    cpu = completions(Engine(*load(kimi, "cpu")), 9, logprobs=2)
    gpu = kimi_outcomes(Engine(*load(kimi, "cuda"), device="cuda"))
    assert compared_to_near_ties(gpu, cpu, TF32_MARGIN) >= MOSTLY * steps(cpu)


@needs_fla
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, top_p=0.9)], ids=["greedy", "sampled"])
def test_kimi_cuda_graphs_equal_eager(kimi, sampling, monkeypatch):
    """Sampled, the captured rounds also gather and sample their verify rows two sequences at a
    time (engine/choice.py: the loop and its gathers captured), the eager ones all at once."""
    models = load(kimi, "cuda")
    eager = kimi_outcomes(Engine(*models, device="cuda"), **sampling)
    monkeypatch.setattr(choice, "group_rows", lambda vocab: 2 * 8)
    graphs = kimi_outcomes(Engine(*models, device="cuda", cuda_graphs=True, capture_sizes=[1, 2, 4, 8]), **sampling)
    assert graphs == eager
    assert any(n for _, rounds in eager.values() for n in rounds), "no draft accepted"


@needs_fla
def test_kimi_speculative_greedy_equals_target_greedy_under_graphs(kimi):
    engine = Engine(*load(kimi, "cuda"), device="cuda", cuda_graphs=True, capture_sizes=[1, 2, 4, 8])
    spec = kimi_outcomes(engine)
    plain = kimi_outcomes(engine, speculation=False)
    assert {k: v[0] for k, v in spec.items()} == {k: v[0] for k, v in plain.items()}


# -- two GPUs: TP2 over NCCL ------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_nccl_matches_tp1(pair, tmp_path):
    """The Qwen3 pair on two ranks over NCCL, rounds captured as CUDA graphs (all-reduces inside
    them) == one GPU eager: the same tokens and accepted drafts per round, greedy and sampled."""
    import socket

    from tests import engine_tp_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runs = {"greedy": dict(max_new_tokens=24), "sampled": dict(max_new_tokens=24, temperature=1.0, top_p=0.95)}
    engine_tp_worker.assert_tp2_equals_tp1(str(pair[0]), str(pair[1]), prompts(6), runs, str(tmp_path), port,
                                           graphs=True, device="cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("graphs, lanes", [(True, 1), (False, 2)], ids=["captured rounds", "2 lanes"])
def test_pp2_nccl_matches_tp1(pair, tmp_path, graphs, lanes):
    """The Qwen3 pair as two pipeline stages of one GPU each over NCCL == one GPU eager: rounds
    captured as CUDA graphs (the hand-off, the drafts and the results sent inside them), or in two
    interleaved lanes (engine/lanes.py: the last stage's posts over the peers' communicator while
    hand-offs go the other way over the run's)."""
    import socket

    from tests import engine_tp_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runs = {"greedy": dict(max_new_tokens=24), "sampled": dict(max_new_tokens=24, temperature=1.0, top_p=0.95)}
    engine_tp_worker.assert_tp2_equals_tp1(str(pair[0]), str(pair[1]), prompts(6), runs, str(tmp_path), port,
                                           graphs=graphs, device="cuda", stages=2, micro_batches=lanes)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kimi_dp2_with_experts_over_two_gpus_nccl_matches_one_gpu(tmp_path):
    """The Kimi-K3 pair in two data-parallel groups of one GPU each, the routed experts (MXFP4,
    through the Triton MoE) sharded over both and dispatched over NCCL, one group's rows done long
    before the other's: each group's tokens == one GPU's with every expert, greedy (float32, eager:
    such rounds are not captured yet)."""
    import socket

    import torch.multiprocessing as mp

    from tests import expert_parallel_worker as worker

    target, drafter = kimi_pair(tmp_path / "pair")
    prompts_ = [[(5 * i + 7 * j) % 90 + 3 for j in range(4 + 11 * i)] for i in range(4)]
    max_new, runs = [4, 64, 4, 64], {"greedy": {}}
    want = worker.generate(str(target), str(drafter), prompts_, {}, max_new, device="cuda")[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker.run, args=(2, port, 2, str(target), str(drafter), prompts_, max_new, runs, "default",
                               str(tmp_path), True, False, "cuda"), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for i, row in got["greedy"]["rows"].items():
            assert row["tokens"] == want[i]["tokens"], (rank, i)
