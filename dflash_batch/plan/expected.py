"""How many output rows each shard of a run holds once complete: its input rows' samples (a row's
n), or in a retry run its chosen keys. `status` compares them with what is committed.

Counting reads every input row's id and sampling fields once (no templating, no tokenising),
streaming; the answer is kept in OUT_DIR/shard_plan.json for as long as the input files are the
ones it was counted from. `settled_states` is what `status` and `report` call each shard.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import orjson
import pyarrow.parquet as pq

from dflash_batch.io.fingerprint import input_identity
from dflash_batch.io.inputs import read_records
from dflash_batch.io.ledger import RAY_INPUT, shard_finished, shard_states
from dflash_batch.io.outputs import atomic_write_bytes
from dflash_batch.job import Job
from dflash_batch.plan.rows import RowPreparer
from dflash_batch.plan.shards import shard_of


def expected_rows(job: Job, count: int) -> list[int]:
    rows = [0] * count
    if job.retry is not None:
        for row_id in pq.read_table(job.retry.samples, columns=["row_id"])["row_id"].to_pylist():
            rows[shard_of(row_id, count)] += 1
        return rows
    preparer = RowPreparer(job, tokenizer=None)
    for records in read_records(job.input):
        for row_id, n in preparer.samples(records):
            rows[shard_of(row_id, count) if count > 1 else 0] += n
    return rows


def shard_plan(out_dir: Path, job: Job, count: int, inputs: dict) -> list[int]:
    """expected_rows, from OUT_DIR/shard_plan.json when it was counted from these input files
    (`inputs`: io.fingerprint.input_identity's; remote inputs have none, and are not counted:
    nothing would tell whether a count still holds, and counting reads the whole dataset)."""
    path = out_dir / "shard_plan.json"
    if path.exists():
        cached = orjson.loads(path.read_bytes())
        if cached.get("inputs") == inputs and cached.get("count") == count:
            return cached["rows"]
    rows = expected_rows(job, count)
    with contextlib.suppress(Exception):  # a cache: a read-only OUT_DIR only costs the next count
        atomic_write_bytes(path, orjson.dumps({"count": count, "inputs": inputs, "rows": rows}))
    return rows


def settled_states(out_dir: Path, run: dict, done: list[int]) -> tuple[list[str], list[int | None], str | None]:
    """Each shard's state from what is committed (`done`: its rows) and recorded (`run`: run.json),
    the rows it holds once complete, and why those are unknown, if they are. A shard is complete
    by count (its committed rows reach what its inputs hold: none, for a shard whose inputs hold
    no row), or because its run got through these very inputs (duplicate ids make the counts
    disagree); a run's record of an end before the inputs changed is not. A Ray pipeline's shards
    with rows not marked finished are "ray"."""
    count = run["num_shards"]
    states = shard_states(out_dir, count)  # what each shard's runs recorded of reaching their end
    if run["job"]["input"]["paths"] == [RAY_INPUT]:  # its rows are known to the pipeline, not to a file
        states = ["complete" if s == "complete" else "ray" if d else "not started" for d, s in zip(done, states)]
        return states, [None] * count, "its rows come from a Ray Data pipeline (dflash_batch.ray)"
    try:  # each shard's rows once complete, counted from local inputs (cached in OUT_DIR)
        job = Job.model_validate(run["job"])
        inputs = input_identity(job, out_dir)
        if inputs is None:
            return states, [None] * count, None
        expected = shard_plan(out_dir, job, count, inputs)
    except Exception as e:  # noqa: BLE001 - inputs gone or moved, a job this version reads otherwise
        return states, [None] * count, str(e)
    states = ["complete" if d >= e or shard_finished(out_dir, i, inputs) else "incomplete" if s == "complete" else s
              for i, (d, e, s) in enumerate(zip(done, expected, states))]
    return states, expected, None
