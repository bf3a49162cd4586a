"""The memory plan (sizing.py) against what the CPU allocator sees, for both model families (a
tiny Qwen3 + DFlash2 drafter, the tiny Kimi-K3 + DFlash2-MLA pair): the meta-device weights equal
the bytes loading the checkpoint allocates, at one rank and at rank 0 of two; each bucket's caches
and decoding state equal the bytes Engine.allocate allocates; the activations' bound holds over
the allocator's peak of a real run of the bucket, greedy and sampled, within a factor of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch.profiler import ProfilerActivity, profile

from dflash_batch import parallel
from dflash_batch.backends.torch_attention import TORCH
from dflash_batch.build import EngineSetup
from dflash_batch.cli import main
from dflash_batch.engine.engine import Engine, runtime_tensors
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.job import load_job
from dflash_batch.models.loader import load_model
from dflash_batch.plan.buckets import plan_buckets
from dflash_batch.plan.memory import planned_expert_bytes
from dflash_batch.sizing import GB, plan_job
from dflash_batch.testing.kimi_pair import make_kimi_pair
from tests.engine_util import load_pair, make_drafter, make_target

CPU = EngineSetup("cpu", "torch", False, False, [1, 2, 4])  # rounds padded as under graphs
MARGIN = 2.0  # the activations' bound is at most this many times the measured peak


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


def allocator(fn):
    """fn's result, the bytes it left allocated and the peak above what was allocated before, as
    the CPU allocator reports them to the profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, live)
    return result, live, peak


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
    for need in plan.buckets:
        # A row asking for logprobs and penalties makes the batch grow (DecodeBatch.put); the plan grows it ahead.
        _, allocated, peak = allocator(lambda: engine.allocate(need.bucket).allocate_for(False, features, features))
        held += allocated
        assert held == need.caches + need.batch, need.bucket.name
        if previous:  # the old bucket's caches go as the new one's come, not after
            assert held - allocated + peak < previous + need.caches + need.batch, need.bucket.name
        previous = held
    assert not plan.buckets[2].bucket.speculation and not runtime_tensors([drafter])  # its caches freed
    assert plan.buckets[0].caches != plan.buckets[1].caches  # more sequences, longer rows: not a constant


def _requests(bucket, n: int, vocab: int, temperature: float) -> list[Request]:
    """n prompts that fill the bucket's rows (prompt + max_new_tokens at its edge)."""
    gen = torch.Generator().manual_seed(0)
    length = bucket.max_tokens - 8 - 8
    return [Request((str(i), 0), torch.randint(0, vocab - 1, (length,), generator=gen).tolist(),
                    SamplingParams(max_new_tokens=8, temperature=temperature, seed=i)) for i in range(n)]


@pytest.mark.parametrize("family", ["qwen3", "kimi"])
@pytest.mark.parametrize("sampled", [False, True])
def test_activations_bound_a_real_run_within_a_margin(jobs, family, sampled, tmp_path):
    job = jobs[family]
    if sampled:
        job = job.model_copy(update={"sampling": job.sampling.model_copy(update={"temperature": 1.0})})
    plan = plan_job(job, tmp_path, 80 * GB, setup=CPU)
    target, drafter = load_pair(Path(job.model.target), Path(job.model.drafter))
    need, bucket = plan.buckets[0], plan_buckets(job)[0]
    engine = cpu_engine(job, target, drafter)
    engine.allocate(bucket)  # the bucket's caches and state, which generate keeps: only activations are measured
    requests = _requests(bucket, bucket.max_num_seqs, target.vocab_size, job.sampling.temperature)
    _, _, peak = allocator(lambda: list(engine.generate(requests, bucket)))
    bound = max(need.prefill, need.round)
    print(f"{family} sampled={sampled}: peak {peak:,} B, bound {bound:,} B ({bound / peak:.2f}x)")
    assert peak <= bound <= MARGIN * peak, (peak, need.prefill, need.round)


def test_a_gpu_of_exactly_a_bucket_s_total_fits_its_max_num_seqs_and_not_one_more(jobs, tmp_path):
    job = jobs["kimi"]
    plan = plan_job(job, tmp_path, 80 * GB, setup=CPU)
    need, reserve = plan.buckets[0], plan.fixed["reserve (context, NCCL, fragmentation)"]
    exact = plan_job(job, tmp_path, plan.base + need.total, setup=CPU, reserve=reserve)
    assert exact.largest[0] == need.bucket.max_num_seqs
    one_more = job.model_copy(update={"buckets": [b.model_copy(update={"max_num_seqs": b.max_num_seqs + 1})
                                                  for b in job.buckets]})
    assert plan_job(one_more, tmp_path, 80 * GB, setup=CPU).buckets[0].total > need.total


JOBS = Path(__file__).resolve().parent.parent / "jobs"


@pytest.mark.parametrize("name, gpu", [("kimi-k3-dflash2.yaml", "gb300"), ("kimi-k3-dflash2-128k.yaml", "gb300"),
                                       ("kimi-k3-dflash2-h200.yaml", "h200"), ("kimi-k3-dflash2-h100.yaml", "h100")])
def test_every_production_job_fits_its_gpu(name, gpu):
    result = CliRunner().invoke(main, ["plan", str(JOBS / name), "--gpu-memory", gpu])
    assert result.exit_code == 0, result.output
    assert result.output.rstrip().endswith("fits")
    # Its buckets are the largest that fit: each `largest seqs` is the bucket's own max_num_seqs.
    rows = [line.split() for line in result.output.splitlines() if line.strip()[:1].isdigit() and "-" in line]
    assert rows and all(row[1] == row[-1] for row in rows), result.output


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
