"""The engine on two tensor-parallel ranks (gloo) decodes exactly as on one: same tokens, same
accepted drafts in every round, greedy and sampled. float64 (tests/engine_tp_worker.py): the
ranks sum partial products in another order than one process does."""

from __future__ import annotations

import pytest

from tests import engine_tp_worker
from tests.engine_util import make_drafter, make_target, random_prompts
from tests.test_tp import free_port

pytestmark = pytest.mark.numerics

RUNS = {
    "greedy": dict(max_new_tokens=24),
    "sampled": dict(max_new_tokens=24, temperature=1.0, top_p=0.95),
}


def test_tp2_engine_matches_tp1(tmp_path):
    # Tiny Qwen3 target and DFlash2 drafter, both with 4 query and 2 KV heads: each rank holds
    # one KV head, two query heads and half of the 8-token vocabulary.
    target, drafter = make_target(tmp_path / "target"), tmp_path / "drafter"
    make_drafter(drafter, 2, block_size=8)
    prompts = random_prompts([1, 37, 120, 300], seed=6)
    engine_tp_worker.assert_tp2_equals_tp1(str(target), str(drafter), prompts, RUNS, str(tmp_path), free_port())
