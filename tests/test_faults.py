"""Faults cost one row, never the run: out of memory at prefill, verify or draft halves the batch
and starts the affected sequences over (their outputs equal an uninterrupted run's: a
sequence's coins depend only on its seed and positions); a request that runs out of memory
alone, whose logits are not finite, or that alone makes the engine raise, becomes an error row
and the rest of the bucket goes on. The engine runs in float64 so that "equal" can be exact."""

from __future__ import annotations

import pytest
import torch

from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from tests.engine_util import F64, bucket, load_pair, make_drafter, make_target, random_prompts

LENGTHS = [3, 40, 9, 25, 61, 14, 2, 33]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    make_drafter(d / "v1", 1)
    return load_pair(make_target(d / "target"), d / "v1", F64)


def requests(sampling: dict) -> list[Request]:
    prompts = random_prompts(LENGTHS, seed=21)
    return [Request((str(i), 0), p, SamplingParams(max_new_tokens=6 + 3 * i, seed=70 + i, **sampling))
            for i, p in enumerate(prompts)]


def outcomes(engine: Engine, sampling: dict, max_num_seqs: int = 5, budget_tokens=None) -> dict:
    return {c.key[0]: (c.token_ids, c.spec.per_round if c.spec else None, c.finish_reason, c.error_type)
            for c in engine.generate(iter(requests(sampling)), bucket(max_num_seqs=max_num_seqs))}


def inject(model, name: str, make_fault, calls: set[int]):
    """Wrap model.forward: on the listed calls of the forward named `name` (prefill, verify,
    draft), `make_fault(meta, result)` raises or returns a damaged result."""
    real, seen = model.forward, {"n": 0}

    def forward(ids, meta, *args, **kwargs):
        if meta.name != name:
            return real(ids, meta, *args, **kwargs)
        seen["n"] += 1
        result = real(ids, meta, *args, **kwargs)
        return make_fault(meta, result) if seen["n"] in calls else result

    model.forward = forward
    return lambda: setattr(model, "forward", real)


def oom(meta, result):
    raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")


SAMPLING = {"greedy": {}, "sampled": dict(temperature=1.0, top_p=0.9)}


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("where", ["prefill", "verify", "draft"])
def test_out_of_memory_halves_the_batch_and_loses_nothing(pair, where, sampling):
    target, drafter = pair
    want = outcomes(Engine(target, drafter, dtype=F64), SAMPLING[sampling])
    lines = []
    engine = Engine(target, drafter, dtype=F64, log=lines.append)
    undo = inject(drafter if where == "draft" else target, where, oom, calls={3, 4})
    try:
        got = outcomes(engine, SAMPLING[sampling])
    finally:
        undo()
    assert got == want
    assert any("out of memory with" in line for line in lines), lines


def starts_request(ids, meta, prompt: list[int]) -> bool:
    """Whether this prefill forward holds the first chunk of the request with `prompt` (its
    first 8 tokens at a sequence's position 0; unique among these prompts)."""
    starts = meta.q_index[:, 0][meta.q_positions[:, 0] == 0].tolist()
    return meta.name == "prefill" and any(ids[r:r + 8].tolist() == prompt[:8] for r in starts)


def fails_alone(pair, victim: int, error: Exception) -> dict:
    """Outcomes when every prefill that starts request `victim` raises `error`."""
    target, drafter = pair
    real, prompt = target.forward, random_prompts(LENGTHS, seed=21)[victim]

    def forward(ids, meta, *args, **kwargs):
        if starts_request(ids, meta, prompt):
            raise error
        return real(ids, meta, *args, **kwargs)

    target.forward = forward
    try:
        return outcomes(Engine(target, drafter, dtype=F64), {})
    finally:
        target.forward = real


@pytest.mark.parametrize("victim, error, kind", [
    (4, torch.OutOfMemoryError("injected: out of memory"), "out_of_memory"),
    (3, ValueError("injected: a bug only this request reaches"), "engine_ValueError"),
], ids=["out_of_memory", "exception"])
def test_a_request_that_fails_alone_costs_only_itself(pair, victim, error, kind):
    """Out of memory: the batch halves until the request runs alone with the smallest prefill
    chunk, and still fails. Any other exception: its batch starts over one at a time, the
    request raises again alone. Either way it is an error row naming why, and every other
    request is what an uninterrupted run gives."""
    want = outcomes(Engine(*pair, dtype=F64), {})
    got = fails_alone(pair, victim, error)
    assert got[str(victim)][2:] == ("error", kind)
    assert {k: v for k, v in got.items() if k != str(victim)} == {k: v for k, v in want.items() if k != str(victim)}


def test_non_finite_logits_fail_one_row(pair):
    target, drafter = pair
    want = outcomes(Engine(target, drafter, dtype=F64), {})

    def nan_in_row0(meta, result):
        logits, taps = result
        rows = meta.q_index[0][meta.q_index[0] < meta.num_rows]
        logits = logits.clone()
        logits[rows] = float("nan")
        return logits, taps

    undo = inject(target, "verify", nan_in_row0, calls={5})
    try:
        got = outcomes(Engine(target, drafter, dtype=F64), {})
    finally:
        undo()
    failed = {k: v for k, v in got.items() if v[2] == "error"}
    assert len(failed) == 1 and next(iter(failed.values()))[3] == "non_finite_logits"
    assert {k: v for k, v in got.items() if k not in failed} == {k: v for k, v in want.items() if k not in failed}
