"""The data path end to end with the deterministic test engine: inputs, bad rows, outputs."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_batch.io.ledger import part_files
from dflash_batch.job import JobError
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

ONE = Shard(0, 1)


def test_jsonl_with_passthrough_and_n_samples(tmp_path, model_dir):
    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": f"What is {i} plus 30?", "topic": "math",
                                        "meta": {"k": i}} for i in range(7)])
    job = write_job(tmp_path, base_job(model_dir, ["p.jsonl"], sampling={"n": 3, "max_new_tokens": 12},
                                       input={"passthrough_columns": ["topic", "meta"]}))
    result = run_job(job, fake_factory(), ONE, progress=False)
    rows = read_out(tmp_path / "out")
    assert result.rows_written == 21 and len(rows) == 21
    assert Counter((r["row_id"], r["sample_index"]) for r in rows) == {(f"r{i}", s): 1 for i in range(7)
                                                                      for s in range(3)}
    r0 = next(r for r in rows if r["row_id"] == "r3" and r["sample_index"] == 1)
    assert r0["topic"] == "math" and r0["meta"] == {"k": 3}
    assert r0["status"] == "ok" and r0["completion_tokens"] >= 1 and r0["prompt_tokens"] > 3
    assert r0["acc_len"] == pytest.approx(1 + r0["spec_accepted"] / r0["spec_rounds"])
    assert sum(r0["spec_histogram"]) == r0["spec_rounds"]
    # samples of one prompt have different seeds
    assert len({r["seed"] for r in rows if r["row_id"] == "r3"}) == 3


def test_parquet_input_with_passthrough(tmp_path, model_dir):
    pq.write_table(pa.table({"id": [10, 11, 12], "prompt": ["a b c", "hello world", "the fox"],
                             "score": [0.5, 1.5, 2.5]}), tmp_path / "p.parquet")
    job = write_job(tmp_path, base_job(model_dir, ["*.parquet"], input={"passthrough_columns": ["score"]}))
    run_job(job, fake_factory(), ONE, progress=False)
    rows = sorted(read_out(tmp_path / "out"), key=lambda r: r["row_id"])
    assert [r["row_id"] for r in rows] == ["10", "11", "12"]
    assert [r["score"] for r in rows] == [0.5, 1.5, 2.5]
    assert pq.read_schema(next((tmp_path / "out").rglob("part-*.parquet"))).field("score").type == pa.float64()


def test_bad_rows_become_error_rows_and_the_job_continues(tmp_path, model_dir):
    long_prompt = " ".join(["fox"] * 400)
    write_jsonl(tmp_path / "p.jsonl", [
        {"id": "ok1", "prompt": "hello world"},
        b'{"id": "broken", "prompt": ',                      # malformed JSON
        {"id": "noprompt", "text": "x"},                       # missing prompt
        {"id": "wrongtype", "prompt": 42},                     # wrong type
        {"id": "empty", "prompt": "   "},                      # empty prompt
        {"id": "long", "prompt": long_prompt},                 # over-long prompt
        b"[1, 2, 3]",                                         # JSON but not an object
        {"id": "ok2", "prompt": "the quick brown fox"},
    ])
    job = write_job(tmp_path, base_job(model_dir, ["p.jsonl"]))
    run_job(job, fake_factory(), ONE, progress=False)
    rows = {r["row_id"]: r for r in read_out(tmp_path / "out")}
    assert len(rows) == 8
    assert rows["ok1"]["status"] == rows["ok2"]["status"] == "ok"
    errors = {k: r["error_type"] for k, r in rows.items() if r["status"] == "error"}
    assert sorted(errors.values()) == sorted(["bad_input_line", "missing_prompt", "bad_prompt_type",
                                              "empty_prompt", "prompt_too_long", "bad_input_line"])
    broken = [r for r in rows.values() if r["error_type"] == "bad_input_line"]
    assert {"p.jsonl: line 2 is not valid JSON" in r["error"] or "line 7" in r["error"] for r in broken} == {True}
    assert "'prompt'" in rows["wrongtype"]["error"] and "int" in rows["wrongtype"]["error"]
    assert "exceeds 256" in rows["long"]["error"] and rows["long"]["finish_reason"] == "error"


@pytest.mark.parametrize("policy", ["truncate_left", "truncate_right"])
def test_overflow_truncation(tmp_path, model_dir, policy):
    words = [f"w{i}" for i in range(300)]
    write_jsonl(tmp_path / "p.jsonl", [{"id": "long", "input_ids": list(range(10, 310))}])
    doc = base_job(model_dir, ["p.jsonl"], overflow=policy)
    doc["input"] = {"paths": ["p.jsonl"], "input_ids_column": "input_ids", "id_column": "id"}
    job = write_job(tmp_path, doc)
    run_job(job, fake_factory(), ONE, progress=False)
    (row,) = read_out(tmp_path / "out")
    assert row["status"] == "ok" and row["prompt_truncated"] is True
    assert row["prompt_tokens"] == 256 - 16
    del words


def test_buckets_are_recorded_and_edges_respected(tmp_path, model_dir):
    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{n}", "input_ids": [11] * n} for n in (1, 48, 49, 100, 200)])
    doc = base_job(model_dir, ["p.jsonl"], buckets=[{"max_tokens": 64}, {"max_tokens": 128},
                                                    {"max_tokens": 256}])
    doc["input"] = {"paths": ["p.jsonl"], "input_ids_column": "input_ids", "id_column": "id"}
    run_job(write_job(tmp_path, doc), fake_factory(), ONE, progress=False)
    rows = {r["row_id"]: r["bucket"] for r in read_out(tmp_path / "out")}
    # prompt + max_new_tokens(16): 17, 64 | 65, 116 | 216
    assert rows == {"r1": "0-64", "r48": "0-64", "r49": "64-128", "r100": "64-128", "r200": "128-256"}


def test_sampling_override_columns(tmp_path, model_dir):
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi", "mx": 3},
                                       {"id": "b", "prompt": "hi", "mx": "lots"},
                                       {"id": "c", "prompt": "hi"}])
    job = write_job(tmp_path, base_job(model_dir, ["p.jsonl"], input={"sampling_columns": {"max_new_tokens": "mx"}}))
    run_job(job, fake_factory(), ONE, progress=False)
    rows = {r["row_id"]: r for r in read_out(tmp_path / "out")}
    assert rows["a"]["completion_tokens"] <= 3
    assert rows["b"]["status"] == "error" and "mx" in rows["b"]["error"]
    assert rows["c"]["status"] == "ok"


def test_messages_are_rendered_with_the_chat_template(tmp_path, model_dir):
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"}]},
                                       {"id": "b", "messages": "not a list"}])
    doc = base_job(model_dir, ["p.jsonl"], output={"include_prompt": True})
    doc["input"] = {"paths": ["p.jsonl"], "messages_column": "messages", "id_column": "id",
                    "system_prompt": "Be brief."}
    run_job(write_job(tmp_path, doc), fake_factory(), ONE, progress=False)
    rows = {r["row_id"]: r for r in read_out(tmp_path / "out")}
    assert rows["a"]["rendered_prompt"] == ("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
                                            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert rows["b"]["error_type"] == "bad_prompt_type"


def test_ids_without_id_column_are_stable_and_distinct(tmp_path, model_dir):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"prompt": "x"}] * 3)
    write_jsonl(d / "b.jsonl", [{"prompt": "x"}] * 3)
    doc = base_job(model_dir, ["data"])
    doc["input"].pop("id_column")
    run_job(write_job(tmp_path, doc), fake_factory(), ONE, progress=False)
    first = sorted(r["row_id"] for r in read_out(tmp_path / "out"))
    assert len(set(first)) == 6
    # the same data moved elsewhere gets the same ids (they hash the path relative to the input root)
    moved = tmp_path / "moved"
    d.rename(moved)
    doc["input"]["paths"] = ["moved"]
    doc["output"]["dir"] = "out2"
    run_job(write_job(tmp_path, doc), fake_factory(), ONE, progress=False)
    assert sorted(r["row_id"] for r in read_out(tmp_path / "out2")) == first


def test_job_level_problems_stop_before_any_work(tmp_path, model_dir):
    pq.write_table(pa.table({"id": [1], "text": ["x"]}), tmp_path / "p.parquet")
    job = write_job(tmp_path, base_job(model_dir, ["p.parquet"]))
    with pytest.raises(JobError, match=r"p.parquet: column\(s\) \['prompt'\] not found"):
        run_job(job, fake_factory(), ONE, progress=False)
    assert not (tmp_path / "out").exists()
    job = write_job(tmp_path, base_job(model_dir, ["p.parquet"], input={"prompt_column": "text",
                                                                        "passthrough_columns": ["status"]}))
    with pytest.raises(JobError, match="collides with an output column"):
        run_job(job, fake_factory(), ONE, progress=False)


def test_changed_config_is_refused_with_a_way_out(tmp_path, model_dir):
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    run_job(write_job(tmp_path, base_job(model_dir, ["p.jsonl"])), fake_factory(), ONE, progress=False)
    changed = write_job(tmp_path, base_job(model_dir, ["p.jsonl"], sampling={"temperature": 0.7},
                                           input={"workers": 3}))  # tuning: not named as a change
    with pytest.raises(JobError, match=r"changed: sampling.temperature\). .*new directory"):
        run_job(changed, fake_factory(), ONE, progress=False)
    with pytest.raises(JobError, match="uses 1 shards, this task says 4"):
        run_job(write_job(tmp_path, base_job(model_dir, ["p.jsonl"])), fake_factory(), Shard(0, 4),
                progress=False)
    # tuning knobs may change between resumes
    tuned = write_job(tmp_path, base_job(model_dir, ["p.jsonl"], engine={"max_num_seqs": 1}, input={"workers": 0}))
    assert run_job(tuned, fake_factory(), ONE, progress=False).rows_written == 0


def test_shard_stats_pool_counters_as_ratios_of_sums(tmp_path, model_dir):
    import json
    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "input_ids": [11] * (1 + i * 7), "mx": 4 + i % 13}
                                       for i in range(30)] + [{"id": "bad", "input_ids": []}])
    doc = base_job(model_dir, ["p.jsonl"], buckets=[{"max_tokens": 64}, {"max_tokens": 256}])
    doc["input"] = {"paths": ["p.jsonl"], "input_ids_column": "input_ids", "id_column": "id",
                    "sampling_columns": {"max_new_tokens": "mx"}}
    result = run_job(write_job(tmp_path, doc), fake_factory(), ONE, progress=False)
    rows = read_out(tmp_path / "out")
    stats = json.loads((tmp_path / "out" / "stats" / "shard-00000.json").read_text())["buckets"]
    assert stats == result.stats
    for name in ("0-64", "64-128", "128-256"):
        mine = [r for r in rows if r["bucket"] == name]
        if not mine:
            continue
        s = stats[name]
        rounds = sum(r["spec_rounds"] for r in mine)
        accepted = sum(r["spec_accepted"] for r in mine)
        assert s["rows"] == len(mine) and s["spec_rounds"] == rounds
        assert s["spec_histogram"] == [sum(r["spec_histogram"][k] for r in mine) for k in range(8)]
        assert s["acc_len"] == pytest.approx(1 + accepted / rounds)
        verified = sum(r["spec_drafts_verified"] for r in mine)
        assert s["spec_drafts_verified"] == verified < 7 * rounds  # the fake engine verifies fewer at times
        assert s["proposal_acceptance"] == pytest.approx(accepted / verified)
        # Each row's own: over the drafts its rounds verified, not the block's 7 a round.
        for r in mine:
            assert r["proposal_acceptance"] == pytest.approx(r["spec_accepted"] / r["spec_drafts_verified"])
        assert any(r["spec_drafts_verified"] < 7 * r["spec_rounds"] and r["spec_accepted"] for r in mine)
        assert s["completion_tokens"] == sum(r["completion_tokens"] for r in mine)
    assert stats["-"]["error"] == 1 and stats["-"]["acc_len"] is None


def test_per_row_n_and_chat_template_kwargs(tmp_path, model_dir):
    """n and chat_template_kwargs from input columns: each row gets its own number of samples and
    its own template switches (merged over the job's); a resume finds a row's missing samples
    by the row's own n."""
    write_jsonl(tmp_path / "p.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": "hi"}], "k": 3, "kw": {"enable_thinking": False}},
        {"id": "b", "messages": [{"role": "user", "content": "hi"}], "k": 1},
        {"id": "c", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "d", "messages": [{"role": "user", "content": "hi"}], "k": 0}])
    doc = base_job(model_dir, ["p.jsonl"], sampling={"n": 2}, output={"include_prompt": True, "rows_per_part": 1})
    doc["input"] = {"paths": ["p.jsonl"], "messages_column": "messages", "id_column": "id",
                    "sampling_columns": {"n": "k", "chat_template_kwargs": "kw"}}
    job = write_job(tmp_path, doc)
    run_job(job, fake_factory(), ONE, progress=False)
    rows = read_out(tmp_path / "out")
    ok = sorted((r["row_id"], r["sample_index"]) for r in rows if r["status"] == "ok")
    assert ok == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1)]
    errors = {(r["row_id"], r["sample_index"], r["error_type"]) for r in rows if r["status"] == "error"}
    assert errors == {("d", 0, "bad_sampling_override"), ("d", 1, "bad_sampling_override")}  # n: 0, job's n
    prompts = {r["row_id"]: r["rendered_prompt"] for r in rows}
    assert prompts["a"].endswith("<|im_start|>assistant\n<think></think>")
    assert prompts["c"].endswith("<|im_start|>assistant\n")

    # Lose the part that holds a's third sample: the resume makes exactly that sample again.
    [lost] = [f for f in part_files(tmp_path / "out")
              if [(r["row_id"], r["sample_index"]) for r in pq.read_table(f).to_pylist()] == [("a", 2)]]
    lost.unlink()
    run_job(job, fake_factory(), ONE, progress=False)
    again = sorted((r["row_id"], r["sample_index"]) for r in read_out(tmp_path / "out") if r["status"] == "ok")
    assert again == ok


def test_tools_column_reaches_the_chat_template(tmp_path, model_dir):
    (tmp_path / "tools.jinja").write_text(
        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]},
                                       {"id": "b", "messages": [{"role": "user", "content": "hi"}]},
                                       {"id": "c", "messages": [{"role": "user", "content": "hi"}], "tools": "add"}])
    doc = base_job(model_dir, ["p.jsonl"], output={"include_prompt": True})
    doc["input"] = {"paths": ["p.jsonl"], "messages_column": "messages", "id_column": "id", "tools_column": "tools"}
    doc["model"]["chat_template"] = "tools.jinja"
    run_job(write_job(tmp_path, doc), fake_factory(), ONE, progress=False)
    rows = {r["row_id"]: r for r in read_out(tmp_path / "out")}
    assert rows["a"]["rendered_prompt"] == 'TOOLS [{"type": "function", "function": {"name": "add", ' \
                                           '"parameters": {"type": "object"}}}]\nhi'
    assert rows["b"]["rendered_prompt"] == "hi"
    assert (rows["c"]["error_type"], rows["c"]["error"]) == ("bad_prompt_type",
                                                             "column 'tools' must be a list of tool objects")


def test_the_progress_bar_shows_the_k_of_the_last_round(tmp_path, model_dir, monkeypatch):
    """An auto bucket's bar carries `k`, the drafts its engine's last round verified, as it
    changes; once speculation is off it shows none."""
    from dflash_batch import output_rows
    from dflash_batch.engine.schedule import Schedule
    from tests.fake_engine import FakeEngine

    shown = []

    class Bar:
        def __init__(self, *args, **kwargs): ...
        def update(self, n): ...
        def close(self): ...
        def set_postfix(self, post, refresh=True):
            shown.append(post.get("k"))

    class Scheduled(FakeEngine):  # each completion follows a round of the next (k, off)
        def generate(self, requests, bucket):
            rounds = iter([(7, False), (3, False), (3, False), (0, False), (5, False), (5, True)])
            schedule = Schedule(block=8, sizes=[1], window=8, pinned=None)
            self.schedules = {bucket.name: schedule}
            for c in super().generate(requests, bucket):
                schedule.k, schedule.off = next(rounds)
                yield c

    clock = iter(range(0, 1000, 1))  # a second between reads: the bar is redrawn every row
    monkeypatch.setattr(output_rows, "tqdm", Bar)
    monkeypatch.setattr(output_rows.time, "monotonic", lambda: next(clock))
    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": f"{i} plus 1?"} for i in range(6)])
    job = write_job(tmp_path, base_job(model_dir, ["p.jsonl"], sampling={"max_new_tokens": 4}))
    run_job(job, lambda job, tok: Scheduled(tok), ONE, progress=True)
    assert shown == [7, 3, 3, 0, 5, None]


@pytest.mark.parametrize("rows_per_part", [1, 100])
def test_passthrough_values_of_mixed_json_types_come_out_as_the_input_had_them(tmp_path, model_dir, rows_per_part):
    """A JSONL column holding dicts, strings, numbers and nulls: in a part where no Arrow type
    holds them all the column is text, a string written as it is (as in a part whose values are
    all strings) and the other values as their JSON, which json.loads gives back."""
    import json
    meta = [{"a": 1, "b": [2, "x"]}, "plain", 3, None, "plain too", "7", True, [1, {"c": None}]]
    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": f"row {i}", "meta": m} for i, m in enumerate(meta)])
    doc = base_job(model_dir, ["p.jsonl"], input={"passthrough_columns": ["meta"]},
                   output={"rows_per_part": rows_per_part})
    run_job(write_job(tmp_path, doc), fake_factory(), ONE, progress=False)
    got = {r["row_id"]: r["meta"] for r in read_out(tmp_path / "out")}
    for i, m in enumerate(meta):
        value = got[f"r{i}"]
        if isinstance(m, str) or m is None:
            assert value == m  # never JSON-encoded
        else:  # JSON text in a mixed part; a part of one value may keep its type
            assert value == m and rows_per_part == 1 or isinstance(value, str) and json.loads(value) == m, (m, value)
