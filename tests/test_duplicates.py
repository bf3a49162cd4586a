"""Duplicate ids: found through spill parts (every row of a key in one part, no part holding the
whole input) with the counts a plain Counter gives; `validate` refuses an input with them,
naming the ids and their rows, and `status` reports the keys a run committed twice."""

from __future__ import annotations

import random
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dflash_batch.cli import main
from dflash_batch.io import spill
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl


def test_spill_parts_regroup_every_key_and_count_like_a_counter(monkeypatch):
    monkeypatch.setattr(spill, "PART_BYTES", 2000)  # spill past 2 kB, as past 256 MiB in a run
    rng = random.Random(0)
    ids = [f"id{rng.randrange(1500)}" for _ in range(2000)]
    tables = [pa.table({"row_id": ids[i:i + 128], "n": list(range(i, min(i + 128, len(ids))))})
              for i in range(0, len(ids), 128)]
    parts = list(spill.by_key(iter(tables), "row_id"))
    assert len(parts) > 10 and max(p.num_rows for p in parts) < len(ids) / 20
    seen = [set(p["row_id"].to_pylist()) for p in parts]
    assert sum(map(len, seen)) == len(set(ids))  # each key in exactly one part
    assert sorted(n for p in parts for n in p["n"].to_pylist()) == list(range(len(ids)))  # every row once

    counts = Counter(ids)
    found = spill.duplicates(iter(tables), ["row_id"], "n", examples=3)
    assert found["count"] == sum(c > 1 for c in counts.values())
    assert found["rows"] == sum(c for c in counts.values() if c > 1)
    for e in found["examples"]:
        assert sorted(e["n_list"]) == [i for i, x in enumerate(ids) if x == e["row_id"]]


def test_validate_names_duplicate_ids_and_their_rows(tmp_path, model_dir):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "prompt": "hi"}, {"id": "y", "prompt": "hi"}])
    pq.write_table(pa.table({"id": ["z", "x", "x"], "prompt": ["a", "b", "c"]}), tmp_path / "b.parquet")
    write_job(tmp_path, base_job(model_dir, ["a.jsonl", "b.parquet"]))
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "job.yaml")])
    assert result.exit_code == 2, result.output
    assert "1 id(s) are held by more than one row (3 rows)" in result.output
    assert "'x' at " in result.output and "a.jsonl#0" in result.output and "b.parquet#2" in result.output

    requests = [{"custom_id": c, "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}
                for c in ("a", "b", "a")]
    write_jsonl(tmp_path / "batch.jsonl", requests)
    doc = base_job(model_dir, ["batch.jsonl"], input={"format": "openai_batch", "prompt_column": None,
                                                      "id_column": None})
    write_job(tmp_path, doc, "openai.yaml")
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "openai.yaml")])
    assert result.exit_code == 2 and "'a' at batch.jsonl#0, batch.jsonl#2" in result.output, result.output


def test_status_reports_keys_committed_twice(tmp_path, model_dir):
    write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": f"row {i}"} for i in (1, 2, 2, 3, 3, 3)])
    doc = base_job(model_dir, ["p.jsonl"])
    run_job(write_job(tmp_path, doc), fake_factory(), Shard(0, 1), progress=False)
    rows = read_out(tmp_path / "out")  # in commit order (parts of 5 rows, read in order)
    errors = [r for r in rows if r["status"] == "error"]
    # The first row of an id is answered (and committed) before its duplicates' error rows: a
    # stop in between must not leave the id with only an error, which a resume would skip.
    order = [(r["row_id"], r["status"]) for r in rows]
    assert order.index(("3", "ok")) < order.index(("3", "error"))
    assert sorted((r["row_id"], r["error_type"]) for r in errors) == [("2", "duplicate_id"), ("3", "duplicate_id"),
                                                                      ("3", "duplicate_id")]
    result = CliRunner().invoke(main, ["status", str(tmp_path / "out")])
    assert result.exit_code == 0
    assert "duplicate ids: shard 0 committed 5 rows under 2 (row_id, sample_index) keys" in result.output
    write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": f"row {i}"} for i in (1, 2, 3)])
    doc["output"]["dir"] = "unique"
    run_job(write_job(tmp_path, doc), fake_factory(), Shard(0, 1), progress=False)
    assert "duplicate" not in CliRunner().invoke(main, ["status", str(tmp_path / "unique")]).output


class Killed(BaseException):
    """The process dies here: nothing after this part is committed (as under SIGKILL)."""


@pytest.mark.slow
def test_a_run_killed_after_any_part_resumes_to_the_rows_of_one_uninterrupted_run(tmp_path, model_dir,
                                                                                 monkeypatch):
    """Ids held by several rows (one with a bad prompt among them, and rows asking for more samples
    than the first one of their id): a run killed after its k-th part, for every k, then resumed,
    commits the rows one uninterrupted run commits, error rows included: a later row's error row
    shares the first row's key, so committing one without the other would make the resume skip
    it (a lost duplicate_id row)."""
    from dflash_batch.io.outputs import PartWriter

    rows = [{"id": i, "prompt": f"row {i}", "n": 1 + (i == 3) + (j == 2)}
            for j, i in enumerate((1, 2, 2, 3, 3, 3, 4, 5, 5, 6))] + [{"id": 7, "prompt": ""}, {"id": 7, "prompt": "x"}]
    write_jsonl(tmp_path / "p.jsonl", rows)
    doc = base_job(model_dir, ["p.jsonl"], input={"sampling_columns": {"n": "n"}},
                   output={"dir": "whole", "rows_per_part": 2})

    def key(r: dict) -> tuple:
        return r["row_id"], r["sample_index"], r["status"], r["error_type"], r["response"]

    run_job(write_job(tmp_path, doc), fake_factory(), Shard(0, 1), progress=False)
    whole = sorted(map(key, read_out(tmp_path / "whole")))
    assert ("3", 1, "error", "duplicate_id", None) in whole and ("7", 0, "error", "duplicate_id", None) in whole
    parts = len(list((tmp_path / "whole" / "data" / "shard-00000").glob("part-*.parquet")))
    status = CliRunner().invoke(main, ["status", str(tmp_path / "whole")]).output
    summary = [line.split(" keys, e.g.")[0] for line in status.splitlines()
               if line.startswith(("error rows", "duplicate ids", "total"))]
    assert summary == ["total: 7 ok, 9 error, 1 shard(s), 1 complete",
                       "error rows: 8 duplicate_id (e.g. row '2'), 1 empty_prompt (e.g. row '7')",
                       "duplicate ids: shard 0 committed 12 rows under 5 (row_id, sample_index)"], status
    write_part = PartWriter.write_part
    for k in range(1, parts):
        written = []

        def dies_after_k(self, rows, k=k, written=written):
            if len(written) == k:
                raise Killed
            written.append(1)
            return write_part(self, rows)

        doc["output"]["dir"] = f"killed{k}"
        job = write_job(tmp_path, doc)
        monkeypatch.setattr(PartWriter, "write_part", dies_after_k)
        try:
            run_job(job, fake_factory(), Shard(0, 1), progress=False)
        except Killed:
            pass
        monkeypatch.setattr(PartWriter, "write_part", write_part)
        run_job(job, fake_factory(), Shard(0, 1), progress=False)
        assert sorted(map(key, read_out(tmp_path / f"killed{k}"))) == whole, k
        # status counts and names the error rows, and the ids committed twice, as after one run
        resumed = CliRunner().invoke(main, ["status", str(tmp_path / f"killed{k}")]).output
        assert [line.split(" keys, e.g.")[0] for line in resumed.splitlines()
                if line.startswith(("error rows", "duplicate ids", "total"))] == summary, (k, resumed)
