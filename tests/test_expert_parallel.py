"""Routed experts sharded whole over every rank, attention in data-parallel groups (gloo, float64, the
tiny Kimi-K3 + DFlash2-MLA pair with 8 experts, top-2): each group's rows decode exactly as in one
process with the experts cut nowhere; placements that move every expert or add replicas change
nothing; a group whose rows end long before the other's serves it to the end; each rank reads only
its experts' tensors; the routing counts are the routes of the tokens the group ran."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from dflash_batch.models.layers.expert_parallel import Placement, imbalance, place, rank_loads
from dflash_batch.testing.kimi_pair import make_kimi_pair
from tests import expert_parallel_worker as worker
from tests.jobs_util import read_out
from tests.test_multinode import (CLI, ROOT, assert_rows_equal_tp1, kill_a_rank_of_node_1_once_rows_commit, kimi_job,
                                  make_cli_kimi_pair, run_tp1, stable_rows, torchrun_node)
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


def decode(pair, tmp_path, groups: int, ranks: int, kind: str, max_new: list[int], speculation=True,
           poison: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(worker.run, args=(ranks, free_port(), groups, *map(str, pair), PROMPTS, max_new, RUNS, kind,
                               str(tmp_path), speculation, poison), nprocs=ranks)
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
def test_experts_stored_unpacked_are_sharded_the_same(tmp_path):
    """The pair's routed experts stored in bfloat16, not MXFP4 (DenseExperts: whole experts a slot)."""
    unpacked = make_kimi_pair(tmp_path / "pair", stream="attn_res", expert_format="bf16")
    max_new = [24] * len(PROMPTS)
    got = decode(unpacked, tmp_path, 2, 2, "moved", max_new)
    assert_same_rows(got, expected(unpacked, max_new))
    assert all(len({n.split(".experts.")[1].split(".")[0] for n in r["read"] if ".experts." in n}) == 4 for r in got)


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
def test_a_row_gone_nan_is_its_own_error_row_and_no_other_groups(pair, tmp_path):
    """A row of group 0 whose hidden state turns NaN entering a MoE layer (its latent dispatched to
    every rank): that row alone ends as an error row, as in one process with group 0's rows alone;
    group 1's rows, which shared every expert with it, are the clean reference's."""
    max_new = [24] * len(PROMPTS)
    got = decode(pair, tmp_path, 2, 2, "default", max_new, poison=True)
    clean = expected(pair, max_new)
    alone = {name: worker.generate(*map(str, pair), PROMPTS[0::2], s, max_new[0::2], seeds=[1000, 1002],
                                   poison=True)[0] for name, s in RUNS.items()}
    for result in got:
        for name in RUNS:
            for i, row in result[name]["rows"].items():
                assert row == (alone[name][i // 2] if i % 2 == 0 else clean[name][i]), (name, i)
    assert [r["error"] for r in alone["greedy"]] == ["non_finite_logits", None]


@pytest.mark.numerics
@pytest.mark.no_rerun
@pytest.mark.slow
@pytest.mark.parametrize("speculation", [True, "auto"])
def test_dp2_tp2_with_experts_across_four_ranks_equals_one_process(pair, tmp_path, speculation):
    max_new = [24, 40, 16, 24]
    got = decode(pair, tmp_path, 2, 4, "redundant", max_new, speculation)
    assert_same_rows(got, expected(pair, max_new, speculation), ("tokens", "per_round")[:1 + (speculation is True)])


# -- through `dflash-batch run` -------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_pair(tmp_path_factory) -> tuple[Path, Path]:
    return make_cli_kimi_pair(tmp_path_factory.mktemp("kimi_ep_cli"))


def ep_job(tmp_path: Path, cli_pair, out: str, rows: dict | None = None, **model) -> Path:
    """tests/test_multinode.py's job (greedy and sampled rows, 2 samples, logprobs; `rows`: its
    kimi_job settings) with `model` set."""
    path = kimi_job(tmp_path, cli_pair, out, **(rows or {}))
    doc = yaml.safe_load(path.read_text())
    doc["model"].update(model)
    path.write_text(yaml.safe_dump(doc))
    return path


def rows_of_any_shard(groups: Path, one: Path) -> tuple[list[dict], list[dict]]:
    """Both runs' rows without their shard (each group commits a shard of its own), having checked
    that both groups committed rows."""
    rows = stable_rows(groups)
    assert {r["shard_index"] for r in rows} == {0, 1}
    return [[{k: v for k, v in r.items() if k != "shard_index"} for r in rs] for rs in (rows, stable_rows(one))]


LONG_ROWS = dict(rows=16, max_new_tokens=32, rows_per_part=1)  # runs long enough to stop midway


@pytest.mark.slow
def test_dp2_with_experts_across_ranks_writes_one_process_rows_and_resumes_as_one_run(cli_pair, tmp_path):
    """`dflash-batch run` at data_parallel_size 2 with expert_parallel (2 ranks, spawned): the rows of
    one process, each group committing its own shard; the stats hold each group's routing counts and
    idle forwards; status sees one complete run of 2 shards; a rerun finds it complete and loads
    nothing; with one group's rows gone, a rerun runs them, the finished group serving its experts;
    a placement from the run's counts (`experts place`) gives the same rows again."""
    run_tp1(ep_job(tmp_path, cli_pair, "one"))
    run_tp1(ep_job(tmp_path, cli_pair, "dp2", data_parallel_size=2, expert_parallel=True))
    assert_rows_equal_tp1(*rows_of_any_shard(tmp_path / "dp2", tmp_path / "one"))
    stats = [json.loads((tmp_path / "dp2" / "stats" / f"shard-{i:05d}.json").read_text()) for i in range(2)]
    for s in stats:
        routed = s["experts"]["routed_tokens"]
        assert routed and all(sum(c) == sum(routed[next(iter(routed))]) for c in routed.values())
        assert set(s["experts"]["hottest_over_mean"][next(iter(routed))]) == {"default", "this_run", "placed"}
    assert sum(s["experts"]["idle_forwards"] for s in stats) > 0  # the group that ended first served the other
    report = subprocess.run([*CLI, "report", str(tmp_path / "dp2")], capture_output=True, text=True, cwd=ROOT)
    assert report.returncode == 0 and "## Routed experts" in report.stdout, report.stderr
    assert "| 1 | " in report.stdout.split("## Routed experts")[1], report.stdout
    done = subprocess.run([*CLI, "status", str(tmp_path / "dp2")], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and "2 shard(s)" in done.stdout and "incomplete" not in done.stdout, done.stdout
    again = subprocess.run([*CLI, "run", str(tmp_path / "dp2.yaml"), "--no-progress"], capture_output=True,
                           text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0 and again.stdout.count("already complete") == 2, again.stdout + again.stderr
    shutil.rmtree(tmp_path / "dp2" / "data" / "shard-00001")  # group 1's rows lost: group 0 has none to run
    (tmp_path / "dp2" / "stats" / "shard-00001.json").unlink()
    run_tp1(tmp_path / "dp2.yaml")
    assert_rows_equal_tp1(*rows_of_any_shard(tmp_path / "dp2", tmp_path / "one"))
    placed = subprocess.run([*CLI, "experts", "place", str(tmp_path / "dp2"), "-o", str(tmp_path / "p.json"),
                             "--ranks", "2", "--redundant", "1"], capture_output=True, text=True, cwd=ROOT)
    assert placed.returncode == 0, placed.stderr
    run_tp1(ep_job(tmp_path, cli_pair, "placed", data_parallel_size=2, expert_parallel=True, redundant_experts=1,
                   expert_placement=str(tmp_path / "p.json")))
    assert_rows_equal_tp1(*rows_of_any_shard(tmp_path / "placed", tmp_path / "one"))


@pytest.mark.slow
def test_a_group_killed_stops_every_rank_within_a_minute_and_resume_commits_each_row_once(cli_pair, tmp_path):
    """Two data-parallel groups with the experts across both, a node each (torchrun), group 1's rank
    killed outright once rows are committed: both launches exit non-zero within 60 s, group 0's rank
    naming itself; a resumed run (one launch) ends with one process's rows, each committed once."""
    def job(where: Path, **model) -> Path:
        return ep_job(where, cli_pair, "out", LONG_ROWS, **model)

    groups = job(tmp_path, data_parallel_size=2, expert_parallel=True)
    port = free_port()
    nodes = [torchrun_node(n, port, groups, per_node=1, start_new_session=True) for n in (0, 1)]
    logs, seconds = kill_a_rank_of_node_1_once_rows_commit(nodes, tmp_path / "out")
    assert seconds < 60
    assert "the run lost a rank" in logs[0] and "error: rank 0 of 2 (data-parallel group 0 of 2) on" in logs[0], \
        logs[0][-3000:]
    assert 0 < len(read_out(tmp_path / "out")) < 32
    run_tp1(groups)  # the resume: `dflash-batch run` starts both groups' ranks itself
    whole = tmp_path / "whole"
    whole.mkdir()
    run_tp1(job(whole))
    assert_rows_equal_tp1(*rows_of_any_shard(tmp_path / "out", whole / "out"))
    keys = [(r["row_id"], r["sample_index"]) for r in read_out(tmp_path / "out")]
    assert len(keys) == len(set(keys)) == 32


@pytest.mark.slow
def test_a_preempted_run_of_groups_stops_every_group_and_resumes_each_row_once(cli_pair, tmp_path):
    """SIGTERM (Slurm's preemption) to `dflash-batch run` of two data-parallel groups with the experts
    across both, once rows are committed: every rank stops at a row of its group's, a group that stopped
    first serving the other's experts until it has, and the run exits 143; the resumed run ends with
    one process's rows, each committed once."""
    def job(where: Path, **model) -> Path:
        return ep_job(where, cli_pair, "out", LONG_ROWS, **model)

    groups = job(tmp_path, data_parallel_size=2, expert_parallel=True)
    run = subprocess.Popen([*CLI, "run", str(groups), "--no-progress"], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not read_out(tmp_path / "out") and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)
        log = run.communicate(timeout=120)[0]  # every group stops at its next row: seconds
    finally:  # a hang (a group stopped inside a forward the other waits on) must not outlive the test
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 143, log[-3000:]
    assert "terminated: finished rows are committed" in log, log[-3000:]
    assert "error" not in log, log[-3000:]  # no group left waiting on one that stopped without serving it
    progress = [json.loads(p.read_text()) for p in sorted((tmp_path / "out" / "progress").glob("shard-*.json"))]
    assert [p["state"] for p in progress] == ["stopped", "stopped"], progress
    assert 0 < len(read_out(tmp_path / "out")) < 32
    run_tp1(groups)
    whole = tmp_path / "whole"
    whole.mkdir()
    run_tp1(job(whole))
    assert_rows_equal_tp1(*rows_of_any_shard(tmp_path / "out", whole / "out"))
    keys = [(r["row_id"], r["sample_index"]) for r in read_out(tmp_path / "out")]
    assert len(keys) == len(set(keys)) == 32
