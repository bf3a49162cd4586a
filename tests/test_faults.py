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


def test_out_of_memory_alone_fails_only_that_request(pair):
    """Request 4's prefill always runs out of memory: the batch halves until request 4 runs
    alone with the smallest prefill chunk, still runs out, and is an error row; every other
    request is what an uninterrupted run gives."""
    target, drafter = pair
    want = outcomes(Engine(target, drafter, dtype=F64), {})
    head = random_prompts(LENGTHS, seed=21)[4][:8]  # its first chunk starts with these
    real = target.forward

    def forward(ids, meta, *args, **kwargs):
        if meta.name == "prefill":
            starts = (meta.q_index[:, 0][meta.q_positions[:, 0] == 0]).tolist()
            if any(ids[r:r + 8].tolist() == head for r in starts):
                raise torch.OutOfMemoryError("injected")
        return real(ids, meta, *args, **kwargs)

    target.forward = forward
    try:
        got = outcomes(Engine(target, drafter, dtype=F64), {})
    finally:
        target.forward = real
    assert got["4"][2:] == ("error", "out_of_memory")
    assert {k: v for k, v in got.items() if k != "4"} == {k: v for k, v in want.items() if k != "4"}


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


def test_an_exception_one_request_raises_costs_that_request_only(pair):
    """The engine raises whenever request 3's prompt is in a prefill: the batch starts over one
    at a time, request 3 alone raises again and is an error row naming the exception."""
    target, drafter = pair
    want = outcomes(Engine(target, drafter, dtype=F64), {})
    marker = random_prompts(LENGTHS, seed=21)[3]

    def raise_on_marker(meta, result):
        raise ValueError("injected: a bug only request 3 reaches")

    real = target.forward

    def forward(ids, meta, *args, **kwargs):
        if meta.name == "prefill" and len(ids) >= len(marker) and any(
                ids[i:i + len(marker)].tolist() == marker for i in range(len(ids) - len(marker) + 1)):
            raise_on_marker(meta, None)
        return real(ids, meta, *args, **kwargs)

    target.forward = forward
    try:
        got = outcomes(Engine(target, drafter, dtype=F64), {})
    finally:
        target.forward = real
    assert got["3"][2:] == ("error", "engine_ValueError")
    assert {k: v for k, v in got.items() if k != "3"} == {k: v for k, v in want.items() if k != "3"}
