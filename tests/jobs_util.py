"""Helpers for writing small job files and reading their outputs in tests."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow.parquet as pq
import yaml

from dflash_batch.io.ledger import part_files
from dflash_batch.job import load_job


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows))
    return path


def write_job(d: Path, doc: dict, name: str = "job.yaml"):
    (d / name).write_text(yaml.safe_dump(doc))
    return load_job(d / name)


def base_job(model_dir: Path, inputs: list[str], **sections) -> dict:
    doc = {"input": {"paths": inputs, "prompt_column": "prompt", "id_column": "id"},
           "model": {"target": str(model_dir), "dtype": "float32"},
           "engine": {"max_model_len": 256, "max_num_seqs": 4},
           "sampling": {"max_new_tokens": 16},
           "output": {"dir": "out", "rows_per_part": 5}}
    for k, v in sections.items():
        doc[k] = {**doc.get(k, {}), **v} if isinstance(v, dict) else v
    return doc


def read_out(out_dir: Path) -> list[dict]:
    rows = []
    for f in part_files(Path(out_dir)):
        rows += pq.read_table(f).to_pylist()
    return rows
