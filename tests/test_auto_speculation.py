"""speculation: auto: a bucket whose acceptance over its last `rounds` sequence-rounds falls below
min_acc_len stops speculating part way (the running sequences go on target-only in place, the
rest never draft) and says so; greedy outputs stay target-only greedy's, both families, in
float64; the run's stats and report say which buckets ran with the drafter; the job file
refuses auto where it cannot act."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from dflash_batch.engine import engine as engine_module
from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.graphs import RoundGraphs
from dflash_batch.engine.schedule import Schedule
from dflash_batch.job import JobError, parse_job
from dflash_batch.plan.buckets import Bucket
from dflash_batch.report import build_report, to_markdown
from dflash_batch.testing import kimi_pair
from tests.engine_util import F64, bucket, pair_of_each_family, random_prompts, run
from tests.jobs_util import read_out

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = [40, 3, 90, 17, 60, 8, 25, 33]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return pair_of_each_family(tmp_path_factory.mktemp("auto"))


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_an_auto_bucket_turns_speculation_off_and_decodes_as_target_only(pairs, family):
    target, drafter = pairs[family]
    vocab = kimi_pair.VOCAB if family == "kimi" else 8
    prompts = random_prompts(LENGTHS, vocab=vocab, seed=4)
    auto = Bucket(0, "0-256", 256, 3, "auto", None)
    want = [c.token_ids for c in run(Engine(target, None, dtype=F64), prompts, bucket(max_num_seqs=3, max_tokens=256),
                                     max_new_tokens=30)]

    log = []
    # No block of 8 reaches an acc_len of 9: the switch trips once 6 sequence-rounds are in.
    engine = Engine(target, drafter, dtype=F64, auto_speculation=(9.0, 6), log=log.append)
    got = run(engine, prompts, auto, max_new_tokens=30)
    assert [c.token_ids for c in got] == want
    off = [line for line in log if "speculation off (auto)" in line]
    assert len(off) == 1, log
    speculated = [c for c in got if c.spec is not None]
    assert 0 < len(speculated) < len(got)
    assert sum(c.spec.rounds for c in speculated) >= 6
    # A sequence that was decoding at the switch has speculative rounds and target-only tokens:
    # its rounds account for fewer tokens than it generated.
    assert any(c.spec.rounds + c.spec.accepted < len(c.token_ids) - 1 and c.finish_reason == "length"
               for c in speculated)
    # The bucket stays off for the rest of the run.
    assert all(c.spec is None for c in run(engine, prompts[:2], auto, max_new_tokens=30))
    if family == "kimi":  # one-row verifies stage one row
        assert {layer.self_attn.staged_raw.shape[1] for layer in target.model.layers if layer.is_kda} == {1}

    # A bucket that keeps accepting enough stays on (by the floor: on the CPU the tiny pair's
    # drafter costs more than it yields, so the cost test of schedule.py is held off here).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Schedule, "pays_nowhere", lambda self: False)
        steady = run(Engine(target, drafter, dtype=F64, auto_speculation=(1.0, 6)), prompts, auto,
                     max_new_tokens=30)
    assert [c.token_ids for c in steady] == want
    assert all(c.spec is not None for c in steady)


@pytest.mark.slow
def test_demo_long_prompts_turn_speculation_off_and_the_report_says_so(tmp_path):
    """jobs/demo-auto.yaml: the demo pair's few-shot prompts (the 256-1024 bucket) accept little;
    with that bucket on auto (4 at a time) and a threshold above its acceptance, it switches off
    part way; the stats and the report show it beside the short bucket, which speculated
    throughout."""
    result = subprocess.run([sys.executable, "-m", "dflash_batch.cli", "run", str(ROOT / "jobs/demo-auto.yaml"),
                             "--output-dir", str(tmp_path / "out"), "--no-progress"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    logged = re.search(r"bucket 256-1024: speculation off \(auto\): acc_len (\d\.\d\d) over the last (\d+) "
                       r"sequence-rounds < 3\.0", result.stderr)
    assert logged, result.stderr[-2000:]
    rows = read_out(tmp_path / "out")
    long = [r for r in rows if r["bucket"] == "256-1024"]
    assert any(r["spec_block_size"] is None for r in long) and any(r["spec_block_size"] for r in long)
    record = orjson.loads((tmp_path / "out/stats/shard-00000.json").read_bytes())
    stats = record["buckets"]
    # The schedule's record: round costs at each batch size the bucket runs at and each k, the
    # acceptance by position, the rounds run at each k (the whole block while it explored).
    schedule = record["schedule"]["256-1024"]
    assert schedule["mode"] == "auto" and sorted(schedule["cost_ms"], key=int) == ["1", "2", "4"]
    assert all(len(costs) == 8 and min(costs) > 0 for costs in schedule["cost_ms"].values())
    assert len(schedule["acceptance_by_position"]) == 7 and schedule["trials_by_position"][0] == 8
    assert schedule["rounds_by_k"]["4"]["7"] == stats["256-1024"]["spec_rounds"] // 4
    assert record["schedule"]["0-256"]["mode"] == "drafts 7"
    assert stats["0-256"]["speculation"] == "on"
    # It switched as its window first filled (8 sequence-rounds, 4 sequences a round, every one
    # verifying the whole block while the schedule explores: the floor is checked before the
    # round costs decide anything): the window is every speculative round the bucket ran.
    assert int(logged[2]) == stats["256-1024"]["spec_rounds"] == 8
    assert logged[1] == f"{stats['256-1024']['acc_len']:.2f}"
    speculated = sum(r["spec_block_size"] is not None for r in long)
    assert stats["256-1024"]["speculation"] == f"on for {speculated}/{len(long)}"
    report = build_report(tmp_path / "out")
    assert report["buckets"]["256-1024"]["speculation"] == f"on for {speculated}/{len(long)}"
    markdown = to_markdown(report)
    assert f"| on for {speculated}/{len(long)} |" in markdown
    assert "### 256-1024, shard 0 (auto)" in markdown and "| batch 4: ms a round |" in markdown


def test_the_window_slides_over_the_last_rounds():
    """100 sequence-rounds accepting 7 drafts each, then rounds accepting none: speculation stops
    exactly when the window holds only the new rounds. A window that kept its first rounds, or
    every round, would still measure 7 or more and never stop."""
    auto = Schedule(block=8, sizes=[4], window=8, pinned=None, min_acc_len=2.0)
    for _ in range(25):
        auto.record(4, 7, 0.0, [7, 7, 7, 7], [7, 7, 7, 7])
        assert not auto.below_floor()
    # Two sequences a round: the window holds 6, 4, 2, then none of the accepting rounds.
    stops = []
    for _ in range(4):
        auto.record(2, 7, 0.0, [0, 0], [7, 7])
        stops.append(auto.below_floor())
    assert stops == [False, False, False, True]
    assert auto.acceptance.expected_tokens(7) == 1.0


@pytest.mark.parametrize("change, message", [
    (dict(model={"drafter": None}), r"speculation: auto, which needs model.drafter"),
    (dict(buckets=[{"max_tokens": 256}], engine={"auto_speculation": {"min_acc_len": 2.0}}),
     r"engine.auto_speculation is set but no bucket has speculation: auto"),
])
def test_the_job_file_refuses_auto_where_it_cannot_act(change, message):
    doc = {"input": {"paths": ["x.jsonl"], "prompt_column": "p"},
           "model": {"target": "t", "drafter": "d"}, "engine": {"max_model_len": 256},
           "buckets": [{"max_tokens": 256, "speculation": "auto"}], "output": {"dir": "o"}}
    for k, v in change.items():
        doc[k] = {**doc[k], **v} if isinstance(v, dict) else v
    with pytest.raises(JobError, match=message):
        parse_job(doc, Path("job.yaml"))


class WarmUpOnly(RoundGraphs):
    """RoundGraphs on the CPU: the warm-up rounds a capture runs, for real, and no graph."""

    def _capture(self, size: int, greedy: bool, width: int) -> None:
        for _ in range(2):
            self.step(self.batch, size, greedy, self.max_kv, width)

    def covers(self, size: int, width: int | None = None) -> bool:
        return False


@pytest.mark.numerics
def test_the_switch_captures_before_sequences_move_in(pairs, monkeypatch):
    """With CUDA graphs, the one-row round is captured (its warm-up rounds run) while its batch
    is all padding: captured after the sequences moved in, the warm-ups would decode them."""
    monkeypatch.setattr(engine_module, "RoundGraphs", WarmUpOnly)
    target, drafter = pairs["qwen3"]
    prompts = random_prompts(LENGTHS, seed=4)
    want = [c.token_ids for c in run(Engine(target, None, dtype=F64), prompts, bucket(max_num_seqs=3, max_tokens=256),
                                     max_new_tokens=30)]
    engine = Engine(target, drafter, dtype=F64, auto_speculation=(9.0, 6), cuda_graphs=True, capture_sizes=[1, 2, 4])
    got = run(engine, prompts, Bucket(0, "0-256", 256, 3, "auto", None), max_new_tokens=30)
    assert [c.token_ids for c in got] == want
    assert engine.schedules["0-256"].off


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("family", ["qwen3", "kimi"])
@pytest.mark.parametrize("count", [1, 8])
def test_a_switch_that_fails_changes_nothing_and_is_tried_again(pairs, monkeypatch, family, count):
    """The one-row batch cannot be allocated the first time: no sequence is touched (alone or
    not, none fails or starts over), the bucket goes on speculating and tries again a window
    later; the log says so, and says off once when it is; outputs stay target-only's."""
    target, drafter = pairs[family]
    vocab = kimi_pair.VOCAB if family == "kimi" else 8
    failed = []

    def flaky(*args, **kwargs):
        if args[1] == 1 and not failed:
            failed.append(True)
            raise RuntimeError("no memory for the one-row batch")
        return DecodeBatch(*args, **kwargs)

    prompts = random_prompts(LENGTHS[:count], vocab=vocab, seed=4)
    want = [c.token_ids for c in run(Engine(target, None, dtype=F64), prompts, bucket(max_num_seqs=3, max_tokens=256),
                                     max_new_tokens=30)]
    monkeypatch.setattr(engine_module, "DecodeBatch", flaky)
    log = []
    engine = Engine(target, drafter, dtype=F64, auto_speculation=(9.0, 3), log=log.append)
    got = run(engine, prompts, Bucket(0, "0-256", 256, 3, "auto", None), max_new_tokens=30)
    assert failed and [c.token_ids for c in got] == want and all(c.error_type is None for c in got)
    assert sum("could not be turned off" in line for line in log) == 1
    assert sum("speculation off (auto)" in line for line in log) == int(engine.schedules["0-256"].off)
    if count > 1:
        assert engine.schedules["0-256"].off and any(c.spec is None for c in got)
