"""Routed experts sharded whole over every rank, attention in data-parallel groups (gloo, float64, the
tiny Kimi-K3 + DFlash2-MLA pair with 8 experts, top-2): each group's rows decode exactly as in one
process with the experts cut nowhere; placements that move every expert or add replicas change
nothing; a group whose rows end long before the other's serves it to the end; each rank reads only
its experts' tensors; the routing counts are the routes of the tokens the group ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_batch.models.layers.expert_parallel import Placement, imbalance, place, rank_loads
from dflash_batch.testing.kimi_pair import make_kimi_pair
from tests import expert_parallel_worker as worker
from tests.test_tp import free_port

RUNS = {"greedy": {}, "sampled": dict(temperature=1.0, top_p=0.95)}


# -- placement ------------------------------------------------------------------------------------

def brute_force_best(counts: list[int], ranks: int, slots: int) -> float:
    """The lowest hottest-rank load over every way to put each expert on one rank (no replicas)."""
    import itertools

    best = float("inf")
    for owner in itertools.product(range(ranks), repeat=len(counts)):
        if all(owner.count(r) == slots for r in range(ranks)):
            best = min(best, max(sum(c for c, o in zip(counts, owner) if o == r) for r in range(ranks)))
    return best


@pytest.mark.parametrize("counts", [[90, 5, 5, 40, 30, 10, 10, 10], [7, 1, 1, 1, 6, 2, 2, 4], [1] * 8,
                                    [100, 0, 0, 0, 0, 0, 0, 50]])
def test_placement_reaches_the_brute_force_optimum_on_small_cases(counts):
    ranks = place(counts, 2)
    assert sorted(e for r in ranks for e in r) == list(range(8)) and all(len(r) == 4 for r in ranks)
    assert max(rank_loads(counts, ranks)) <= brute_force_best(counts, 2, 4) * 4 / 3
    assert max(rank_loads(counts, ranks)) == brute_force_best(counts, 2, 4)


def test_placement_lowers_the_hottest_rank_and_replicas_lower_it_further():
    counts = [400, 300, 10, 10, 10, 10, 10, 10]  # two hot experts, both on rank 0 of the default
    default = [[0, 1, 2, 3], [4, 5, 6, 7]]
    placed = place(counts, 2)
    assert imbalance(counts, placed) < imbalance(counts, default)
    replicated = place(counts, 2, redundant=1)
    assert all(len(r) == 5 and len(set(r)) == 5 for r in replicated)
    assert 0 in replicated[0] and 0 in replicated[1]  # the hottest expert has a replica on each rank
    assert imbalance(counts, replicated) < imbalance(counts, placed)
    assert rank_loads(counts, replicated) == pytest.approx([sum(counts) / 2] * 2, rel=0.1)


def test_a_placement_file_is_checked():
    good = Placement(8, 2, 0, {1: [[0, 1, 2, 3], [4, 5, 6, 7]]})
    assert Placement.from_json(good.to_json(), "p.json") == good
    for layers, why in [({1: [[0, 1, 2, 3], [4, 5, 6]]}, "slots"), ({1: [[0, 1, 2, 2], [4, 5, 6, 7]]}, "twice"),
                        ({1: [[0, 1, 2, 3], [4, 5, 6, 3]]}, "on no rank")]:
        with pytest.raises(ValueError, match=f"p.json: layer 1: .*{why}"):
            Placement.from_json(Placement(8, 2, 0, layers).to_json(), "p.json")
    with pytest.raises(ValueError, match="p.json: not an expert placement"):
        Placement.from_json({"layers": {}}, "p.json")


# -- the engine across ranks ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    # 128 intermediate columns: a whole MXFP4 scale group a rank at TP2 (the test's TP2 runs).
    return make_kimi_pair(tmp_path_factory.mktemp("kimi_ep"), stream="attn_res", moe_intermediate_size=128)


PROMPTS = [[(5 * i + 7 * j) % 90 + 3 for j in range(4 + 11 * i)] for i in range(4)]


def expected(pair, max_new: list[int], speculation=True) -> dict:
    """Every prompt alone in one process, the experts whole on it (the reference)."""
    return {name: worker.generate(*map(str, pair), PROMPTS, s, max_new, speculation)[0] for name, s in RUNS.items()}


def decode(pair, tmp_path, groups: int, ranks: int, kind: str, max_new: list[int], speculation=True) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(worker.run, args=(ranks, free_port(), groups, *map(str, pair), PROMPTS, max_new, RUNS, kind,
                               str(tmp_path), speculation), nprocs=ranks)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(ranks)]


def assert_same_rows(got: list[dict], want: dict, fields: tuple[str, ...] = ("tokens", "per_round")) -> None:
    """Every group's rows are the reference's; `fields`: tokens only where each process times its
    own rounds (speculation auto: the drafts verified depend on the clock)."""
    for rank, result in enumerate(got):
        for name in RUNS:
            for i, row in result[name]["rows"].items():
                assert [row[f] for f in fields] == [want[name][i][f] for f in fields], f"rank {rank}, {name}, prompt {i}"
    assert sorted(i for r in got[::len(got) // 2] for i in r["greedy"]["rows"]) == list(range(len(PROMPTS)))


@pytest.mark.numerics
@pytest.mark.no_rerun
@pytest.mark.parametrize("kind", ["default", "moved", "redundant"])
def test_dp2_tp1_with_experts_across_ranks_equals_one_process(pair, tmp_path, kind):
    max_new = [24] * len(PROMPTS)
    got = decode(pair, tmp_path, 2, 2, kind, max_new)
    assert_same_rows(got, expected(pair, max_new))
    slots = 4 + (kind == "redundant")
    for result in got:
        experts_read = {n.split(".experts.")[1].split(".")[0] for n in result["read"] if ".experts." in n}
        assert len(experts_read) == slots, experts_read  # its slots' experts, no other
        for name in RUNS:
            counts, forwarded = result[name]["counts"], result[name]["forwarded"]
            assert all(sum(layer) == 2 * forwarded for layer in counts), (counts, forwarded)


@pytest.mark.numerics
@pytest.mark.no_rerun
def test_a_group_done_30_rounds_early_serves_the_other_to_the_end(pair, tmp_path):
    max_new = [4, 96, 4, 96]  # group 0: prompts 0 and 2, done in a round or two; group 1 decodes on
    got = decode(pair, tmp_path, 2, 2, "default", max_new)
    assert_same_rows(got, expected(pair, max_new))
    idle = {r["group"]: r["idle"] for r in got}
    assert idle[0] >= 30 and idle[1] < idle[0], idle


@pytest.mark.numerics
@pytest.mark.no_rerun
@pytest.mark.slow
@pytest.mark.parametrize("speculation", [True, "auto"])
def test_dp2_tp2_with_experts_across_four_ranks_equals_one_process(pair, tmp_path, speculation):
    max_new = [24, 40, 16, 24]
    got = decode(pair, tmp_path, 2, 4, "redundant", max_new, speculation)
    assert_same_rows(got, expected(pair, max_new, speculation), ("tokens", "per_round")[:1 + (speculation is True)])
