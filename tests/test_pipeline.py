"""Pipeline stages (model.pipeline_parallel_size) decode exactly what one process decodes: the
same tokens, accepted drafts in every round and logprobs, greedy and sampled, on gloo ranks split
into stages, each stage a tensor-parallel group (tests/engine_tp_worker.py). float64: the ranks
sum partial products in another order than one process does."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re

from datetime import timedelta

import pytest
import safetensors
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_batch import parallel, sizing
from dflash_batch.job import parse_job
from dflash_batch.sizing import plan_job
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.pair import attach_drafter
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.models import loader
from dflash_batch.models.loader import load_model
from dflash_batch.models.stages import balanced_spans
from dflash_batch.plan.buckets import Bucket
from tests import engine_tp_worker
from dflash_batch.testing.kimi_pair import VOCAB, make_kimi_pair
from tests.engine_util import make_drafter, make_target, random_prompts
from tests.test_faults import inject
from tests.test_tp import free_port


RUNS = {
    "greedy": dict(max_new_tokens=24),
    # penalties read each row's counts of what it emitted (kept on the last stage, lane by lane)
    "sampled": dict(max_new_tokens=24, temperature=1.0, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.5),
    "logprobs": dict(max_new_tokens=12, temperature=0.8, top_k=5, logprobs=2),
}


@pytest.mark.numerics
@pytest.mark.no_rerun
@pytest.mark.parametrize("speculation, graphs, micro", [(True, False, 1), (False, False, 3), (True, True, 2)],
                         ids=["speculative", "target-only, 3 micro-batches", "graphs, 2 micro-batches"])
def test_two_stages_decode_what_one_process_does(tmp_path, speculation, graphs, micro):
    # Qwen3 of 3 layers over 2 stages (uneven: the first holds 2, the last the head), the drafter
    # tapping layers 1 (handed on) and 2 (the last, normed). `graphs`: the rounds go through the
    # engine's graph path (captures and replays emulated on the CPU: tests/emulated_graphs.py);
    # `micro`: a verify's sequences go through the stages in that many groups (3 prompts: groups
    # of 1 and 2, or one each).
    target, drafter = make_target(tmp_path / "target", num_hidden_layers=3), tmp_path / "drafter"
    make_drafter(drafter, 2, block_size=8)
    prompts = random_prompts([1, 37, 120], seed=6)
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, RUNS, str(tmp_path), free_port(),
                                           graphs, ranks=2, stages=2, held=[range(0, 2), range(2, 3)],
                                           speculation=speculation, micro_batches=micro)


@pytest.mark.no_rerun
@pytest.mark.parametrize("lanes", [1, 2])
def test_two_stages_on_auto_follow_rank_0s_plan(tmp_path, lanes):
    """speculation: auto over two stages whose round costs disagree (rank 0's flat, rank 1's
    rising with every draft): both verify what rank 0 plans and decode what one process does,
    whole rounds or in two lanes (a stretch of lanes verifies the drafts planned at its start)."""
    target, drafter = make_target(tmp_path / "target", num_hidden_layers=3), tmp_path / "drafter"
    make_drafter(drafter, 2, block_size=8)
    prompts = random_prompts([1, 37, 120], seed=6)
    costs = [[1.0] * 8, [1.0] + [100.0] * 7]
    engine_tp_worker.assert_auto_ranks_agree(str(target), str(drafter), prompts, str(tmp_path), free_port(), costs,
                                             stages=2, micro_batches=lanes)


@pytest.mark.numerics
@pytest.mark.no_rerun
@pytest.mark.parametrize("stream, micro", [("prefix", 1), ("attn_res", 2)])
def test_kimi_k3_over_two_stages_decodes_what_one_process_does(tmp_path, stream, micro):
    # 8 layers (KDA but 3 and 7, attention-residual blocks of 3) split 0-3 | 4-7: the boundary
    # carries the prefix, two blocks and tap 1; on the attn_res stream tap 3 is the mix entering
    # layer 4, taken on the second stage from what the first handed on. `micro` 2, through the
    # graph path: captured rounds go through in two groups of sequences, the rounds with logprobs
    # (not captured: their batch grew) in two interleaved lanes; each group and lane stages and
    # commits its KDA rows where it sits in the round.
    target, drafter = make_kimi_pair(tmp_path / "pair", stream=stream, moe_intermediate_size=64)
    prompts = random_prompts([1, 37, 20], vocab=VOCAB, seed=6)
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, RUNS, str(tmp_path), free_port(),
                                           graphs=micro > 1, ranks=2, stages=2, held=[range(0, 4), range(4, 8)],
                                           micro_batches=micro)


@pytest.mark.numerics
@pytest.mark.no_rerun
def test_two_stages_on_flashinfer_run_lanes_that_decode_what_one_process_does(tmp_path):
    # flashinfer's MLA wrapper (emulated: tests/fake_flashinfer.py) lays a round out whole, so the
    # rounds run in two lanes (each planned as its own round, its rows' ring pages those of its
    # batch rows) and a prefill step's prompts in two groups (each planned as its own forward):
    # against one process on the torch backend. A window of 10 (flashinfer's latent path wants one
    # no shorter than the block); the wrapper's log-sum-exps are float32: logprobs to 1e-6.
    target, drafter = make_kimi_pair(tmp_path / "pair", stream="attn_res", moe_intermediate_size=64, window=10)
    prompts = random_prompts([1, 37, 20], vocab=VOCAB, seed=6)
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, RUNS, str(tmp_path), free_port(),
                                           ranks=2, stages=2, held=[range(0, 4), range(4, 8)], micro_batches=2,
                                           backend="flashinfer", logprob_atol=1e-6)


@pytest.mark.numerics
@pytest.mark.no_rerun
@pytest.mark.slow
def test_two_stages_of_two_ranks_split_the_latents_and_share_a_head(tmp_path):
    # PP2 x TP2: each stage's two ranks hold half of every layer's heads and keep every other
    # position's MLA latents; three prompts share a 70-token head (prefilled once, on both stages);
    # rounds in two interleaved lanes.
    target, drafter = make_kimi_pair(tmp_path / "pair", stream="attn_res", moe_intermediate_size=64, slices=2)
    head = random_prompts([70], vocab=VOCAB, seed=7)[0]
    prompts = [head + t for t in random_prompts([5, 1, 3], vocab=VOCAB, seed=8)]
    runs = {"greedy": RUNS["greedy"], "logprobs": RUNS["logprobs"]}
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, runs, str(tmp_path), free_port(),
                                           ranks=4, stages=2, latent_split=True, cached=[0, 70, 70],
                                           held=[range(0, 4), range(4, 8)], logprob_atol=1e-9, micro_batches=2)


@pytest.mark.parametrize("groups, bounds", [(2, [0, 38, 163]), (3, [0, 38, 158, 163]), (4, [0, 1, 38, 158, 163])])
def test_a_prefill_step_splits_into_groups_of_whole_prompts_nearest_their_share(groups, bounds):
    # chunks of 1, 37, 120 and 5 rows (163): two groups end at the prompt boundary nearest 81.5
    # (38, not 158), three nearest 54.3 and 108.7 (38, then 158: the next must leave a prompt for
    # the last group), four take a prompt each
    from dflash_batch.engine.cache import SeqRows, build_meta
    from dflash_batch.models.stages import micro_batches

    counts = [1, 37, 120, 5]
    rows = [SeqRows(list(range(10 * i, 10 * i + 9)), 3, c, 3 + c) for i, c in enumerate(counts)]
    meta = build_meta(rows, 16, state_ids=[7, 8, 9, 6], batch_rows=[3, 2, 1, 0], micro_batches=groups)
    with parallel.planned(1, at_stage=(0, 2)):
        parts = micro_batches(meta)
    assert [(r.start, r.stop) for r, _ in parts] == list(zip(bounds, bounds[1:]))
    first, firsts = 0, []
    for rows_of, part in parts:
        firsts.append(first)
        n = part.q_index.shape[0]
        assert part.num_rows == rows_of.stop - rows_of.start and part.first_seq == first
        assert torch.equal(part.positions, meta.positions[rows_of])
        assert part.state_ids.tolist() == [7, 8, 9, 6][first:first + n]
        assert part.rows.tolist() == [3, 2, 1, 0][first:first + n]
        for b, count in enumerate(counts[first:first + n]):  # a prompt's queries, then padding past the rows
            start = sum(counts[first:first + b])
            assert part.q_index[b].tolist() == list(range(start, start + count)) + [part.num_rows] * (
                part.q_index.shape[1] - count)
        first += n
    with parallel.planned(1, at_stage=(0, 2)):  # a forward whose first sequence sits at row 5 of its round
        assert [part.first_seq for _, part in micro_batches(dataclasses.replace(meta, first_seq=5))] == \
               [5 + f for f in firsts]
    with parallel.planned(1, at_stage=(0, 1)):  # no stages: the forward whole
        assert micro_batches(meta) == [(slice(None), meta)]


def test_balanced_spans_are_the_best_contiguous_split():
    """Against every contiguous split: the least largest stage (embedding on the first and last,
    head on the last), each stage holding a layer."""
    rng = random.Random(0)
    for _ in range(200):
        n, stages = rng.randint(1, 9), rng.randint(1, 4)
        if stages > n:
            with pytest.raises(ValueError, match="do not split"):
                balanced_spans([1.0] * n, stages)
            continue
        costs = [float(rng.randint(1, 9)) for _ in range(n)]
        first, last = float(rng.randint(0, 5)), float(rng.randint(0, 9))

        def worst(cuts: tuple[int, ...]) -> float:
            bounds = [0, *cuts, n]
            return max(sum(costs[a:b]) + (first if s == 0 else 0) + (last if s == stages - 1 else 0)
                       for s, (a, b) in enumerate(zip(bounds, bounds[1:])))

        best = min(worst(c) for c in itertools.combinations(range(1, n), stages - 1))
        spans = balanced_spans(costs, stages, first, last)
        assert [s.start for s in spans[1:]] == [s.stop for s in spans[:-1]] and spans[0].start == 0
        assert spans[-1].stop == n and all(len(s) for s in spans)
        assert worst(tuple(s.start for s in spans[1:])) == best


@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_a_stage_reads_only_its_own_tensors(tmp_path, monkeypatch, family):
    """Each stage reads from the safetensors files only the tensors of the layers it holds (the
    embedding on the first and last stage, the final norm and head on the last), and they are the
    whole model's."""
    if family == "qwen3":
        path = make_target(tmp_path / "t", num_hidden_layers=3)
    else:
        path, _ = make_kimi_pair(tmp_path / "pair", moe_intermediate_size=64)
    whole = load_model(path, torch.float64).state_dict()
    read: list[str] = []
    real = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.opened = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_slice(self, name):
            read.append(name)
            return self.opened.get_slice(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    layers = json.loads((path / "config.json").read_text()).get("text_config", {}).get("num_hidden_layers") \
        or json.loads((path / "config.json").read_text())["num_hidden_layers"]
    held_by = []
    for stage in range(2):
        monkeypatch.setattr(parallel, "stage", lambda stage=stage: (stage, 2))
        read.clear()
        model = load_model(path, torch.float64)
        held_by.append(model.held)
        names = [re.sub(r"^language_model\.", "", n) for n in read]
        in_layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert in_layers == set(model.held), (stage, sorted(in_layers))
        assert any(n.startswith("model.embed_tokens.") for n in names)
        assert any(n.startswith("lm_head.") for n in names) == (stage == 1)
        for name, value in model.state_dict().items():  # the stage's tensors are the whole model's
            if name.startswith("model.layers."):
                i = int(name.split(".")[2]) + model.held.start
                name = f"model.layers.{i}." + name.split(".", 3)[3]
            torch.testing.assert_close(value, whole[name], rtol=0, atol=0)
    assert held_by[0].stop == held_by[1].start and held_by[1].stop == layers and held_by[0].start == 0


def test_the_memory_plan_holds_what_each_stage_loads(tmp_path, monkeypatch):
    """plan_job at pipeline_parallel_size 2: each stage's weights are those its rank loads (the
    real loader, at that stage), its caches those of the layers it holds; the plan shown is the
    fuller stage's, each bucket's largest batch the least of the two."""
    target, drafter = make_kimi_pair(tmp_path / "pair", moe_intermediate_size=64)
    doc = {"input": {"paths": ["p.jsonl"], "prompt_column": "prompt"}, "output": {"dir": "out"},
           "model": {"target": str(target), "drafter": str(drafter), "dtype": "float32",
                     "pipeline_parallel_size": 2},
           "engine": {"max_model_len": 256, "backend": "torch"},
           "buckets": [{"max_tokens": 256, "max_num_seqs": 4}]}
    job, gpu = parse_job(doc), 2**30
    whole = plan_job(parse_job({**doc, "model": {**doc["model"], "pipeline_parallel_size": 1}}), tmp_path, gpu)
    stages = [sizing._stage_plan(job, tmp_path, gpu, 1, None, None, False, (s, 2)) for s in range(2)]
    for s, plan in enumerate(stages):
        monkeypatch.setattr(parallel, "stage", lambda s=s: (s, 2))
        model = load_model(target, torch.float32)
        held = sum(p.nbytes for p in [*model.parameters(), *model.buffers()])
        assert sum(v for k, v in plan.weights.items() if k.startswith("target")) == held
    monkeypatch.undo()
    layers = [p.whole.needs[0].parts["target KDA state"] + p.whole.needs[0].parts["target MLA latent"]
              for p in (*stages, whole)]
    assert layers[0] + layers[1] == layers[2] and 0 < layers[0] < layers[2]
    plan = plan_job(job, tmp_path, gpu)
    assert plan.at_stage in ((0, 2), (1, 2)) and "(the fullest)" in plan.table()
    assert plan.whole.largest == [min(p.whole.largest[0] for p in stages)]
    assert any(line.startswith("stage 1 of 2: target layers 4-7 and the LM head") for line in plan.notes)


def decode_with_a_nan(target: str, drafter: str, prompts: list[list[int]]) -> dict:
    """Each request's (tokens, finish reason, error type), the last stage's logits of one row made
    NaN in the fifth verify (tests/test_faults.py's injection; a stage before the last has none)."""
    t, d = load_model(target, torch.float64), load_model(drafter, torch.float64)
    attach_drafter(t, d)

    def nan_in_row0(meta, result):
        logits, taps = result
        logits = logits.clone()
        logits[meta.q_index[0][meta.q_index[0] < meta.num_rows]] = float("nan")
        return logits, taps

    if parallel.last_stage():
        inject(t, "verify", nan_in_row0, calls={5})
    reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=16, seed=i)) for i, p in enumerate(prompts)]
    return {c.key[0]: (c.token_ids, c.finish_reason, c.error_type)
            for c in Engine(t, d, dtype=torch.float64).generate(iter(reqs), Bucket(0, "0-1024", 1024, 4, True, None))}


def nan_rank(rank: int, port: int, target: str, drafter: str, prompts: list[list[int]], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    parallel.form_stages(2)
    try:
        torch.set_num_threads(1)
        torch.save(decode_with_a_nan(target, drafter, prompts), f"{out}/rank{rank}.pt")
    finally:
        parallel.leave_stages()
        dist.destroy_process_group()


@pytest.mark.numerics
@pytest.mark.no_rerun
def test_a_row_whose_logits_are_not_finite_is_an_error_row_on_every_stage(tmp_path):
    target, drafter = make_target(tmp_path / "target", num_hidden_layers=3), tmp_path / "drafter"
    make_drafter(drafter, 2, block_size=8)
    prompts = random_prompts([3, 40, 9, 25, 14], seed=21)
    want = decode_with_a_nan(str(target), str(drafter), prompts)
    assert [v[2] for v in want.values()].count("non_finite_logits") == 1
    mp.spawn(nan_rank, args=(free_port(), str(target), str(drafter), prompts, str(tmp_path)), nprocs=2)
    assert [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)] == [want, want]
