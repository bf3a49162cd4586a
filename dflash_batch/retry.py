"""`dflash-batch retry OUT_DIR --where ... --set ... --output-dir NEW`: a new run of chosen samples
of a finished run, with changed settings.

The retry is a job file of its own (NEW/job.yaml: the parent's job, the changes, and a `retry`
section naming the parent, its config hash and NEW/retry_samples.parquet, the chosen keys). It
runs like any job (`dflash-batch run NEW/job.yaml`, Slurm arrays included): it reads the
parent's inputs again, so row ids and prompts are the parent's, and generates only the chosen
(row_id, sample_index) keys, each with the seed it had. `export NEW` merges the parent's rows
with the retry's, the retry's winning unless it is an error where the parent's was not. A retry
of a retry chooses from the merged rows of its parents.
"""

from __future__ import annotations

from functools import reduce
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from dflash_batch.io.export import lineage, merged_rows
from dflash_batch.io.ledger import unfinished_shards
from dflash_batch.job import JobError, parse_job

# What decides the rows, their keys and their seeds: a retry must read the parent's rows as the
# parent did, and generate the chosen samples under their own seeds.
FIXED = ("input.paths", "input.format", "input.id_column", "input.prompt_column", "input.messages_column",
         "input.input_ids_column", "input.sampling_columns", "sampling.n", "sampling.seed", "output.dir", "retry")
PATHS = ("model.target", "model.drafter", "model.tokenizer", "model.chat_template")
SAMPLES_FILE, JOB_FILE = "retry_samples.parquet", "job.yaml"


def _chosen(table: pa.Table, where: list[str]) -> pa.Array:
    masks = []
    for w in where:
        if w == "error":
            masks.append(pc.equal(table["status"], "error"))
        elif w == "length":
            masks.append(pc.equal(table["finish_reason"], "length"))
        else:
            masks.append(pc.equal(table["error_type"], w.removeprefix("error_type=")))
    return pc.fill_null(reduce(pc.or_, masks), False)


def _set(doc: dict, field: str, text: str) -> Any:
    """Set a dotted field of the job document to a YAML value; returns the value."""
    if "." not in field:
        raise JobError(f"--set {field}: set one field of a section (e.g. sampling.max_new_tokens), not a section")
    if any(field == f or field.startswith(f"{f}.") or f.startswith(f"{field}.") for f in FIXED):
        raise JobError(f"--set {field}: a retry reads the parent's rows and samples as the parent did; {field} "
                       "cannot change (start a new run for other inputs or samples; --output-dir names the "
                       "retry's directory)")
    value = yaml.safe_load(text)
    if field in PATHS and isinstance(value, str) and "://" not in value:
        value = str(Path(value).expanduser().resolve())  # relative to where retry runs, as a user means it
    *path, last = field.split(".")
    node: Any = doc
    for i, key in enumerate(path):
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if not isinstance(node, dict | list):
            raise JobError(f"--set {field}: {'.'.join(path[:i + 1])} is not a section")
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return value


def make_retry(parent: Path, where: list[str], sets: list[str], new_dir: Path) -> tuple[int, int]:
    """Write NEW/job.yaml and NEW/retry_samples.parquet; returns (samples, rows) chosen. Nothing
    is written when nothing matches."""
    for w in where:
        if w not in ("error", "length") and not w.startswith("error_type="):
            raise JobError(f"--where {w!r}: expected error, length or error_type=NAME")
    run_file = parent / "run.json"
    if not run_file.exists():
        raise JobError(f"{parent}: no run.json; not a dflash-batch output directory")
    record = orjson.loads(run_file.read_bytes())
    todo = unfinished_shards(parent, record["num_shards"])
    if todo:
        raise JobError(f"{parent}: shard(s) {todo} have not finished (dflash-batch status {parent} says how to "
                       "finish them); retry a finished run")
    if (new_dir / "run.json").exists() or (new_dir / JOB_FILE).exists():
        raise JobError(f"{new_dir} already holds a run: give the retry a new --output-dir")
    doc = record["job"]
    changes = {}
    for item in sets:
        field, eq, text = item.partition("=")
        if not eq:
            raise JobError(f"--set {item!r}: expected FIELD=VALUE, e.g. sampling.max_new_tokens=4096")
        changes[field] = _set(doc, field, text)
    new_dir = new_dir.resolve()
    doc["output"]["dir"] = str(new_dir)
    doc["retry"] = {"parent": str(parent.resolve()), "parent_hash": record["config_hash"],
                    "samples": str(new_dir / SAMPLES_FILE), "where": list(where), "changes": changes}
    parse_job(doc, "the retry's job (--set)")  # refuses a bad value, naming the field
    keys = []  # from the parent's rows as export gives them: a retry of a retry sees its parents'
    columns = ["row_id", "sample_index", "status", "finish_reason", "error_type"]
    for t in merged_rows(lineage(parent), grouped=False, columns=columns):
        keys.append(t.filter(_chosen(t, list(where))).select(["row_id", "sample_index"]))
    chosen = pa.concat_tables(keys) if keys else pa.table({"row_id": pa.array([], pa.string()),
                                                           "sample_index": pa.array([], pa.int32())})
    if not chosen.num_rows:
        return 0, 0
    new_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(chosen, new_dir / SAMPLES_FILE)
    (new_dir / JOB_FILE).write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return chosen.num_rows, len(pc.unique(chosen["row_id"]))
