"""The memory plan (sizing.py) against what the CPU allocator sees (every allocation and free it
reports to torch's profiler), for both model families (a tiny Qwen3 + DFlash2 drafter, the tiny
Kimi-K3 + DFlash2-MLA pair): the meta-device weights equal the bytes loading the checkpoint
allocates, at one rank and at rank 0 of two; each bucket's caches and decoding state equal the
bytes Engine.allocate allocates, and an auto bucket's the batch it switches to; the activations'
bound holds over the allocator's peak of a real run of the bucket and of its rounds, greedy and
sampled, within a factor of it, and its terms over what they stand for (the sampler's copies, the
Triton MoE's rows). The plan does not depend on what the planning host has installed, and the
production job files keep a headroom beyond the reserve."""

from __future__ import annotations

import bisect
import importlib.machinery
import importlib.util
import itertools
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch.profiler import ProfilerActivity, profile, record_function

from dflash_batch import parallel
from dflash_batch.backends.latent_split import LatentSplit
from dflash_batch.backends.torch_attention import TORCH, TorchAttention
from dflash_batch.build import EngineSetup
from dflash_batch.cli import main
from dflash_batch.engine import choice
from dflash_batch.engine import heads as heads_module
from dflash_batch.engine.engine import Engine, runtime_tensors
from dflash_batch.engine.heads import LIVE_HEADS
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.job import JobError, gpu_bytes, load_job
from dflash_batch.kernels import _triton, kda, moe_mxfp4, ops
from dflash_batch.models import activations
from dflash_batch.models.loader import load_model
from dflash_batch.plan.buckets import plan_buckets
from dflash_batch.plan.roofline import experts_touched
from dflash_batch.plan.memory import planned_expert_bytes
from dflash_batch.sizing import GB, fit_job, plan_job, smallest_tp
from dflash_batch.testing.kimi import make_kimi_checkpoint
from dflash_batch.testing.kimi_pair import make_kimi_pair
from tests.engine_util import load_pair, make_drafter, make_target

CPU = EngineSetup("cpu", "torch", False, False, [1, 2, 4], "torch")  # rounds padded as under graphs
MARGIN = 2.0  # the activations' bound is at most this many times the measured peak
TERM_MARGIN = 1.5  # a term of the bound, at most this many times the bytes it stands for


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sizing")
    make_target(d / "qwen3", vocab=16384, peaked=False)  # the round's logits outweigh its layers
    make_drafter(d / "qwen3_drafter", version=2, vocab=16384)
    kimi, kimi_drafter = make_kimi_pair(d / "kimi", moe_intermediate_size=64)  # whole scale groups at TP2
    out = {}
    for family, (target, drafter) in {"qwen3": (d / "qwen3", d / "qwen3_drafter"), "kimi": (kimi, kimi_drafter)}.items():
        doc = {"input": {"paths": ["prompts.jsonl"], "prompt_column": "prompt"},
               "model": {"target": str(target), "drafter": str(drafter), "dtype": "float32"},
               "engine": {"max_model_len": 384, "max_num_seqs": 3, "max_num_batched_tokens": 96},
               "buckets": [{"max_tokens": 128, "max_num_seqs": 3}, {"max_tokens": 256, "max_num_seqs": 2},
                           {"max_tokens": 384, "max_num_seqs": 2, "speculation": False}],
               "sampling": {"max_new_tokens": 24}, "output": {"dir": "out"}}
        (d / f"{family}.yaml").write_text(yaml.safe_dump(doc))
        out[family] = load_job(d / f"{family}.yaml")
    return out


def allocations(fn):
    """fn's result, every allocation (+bytes) and free (-bytes) the CPU allocator reported to the
    profiler while it ran, as (time, bytes), and the spans fn marked with record_function, as
    (name, start, end)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    return (result, [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"],
            [(e.name(), e.start_ns(), e.end_ns()) for e in events if e.is_user_annotation()])


def allocator(fn):
    """fn's result, the bytes it left allocated and its peak above what was allocated before."""
    result, events, _ = allocations(fn)
    lives = list(itertools.accumulate(size for _, size in events))
    return result, lives[-1] if lives else 0, max(lives, default=0)


def phase_peaks(engine: Engine, fn, steps=("_prefill", "_round")) -> tuple[int, dict[str, tuple[int, int]]]:
    """fn's peak above what was allocated before it, and per engine method in `steps`: (the most
    one of its calls allocated above what was allocated when it began; what its last call left
    allocated, above what was allocated before fn)."""
    for name in steps:
        step = getattr(engine, name)
        setattr(engine, name, lambda *a, _step=step, _name=name, **k: _marked(_name, _step, *a, **k))
    _, events, spans = allocations(fn)
    times = [t for t, _ in events]
    lives = list(itertools.accumulate(size for _, size in events))
    out: dict[str, tuple[int, int]] = {}
    for name, start, end in (span for span in spans if span[0] in steps):
        first, last = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        before = lives[first - 1] if first else 0
        rise = max((lives[i] - before for i in range(first, last)), default=0)
        out[name] = max(out.get(name, (0, 0))[0], rise), lives[last - 1] if last else 0
    return max(lives, default=0), out


def _marked(name: str, step, *args, **kwargs):
    with record_function(name):
        return step(*args, **kwargs)


def cpu_engine(job, target, drafter) -> Engine:
    return Engine(target, drafter, page_size=job.engine.page_size,
                  max_num_batched_tokens=job.engine.max_num_batched_tokens, device="cpu", attention=TORCH,
                  capture_sizes=CPU.capture_sizes)


@pytest.mark.parametrize("family", ["qwen3", "kimi"])
@pytest.mark.parametrize("tp", [1, 2])
def test_weights_are_the_bytes_loading_allocates(jobs, family, tp, monkeypatch, tmp_path):
    job = jobs[family]
    plan = plan_job(job, tmp_path, 80 * GB, tp=tp, setup=CPU)
    monkeypatch.setattr(parallel, "world_size", lambda: tp)
    for role in ("target", "drafter"):
        _, loaded, _ = allocator(lambda: load_model(getattr(job.model, role)))
        planned = sum(v for k, v in plan.weights.items() if k.startswith(role))
        assert loaded == planned, role
    if family == "kimi":
        assert plan.weights["target weights uint8 (MXFP4 packed)"] > 0


@pytest.mark.parametrize("family", ["qwen3", "kimi"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("features", [False, True])
def test_caches_and_state_are_the_bytes_the_engine_allocates(jobs, family, tp, features, tmp_path, monkeypatch):
    """One engine through the job's buckets in order (a speculating bucket, then one that is not):
    what it holds after each is the plan's bucket, and the previous bucket's caches and graphs are
    gone before the next one's come."""
    job = jobs[family]
    if features:  # logprobs and penalties: vocabulary-wide tensors in every row
        job = job.model_copy(update={"sampling": job.sampling.model_copy(update={"logprobs": 2,
                                                                                  "repetition_penalty": 1.1})})
    plan = plan_job(job, tmp_path, 80 * GB, tp=tp, setup=CPU)
    monkeypatch.setattr(parallel, "world_size", lambda: tp)
    target, drafter = load_pair(Path(job.model.target), Path(job.model.drafter))
    engine = cpu_engine(job, target, drafter)
    held = previous = 0
    for need in plan.whole.needs:
        # A row asking for logprobs and penalties makes the batch grow (DecodeBatch.put); the plan grows it ahead.
        _, allocated, peak = allocator(lambda: engine.allocate(need.bucket).allocate_for(False, features, features))
        held += allocated
        # (the shared heads' kept states are allocated as heads are kept: test_kept_heads_...)
        assert held == need.caches + need.batch - need.parts.get("kept head states", 0), need.bucket.name
        if previous:  # the old bucket's caches go as the new one's come, not after
            assert held - allocated + peak < previous + need.caches + need.batch, need.bucket.name
        previous = held
    assert not plan.whole.needs[2].bucket.speculation and not runtime_tensors([drafter])  # its caches freed
    assert plan.whole.needs[0].caches != plan.whole.needs[1].caches  # more sequences, longer rows: not a constant


def kept_bytes(monkeypatch) -> list[int]:
    """The bytes of each head's kept state, as the engine keeps it (engine/heads.py's Kept: the
    target's recurrent state and the drafter's ring rows), appended as heads are kept."""
    seen, kept = [], heads_module.Kept

    def spy(state, rings, *rest):
        seen.append(sum(t.nbytes for t in [*(state or []), *rings]))
        return kept(state, rings, *rest)

    monkeypatch.setattr(heads_module, "Kept", spy)
    return seen


def share_a_head(engine: Engine, bucket) -> None:
    """Three rows whose prompts share a 70-token head (one head kept, two members enter it)."""
    head = torch.randint(0, engine.vocab_size, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    reqs = [Request((str(i), 0), head + [i + 1], SamplingParams(max_new_tokens=4)) for i in range(3)]
    list(engine.generate(reqs, bucket))


def test_kept_heads_are_the_bytes_the_heads_keep(jobs, tmp_path, monkeypatch):
    """The plan's "kept head states" are what two heads keep at their ends: the Kimi-K3's KDA
    states (conv windows and delta-rule states of a sequence) and the drafter's ring of a row,
    as the engine keeps them (engine/heads.py), read off the heads it keeps; Qwen3 keeps none."""
    seen = kept_bytes(monkeypatch)
    for family, kept_something in (("kimi", True), ("qwen3", False)):
        job = jobs[family]
        need = plan_job(job, tmp_path, GB, setup=CPU).whole.needs[0]  # a GPU nothing fits: no search
        target, drafter = load_pair(Path(job.model.target), Path(job.model.drafter))
        seen.clear()
        share_a_head(cpu_engine(job, target, drafter), need.bucket)
        assert len(seen) == 1 and (seen[0] > 0) == kept_something, family
        assert need.parts.get("kept head states", 0) == LIVE_HEADS * seen[0], family


class _MirroredRanks:
    """torch.distributed as parallel.py calls it, for rank 0 of two in one process, rank 1 holding
    what rank 0 holds: each collective's shapes, not its sums (what a head keeps is sized by
    shapes alone)."""

    ReduceOp = torch.distributed.ReduceOp

    @staticmethod
    def is_available() -> bool:
        return False  # parallel.rank(): 0

    @staticmethod
    def get_backend(group=None) -> str:
        return "gloo"

    @staticmethod
    def all_reduce(x: torch.Tensor, op=None, group=None) -> None:
        pass

    @staticmethod
    def all_gather(parts: list[torch.Tensor], x: torch.Tensor, group=None) -> None:
        for part in parts:
            part.copy_(x)

    @staticmethod
    def all_gather_into_tensor(out: torch.Tensor, x: torch.Tensor, group=None) -> None:
        out.view(-1, *x.shape).copy_(x)

    @staticmethod
    def broadcast(t: torch.Tensor, src: int) -> None:
        pass

    @staticmethod
    def barrier() -> None:
        pass


def test_the_split_plan_keeps_the_bytes_a_split_rank_keeps(jobs, tmp_path, monkeypatch):
    """With the MLA latents split (the Kimi job at TP2), the split plan's "kept head states" are
    what rank 0 of an engine whose backend splits them keeps at two heads' ends: its KDA heads'
    states and its share of the drafter's ring rows (every other position of a row's ring span),
    read off the head it keeps, the second rank's collectives stood in (_MirroredRanks); less than
    the whole latents' plan keeps, by the rings' other half."""
    job = jobs["kimi"]
    plan = plan_job(job, tmp_path, GB, tp=2, setup=CPU, with_split=True)
    need, whole = plan.split.needs[0], plan.whole.needs[0]
    monkeypatch.setattr(parallel, "world_size", lambda: 2)
    monkeypatch.setattr(parallel, "dist", _MirroredRanks)
    target, drafter = load_pair(Path(job.model.target), Path(job.model.drafter))
    engine = Engine(target, drafter, page_size=job.engine.page_size, device="cpu",
                    max_num_batched_tokens=job.engine.max_num_batched_tokens,
                    attention=TorchAttention(LatentSplit(2, 0)), capture_sizes=CPU.capture_sizes)
    seen = kept_bytes(monkeypatch)
    share_a_head(engine, need.bucket)
    assert len(seen) == 1
    assert need.parts["kept head states"] == LIVE_HEADS * seen[0]
    assert need.parts["kept head states"] < whole.parts["kept head states"]


def _requests(bucket, n: int, vocab: int, temperature: float) -> list[Request]:
    """n prompts that fill the bucket's rows (prompt + max_new_tokens at its edge)."""
    gen = torch.Generator().manual_seed(0)
    length = bucket.max_tokens - 8 - 8
    return [Request((str(i), 0), torch.randint(0, vocab - 1, (length,), generator=gen).tolist(),
                    SamplingParams(max_new_tokens=8, temperature=temperature, seed=i)) for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_activations_bound_a_real_run_and_its_rounds_within_a_margin(jobs, family, tmp_path):
    """Greedy, then sampled: the peak of a run of the bucket (prefill chunks, then rounds) and the
    peak of its rounds each within [1, MARGIN] of their bounds (with CUDA graphs the round's is a
    pool of its own); a prefill chunk's within its bound. The Qwen3's rounds are its logits' and
    its sampler's (a vocabulary of 16384): there the sampler's copies, a sampled round less a
    greedy one, are within [1, TERM_MARGIN] of their term."""
    rounds = _greedy_then_sampled(jobs[family], tmp_path)
    if family == "qwen3":
        _assert_sampler_term(rounds)


@pytest.mark.slow
def test_the_sampler_term_is_one_group(jobs, tmp_path, monkeypatch):
    """The Qwen3's verify rows gathered and sampled one sequence (8 rows) at a time, as Kimi-K3's
    163,840 ids group them at production batch sizes (engine/choice.py): the sampled round within
    [1, MARGIN] of its bound, which counts one group's copies (sampling the 3 sequences at once
    goes past it: 15.4 MB against 9.6; a plan counting every row's copies, 19.0 MB, is 3.4x)."""
    monkeypatch.setattr(choice, "group_rows", lambda vocab: 8)
    _greedy_then_sampled(jobs["qwen3"], tmp_path)


def _greedy_then_sampled(job, tmp_path) -> dict[bool, tuple[int, int]]:
    """{sampled: (the rounds' measured peak, their bound)}, each run's and round's peaks checked."""
    rounds = {}
    for sampled in (False, True):
        if sampled:
            job = job.model_copy(update={"sampling": job.sampling.model_copy(update={"temperature": 1.0})})
        plan = plan_job(job, tmp_path, 80 * GB, setup=CPU)
        target, drafter = load_pair(Path(job.model.target), Path(job.model.drafter))
        need, bucket = plan.whole.needs[0], plan_buckets(job)[0]
        engine = cpu_engine(job, target, drafter)
        engine.allocate(bucket)  # the bucket's caches and state, which generate keeps: only activations are measured
        requests = _requests(bucket, bucket.max_num_seqs, target.vocab_size, job.sampling.temperature)
        peak, steps = phase_peaks(engine, lambda: list(engine.generate(requests, bucket)))
        (prefill, _), (round_, _) = steps["_prefill"], steps["_round"]
        bound = max(need.prefill, need.round)
        print(f"{type(target).__name__} sampled={sampled}: run {peak:,} B, bound {bound:,} B "
              f"({bound / peak:.2f}x); round {round_:,} B, bound {need.round:,} B ({need.round / round_:.2f}x); "
              f"prefill {prefill:,} B, bound {need.prefill:,} B ({need.prefill / prefill:.2f}x)")
        assert peak <= bound <= MARGIN * peak, (peak, need.prefill, need.round)
        assert round_ <= need.round <= MARGIN * round_
        assert prefill <= need.prefill
        rounds[sampled] = round_, need.round
    return rounds


def _assert_sampler_term(rounds: dict[bool, tuple[int, int]]) -> None:
    copies, term = rounds[True][0] - rounds[False][0], rounds[True][1] - rounds[False][1]
    print(f"sampler: {copies:,} B, term {term:,} B ({term / copies:.2f}x)")
    assert copies <= term <= TERM_MARGIN * copies


class _NoLaunch:
    """A Triton kernel whose launches do nothing: what a launch allocates is its launcher's."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_the_moe_term_bounds_the_rows_the_triton_moe_keeps(tmp_path, monkeypatch):
    """A Kimi-K3 MoE layer's forward on the GPU path (kernels/moe_mxfp4.py's Triton MoE keeps a row
    of each expert width for every (token, slot)), wide experts: with none shared, so that the
    routed rows are its peak, at 2 and 8 experts a token, and with one shared expert, whose
    float32 SiTU runs after the routed sum: each within [1, MARGIN] of the bound; and 8 experts a
    token less 2 within [1, TERM_MARGIN] of the bound's difference. The kernels' launches are
    stubbed: on a GPU they allocate nothing beyond their launcher (Triton's interpreter would keep
    their arguments past the call), and this runs without Triton too."""
    monkeypatch.setattr(moe_mxfp4, "_gate_up_kernel", _NoLaunch())
    monkeypatch.setattr(moe_mxfp4, "_down_kernel", _NoLaunch())
    monkeypatch.setattr(moe_mxfp4, "_dot_dtype", lambda dtype: None)
    monkeypatch.setattr(ops, "for_device", lambda device: ops.TRITON)
    tokens, peaks, bounds = 32, {}, {}
    for top_k, shared in ((2, 0), (8, 0), (2, 1)):
        model = load_model(make_kimi_checkpoint(tmp_path / f"{top_k}_{shared}", moe_intermediate_size=512,
                                                num_experts_per_token=top_k, num_shared_experts=shared), torch.float32)
        moe = model.model.layers[1].block_sparse_moe
        x = torch.randn(tokens, moe.gate.weight.shape[1])
        with torch.inference_mode():
            _, _, peak = allocator(lambda: moe(x))
        bound = tokens * activations.widths(model, 4, torch_kernels=False).layer
        print(f"top_k {top_k}, shared {shared}: peak {peak:,} B, bound {bound:,} B ({bound / peak:.2f}x)")
        assert peak <= bound <= MARGIN * peak, (top_k, shared)
        peaks[top_k, shared], bounds[top_k, shared] = peak, bound
    rows, term = peaks[8, 0] - peaks[2, 0], bounds[8, 0] - bounds[2, 0]
    assert rows <= term <= TERM_MARGIN * rows, (rows, term)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_an_auto_bucket_holds_the_one_row_batch_it_switches_to(jobs, family, tmp_path):
    """A bucket with speculation: auto that turns it off builds the decoding state of one-row
    rounds beside its own (logprobs and penalties asked: vocabulary-wide tensors in both). What
    the engine holds once switched is the plan's caches and batch, which count it, to the byte;
    less, on the Kimi-K3, the verify staging it no longer needs (one row a sequence, not 8)."""
    job = jobs[family]
    job = job.model_copy(update={
        "sampling": job.sampling.model_copy(update={"logprobs": 2, "repetition_penalty": 1.1}),
        "buckets": [job.buckets[0].model_copy(update={"speculation": "auto"}), *job.buckets[1:]]})
    plan = plan_job(job, tmp_path, 80 * GB, setup=CPU)
    need, bucket = plan.whole.needs[0], plan_buckets(job)[0]
    target, drafter = load_pair(Path(job.model.target), Path(job.model.drafter))
    log = []
    engine = Engine(target, drafter, page_size=job.engine.page_size,
                    max_num_batched_tokens=job.engine.max_num_batched_tokens, device="cpu", attention=TORCH,
                    capture_sizes=CPU.capture_sizes, auto_speculation=(9.0, 3), log=log.append)  # no block reaches 9
    asks = dict(max_new_tokens=8, logprobs=2, repetition_penalty=1.1)
    requests = [Request(r.key, r.prompt_ids, SamplingParams(seed=i, **asks))
                for i, r in enumerate(_requests(bucket, bucket.max_num_seqs, target.vocab_size, 0.0))]
    # Allocated while the allocator is watched (it reports no free of a block allocated before), and
    # before generate, which goes on with that bucket state, as with each window of a run's rows.
    _, steps = phase_peaks(engine, lambda: (engine.allocate(bucket), list(engine.generate(requests, bucket))),
                           ("_stop_speculating",))
    assert any("speculation off (auto)" in line for line in log), log
    _, held = steps["_stop_speculating"]
    print(f"{family}: held once switched {held:,} B, planned {need.caches + need.batch:,} B")
    staging = [t for layer in getattr(target.model, "layers", []) if getattr(layer, "is_kda", False)
               for t in (layer.self_attn.staged_raw, layer.self_attn.staged_g, layer.self_attn.staged_beta)]
    assert {t.shape[1] for t in staging} <= {1}  # one row a sequence now
    shrunk = (drafter.block_size - 1) * sum(t.nbytes for t in staging)
    assert held == need.caches + need.batch - shrunk - need.parts.get("kept head states", 0)


def test_a_gpu_of_the_plans_sum_holds_the_bucket_and_a_byte_less_does_not(jobs, tmp_path):
    """The fit inequality (sizing.fits) wherever the plan asks it: a GPU whose reserve leaves
    exactly the weights, the attention workspace, the headroom (engine.gpu_memory_headroom of the
    GPU) and the tightest bucket's total holds the job: the plan fits, that bucket's largest is its
    max_num_seqs, and smallest_tp finds it fits as written at one rank; a byte more of reserve and
    none of them holds."""
    share, gpu = 0.25, 80 * GB
    engine = jobs["kimi"].engine.model_copy(update={"gpu_memory": "80", "gpu_memory_headroom": share})
    job = jobs["kimi"].model_copy(update={"engine": engine})
    sized = plan_job(job, tmp_path, GB)  # needs and weights do not depend on the GPU; nothing fits 1 GB: no search
    tightest = max(range(len(sized.whole.needs)), key=lambda i: sized.whole.needs[i].total)
    need, headroom = sized.whole.needs[tightest], gpu // 4
    reserve = gpu - sum(sized.weights.values()) - sized.fixed["attention workspace"] - headroom - need.total
    for more, holds in ((0, True), (1, False)):
        plan = plan_job(job, tmp_path, gpu, reserve=reserve + more)
        assert plan.fixed[f"headroom (gpu_memory_headroom {share:g})"] == headroom
        assert plan.fits is holds and (plan.whole.largest[tightest] == need.bucket.max_num_seqs) is holds, more
        assert (smallest_tp(job, tmp_path, gpu, reserve + more, as_written=True) == 1) is holds, more


JOBS = Path(__file__).resolve().parent.parent / "jobs"


# What each production job keeps free beyond the reserve, as a share of its GPU
# (engine.gpu_memory_headroom): room for what the plan cannot see from a CPU (flashinfer's and
# cuBLAS's workspaces beyond their defaults, NCCL at 16 and 32 ranks, allocator growth over a long run).
HEADROOM = 0.03


@pytest.mark.parametrize("name, split", [
    ("kimi-k3-dflash2.yaml", True), ("kimi-k3-dflash2-128k.yaml", True), ("kimi-k3-dflash2-h200.yaml", True),
    # TP32 on page_size 16 cannot split; at page_size 32 the split would hold fewer (the gathered
    # heads of 32 ranks outweigh the latents it frees): `plan --tensor-parallel` shows both
    ("kimi-k3-dflash2-h100.yaml", False)])
def test_every_production_job_keeps_its_headroom(name, split):
    """Each job file keeps HEADROOM of its GPU free beyond the reserve as a setting (no plan command
    with a reserve in a comment), and `dflash-batch plan JOB` reads it: its table, in the layout the
    job runs, has every bucket fit at a max_num_seqs that is the largest that does; the MLA
    latents split where the job leaves engine.context_parallel to the plan and the buckets as
    written need it (each more than fits without: the 'without' lines), whole elsewhere; and the
    verdict names the table's layout."""
    job, text = load_job(JOBS / name), (JOBS / name).read_text()
    assert job.engine.gpu_memory_headroom == HEADROOM and "--reserve-gb" not in text
    result = CliRunner().invoke(main, ["plan", str(JOBS / name), "--no-roofline"])
    assert result.exit_code == 0, result.output
    out = result.output
    kept = HEADROOM * gpu_bytes(job.engine.gpu_memory) / GB
    assert re.search(rf"\n  headroom \(gpu_memory_headroom {HEADROOM:g}\) +{kept:.2f} GB\n", out), out
    rows = [line.split() for line in out.splitlines() if re.match(r"  \d+-\d+ ", line)]
    assert len(rows) == len(job.buckets) and all(seqs == largest and fits == "yes"
                                                 for _, seqs, largest, fits, *_ in rows), out
    without = re.findall(r"without the MLA latents split: caches [\d.]+ at (\d+) seqs, total [\d.]+, fits (yes|NO); "
                         r"largest seqs (\d+)", out)
    if split:
        layout = (f"with the MLA latents split {job.model.tensor_parallel_size} ways (engine.context_parallel "
                  "absent, so on: the buckets as written need it)")
        assert f" GB, {layout}:\n" in out and out.rstrip().endswith(f": fits {layout}"), out
        assert len(without) == len(rows) and all(fits == "NO" and int(largest) < int(seqs)
                                                 for seqs, fits, largest in without), out
    else:
        assert not without and out.rstrip().endswith(": fits"), out


def test_the_plan_does_not_depend_on_what_the_planning_host_has(monkeypatch):
    """The H200 job's plan on a login node (no CUDA; neither Triton, fla nor flashinfer installed)
    and on a GPU node with all of them, as the probes build.py and kernels/ use see them: the same
    output, saying what it assumed."""
    find_spec, outputs = importlib.util.find_spec, []
    try:
        for present in (False, True):
            def probe(name, *args, _present=present):
                if name.split(".")[0] in ("triton", "fla", "flashinfer"):
                    return importlib.machinery.ModuleSpec(name, None) if _present else None
                return find_spec(name, *args)

            monkeypatch.setattr(torch.cuda, "is_available", lambda _present=present: _present)
            monkeypatch.setattr(_triton, "triton", object() if present else None)
            monkeypatch.setattr(importlib.util, "find_spec", probe)
            kda.available.cache_clear()
            result = CliRunner().invoke(main, ["plan", str(JOBS / "kimi-k3-dflash2-h200.yaml"), "--no-roofline"])
            assert result.exit_code == 0, result.output
            outputs.append(result.output)
    finally:
        kda.available.cache_clear()
    assert outputs[0] == outputs[1]
    assert ("sized for a CUDA GPU with the gpu extra (flashinfer, Triton, fla-core), whatever this host has "
            "installed: device=cuda backend=flashinfer kernels=triton cuda_graphs=on") in outputs[0]


@pytest.mark.parametrize("args, error", [
    (["--tensor-parallel", "0"], "--tensor-parallel 0: give a number of 1 or more"),
    (["--tensor-parallel", "-1"], "--tensor-parallel -1: give a number of 1 or more"),
    (["--gpus-per-node", "0"], "--gpus-per-node 0: give a number of 1 or more"),
    (["--reserve-gb", "-1"], "--reserve-gb -1.0: give a number of 0 or more"),
    (["--reserve-gb", "nan"], "--reserve-gb nan: give a number of 0 or more"),
    (["--gpu-memory", "0.5"], "--gpu-memory: GPU memory '0.5': give a size in GB (1 or more) or one of h100, h200, "
                              "b200, gb300"),
    (["--gpu-memory", "0"], "--gpu-memory: GPU memory '0': give a size in GB (1 or more)"),
    (["--gpu-memory", "a100"], "--gpu-memory: GPU memory 'a100': give a size in GB (1 or more)"),
    (["--acc-len", "9"], "--acc-len: an acceptance length of 9.0 with 7 drafts a round: give 1 to 8"),
])
def test_plan_refuses_arguments_out_of_range_in_one_line(args, error):
    result = CliRunner().invoke(main, ["plan", str(JOBS / "kimi-k3-dflash2-h200.yaml"), *args])
    assert result.exit_code == 2
    assert len(result.output.splitlines()) == 1 and result.output.startswith(f"error: {error}"), result.output


@pytest.mark.parametrize("change, advice, layout", [
    # the latents split (engine.context_parallel absent: on, the buckets need it), more sequences than it holds
    (dict(max_num_seqs=300), " with the MLA latents split (lower the buckets' max_num_seqs to their 'largest'):",
     "with the MLA latents split 16 ways (engine.context_parallel absent, so on: the buckets as written need it)"),
    # without the split, the first bucket as the job was before it: TP32 holds it
    (dict(max_num_seqs=200, context_parallel=False, second=13),
     " (lower the buckets' max_num_seqs to their 'largest', or use more ranks: tensor_parallel_size 32 fits the job "
     "as written):", "without the MLA latents split (engine.context_parallel: false)"),
], ids=["split", "not split"])
def test_validate_says_what_would_make_a_job_fit(tmp_path, change, advice, layout):
    """The H200 job (TP16) with more sequences than fit its first bucket: fewer sequences, or the
    fewest ranks above its own at which it fits as written (not its own 16); the table is the
    layout the job runs, the bucket NO beside the largest that fits."""
    (tmp_path / "models").symlink_to(JOBS / "models")  # the shipped configs beside the job file
    doc = yaml.safe_load((JOBS / "kimi-k3-dflash2-h200.yaml").read_text())
    doc["buckets"][0]["max_num_seqs"] = change["max_num_seqs"]
    if "second" in change:
        doc["buckets"][1]["max_num_seqs"] = change["second"]
    if "context_parallel" in change:
        doc["engine"]["context_parallel"] = change["context_parallel"]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["validate", "--no-inputs", str(tmp_path / "job.yaml")])
    assert result.exit_code == 2, result.output
    assert f"error: engine.gpu_memory h200: the job does not fit at TP16{advice}" in result.output
    assert f"per rank, TP16, on a GPU of 141 GB, {layout}:" in result.output
    row = re.search(rf"\n  0-8192 +{change['max_num_seqs']} +(\d+) +NO ", result.output)
    assert row and 0 < int(row[1]) < change["max_num_seqs"], result.output


def test_validate_keeps_the_jobs_headroom_free(tmp_path):
    """validate (sizing.fit_job) fits the buckets with engine.gpu_memory_headroom kept free: the
    H200 job with a sequence more in its first bucket than the headroom leaves room for is
    refused, and fits on the same GPU with no headroom."""
    (tmp_path / "models").symlink_to(JOBS / "models")  # the shipped configs beside the job file
    doc = yaml.safe_load((JOBS / "kimi-k3-dflash2-h200.yaml").read_text())
    doc["buckets"][0]["max_num_seqs"] += 1
    for headroom, code in ((HEADROOM, 2), (0.0, 0)):
        doc["engine"]["gpu_memory_headroom"] = headroom
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
        result = CliRunner().invoke(main, ["validate", "--no-inputs", str(tmp_path / "job.yaml")])
        assert result.exit_code == code, result.output


def test_the_h200_job_is_refused_at_tp8_with_the_numbers():
    result = CliRunner().invoke(main, ["plan", str(JOBS / "kimi-k3-dflash2-h200.yaml"), "--gpu-memory", "h200",
                                       "--tensor-parallel", "8"])
    assert result.exit_code == 1
    assert "per rank, TP8, on a GPU of 141 GB" in result.output
    assert "alone exceed the GPU's 141 GB" in result.output
    assert "smallest tensor_parallel_size that fits one sequence a bucket: 16" in result.output


def test_validate_and_run_refuse_a_job_that_does_not_fit_before_loading_models(jobs, tmp_path):
    weights = sum(plan_job(jobs["kimi"], tmp_path, 80 * GB).weights.values())
    gpu = (8 * GB + weights // 2) / GB  # the 8 GB reserve and half the weights
    doc = {"input": {"paths": [str(tmp_path / "prompts.jsonl")], "prompt_column": "prompt"},
           "model": {"target": jobs["kimi"].model.target, "drafter": jobs["kimi"].model.drafter, "dtype": "float32"},
           "engine": {"max_model_len": 256, "gpu_memory": str(gpu)},
           "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    for command in (["validate", "--no-inputs"], ["run"]):
        result = CliRunner().invoke(main, [*command, str(tmp_path / "job.yaml")])
        assert result.exit_code == 2, result.output  # a job that cannot run, as every refused job
        assert f"engine.gpu_memory {gpu}: the job does not fit" in result.output
        assert "weights and fixed" in result.output
    assert not (tmp_path / "out").exists()


def test_the_production_plan_counts_the_experts_as_the_spec_does():
    job = load_job(JOBS / "kimi-k3-dflash2-h200.yaml")
    config = json.loads((JOBS / "models/moonshotai/Kimi-K3/config.json").read_text())["text_config"]
    for tp in (8, 16):
        plan = plan_job(job, JOBS, 141 * GB, tp=tp)
        assert plan.weights["target weights uint8 (MXFP4 packed)"] == planned_expert_bytes(config, tp)


def test_the_plan_shows_each_buckets_caches_by_component():
    """The H200 job at TP16 (the caches' total is checked against the allocator above): each
    bucket's caches by component, the target's MLA latent the spec's 27.6 KB a token slot (its 24
    full-attention layers x (512 + 64) bf16, every rank holding every sequence's) over at least
    max_num_seqs x max_tokens slots and the shared heads' pool (two heads of
    engine.shared_head_tokens), and the table prints the components."""
    job = load_job(JOBS / "kimi-k3-dflash2-h200.yaml")
    config = json.loads((JOBS / "models/moonshotai/Kimi-K3/config.json").read_text())["text_config"]
    per_slot = len(config["linear_attn_config"]["full_attn_layers"]) * (
        config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
    assert per_slot == 27_648
    plan = plan_job(job, JOBS, 141 * GB, tp=16)
    for need in plan.whole.needs:
        assert set(need.parts) == {"target MLA latent", "target KDA state", "target KDA verify staging",
                                   "drafter latent and rings", "kept head states"}
        slots, rest = divmod(need.parts["target MLA latent"], per_slot)
        b, pool = need.bucket, 2 * job.engine.shared_head_tokens
        assert rest == 0 and b.max_num_seqs * b.max_tokens + pool <= slots <= (b.max_num_seqs + 1) * (b.max_tokens + 64) + pool
    assert "    caches: target MLA latent 39.26, target KDA state 4.99," in plan.table()


def test_the_split_caches_are_the_bytes_a_split_engine_allocates(jobs, tmp_path, monkeypatch):
    """The Kimi job at TP2 with the MLA latents split: what rank 0 of an engine whose backend splits
    them holds after each speculating bucket is the plan's split bucket, the MLA latents (the
    target's, the drafter's) half the unsplit plan's and the KDA states as they were."""
    job = jobs["kimi"]
    plan = plan_job(job, tmp_path, 80 * GB, tp=2, setup=CPU, with_split=True)
    assert plan.split is not None
    monkeypatch.setattr(parallel, "world_size", lambda: 2)
    target, drafter = load_pair(Path(job.model.target), Path(job.model.drafter))
    engine = Engine(target, drafter, page_size=job.engine.page_size, device="cpu",
                    max_num_batched_tokens=job.engine.max_num_batched_tokens,
                    attention=TorchAttention(LatentSplit(2, 0)), capture_sizes=CPU.capture_sizes)
    held = 0
    for whole, split, largest, whole_largest in zip(plan.whole.needs, plan.split.needs, plan.split.largest,
                                                    plan.whole.largest):
        assert split.parts["target MLA latent"] * 2 == whole.parts["target MLA latent"]
        if whole.bucket.speculation:
            assert split.parts["drafter latent and rings"] * 2 == whole.parts["drafter latent and rings"]
        assert split.parts["target KDA state"] == whole.parts["target KDA state"]
        _, allocated, _ = allocator(lambda: engine.allocate(split.bucket))
        held += allocated  # less the previous bucket's, freed
        assert held == split.caches + split.batch - split.parts.get("kept head states", 0), split.bucket.name
        assert largest >= whole_largest


def test_the_production_plans_hold_more_sequences_with_the_split():
    """Issue 39's figures, at the default reserve and no headroom as issue 39 sized them: with the
    latents split, the 8k bucket holds at least 4x the 56 sequences of the H200 job at TP16 and 3x
    the 161 of the GB300 job at TP8; the table shows the split, as run."""
    for name, gpu, tp, at_least in (("kimi-k3-dflash2-h200.yaml", "h200", 16, 4 * 56),
                                    ("kimi-k3-dflash2.yaml", "gb300", 8, 3 * 161)):
        job = load_job(JOBS / name)
        job = job.model_copy(update={"engine": job.engine.model_copy(update={"gpu_memory_headroom": 0.0})})
        plan = plan_job(job, JOBS, gpu_bytes(gpu), tp=tp, with_split=True)
        assert plan.split.largest[0] >= at_least, name
        assert f"with the MLA latents split {tp} ways (engine.context_parallel absent, so on" in plan.table()


def test_experts_touched_is_the_share_uniform_routing_touches():
    # An independent oracle: route tokens uniformly (k distinct experts each) and count.
    gen = torch.Generator().manual_seed(0)
    for tokens, experts, k in ((1, 896, 16), (8, 896, 16), (64, 896, 16), (12, 32, 4)):
        touched = [torch.rand(tokens, experts, generator=gen).topk(k, -1).indices.unique().numel() / experts
                   for _ in range(400)]
        assert abs(sum(touched) / len(touched) - experts_touched(tokens, experts, k)) < 0.01, (tokens, experts, k)


def test_the_split_is_on_by_default_where_the_buckets_need_it():
    """engine.context_parallel absent: run and validate (sizing.fit_job) turn the split on where the
    buckets as written do not fit a GPU without it and do with it (the GB300 and H200 jobs), and
    leave it off where they fit without it (those jobs at the batches that fit unsplit; the H100
    job, whose TP32 cannot split a 16-token page); set, it is kept, and false with batches only
    the split holds is refused."""
    for name, split in (("kimi-k3-dflash2.yaml", True), ("kimi-k3-dflash2-h200.yaml", True),
                        ("kimi-k3-dflash2-h100.yaml", False)):
        job = load_job(JOBS / name)
        assert job.engine.context_parallel is None
        assert fit_job(job, JOBS).engine.context_parallel is split, name
    h200 = load_job(JOBS / "kimi-k3-dflash2-h200.yaml")
    whole = plan_job(h200, JOBS, gpu_bytes("h200")).whole.largest  # at the job's reserve and headroom
    unsplit = h200.model_copy(update={"buckets": [b.model_copy(update={"max_num_seqs": n})
                                                  for b, n in zip(h200.buckets, whole)]})
    assert fit_job(unsplit, JOBS).engine.context_parallel is False
    forced = unsplit.model_copy(update={"engine": unsplit.engine.model_copy(update={"context_parallel": True})})
    assert fit_job(forced, JOBS).engine.context_parallel is True
    off = h200.model_copy(update={"engine": h200.engine.model_copy(update={"context_parallel": False})})
    with pytest.raises(JobError, match=r"does not fit at TP16 \(lower the buckets' max_num_seqs to their 'largest'"):
        fit_job(off, JOBS)
