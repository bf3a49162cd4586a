"""The engine on two tensor-parallel ranks (gloo) decodes exactly as on one: same tokens, same
accepted drafts in every round, greedy and sampled. float64 (tests/engine_tp_worker.py): the
ranks sum partial products in another order than one process does."""

from __future__ import annotations

import pytest

from tests import engine_tp_worker
from tests.engine_util import make_drafter, make_target, random_prompts
from tests.test_tp import free_port

# no_rerun: each rank runs one torch thread whatever OMP_NUM_THREADS says, so CI's two-thread rerun
# of the numerics would only repeat these.
pytestmark = [pytest.mark.numerics, pytest.mark.slow, pytest.mark.no_rerun]

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


def test_tp2_auto_follows_rank_0s_plan(tmp_path):
    """speculation: auto under TP2, where rank 0's cost table says verify every draft (a flat
    cost) and rank 1's says verify none: one broadcast a round makes rank 0's plan the group's
    (a rank that followed its own would run other shapes and its collectives would fail)."""
    target, drafter = make_target(tmp_path / "target"), tmp_path / "drafter"
    make_drafter(drafter, 2, block_size=8)
    prompts = random_prompts([1, 37, 120], seed=6)
    costs = [[1.0] * 8, [1.0] + [100.0] * 7]
    engine_tp_worker.assert_auto_ranks_agree(str(target), str(drafter), prompts, str(tmp_path), free_port(), costs)


def test_tp2_rows_choose_their_drafts_by_rank_0s_cost_line(tmp_path):
    """Per-row draft counts under TP2 (engine/row_drafts.py), past the schedule's exploring rounds,
    where rank 0's cost line says a draft costs nothing and rank 1's that each costs a tenth of a
    round: one broadcast a round makes rank 0's line the group's, so both verify the same rows
    (ranks that chose apart would run verifies of other shapes and their collectives would fail)."""
    target, drafter = make_target(tmp_path / "target"), tmp_path / "drafter"
    make_drafter(drafter, 2, block_size=8)
    prompts = random_prompts([1, 37, 120, 9], seed=6)
    costs = [[1.0] * 8, [1.0 + 0.8 * k for k in range(8)]]
    engine_tp_worker.assert_auto_ranks_agree(str(target), str(drafter), prompts, str(tmp_path), free_port(), costs,
                                             max_new_tokens=64)
