"""The dataset card an output directory carries, so that `datasets.load_dataset(OUT_DIR)` loads
its rows as they are: YAML front matter naming the committed parts as the train split (the
stats files and run.json are then not read as data), and what made the rows."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_batch.job import Job

DATA_FILES = "data/shard-*/part-*.parquet"  # committed parts only: temporaries are hidden files


def model_name(path: str) -> str:
    """A checkpoint named without where it lies (this machine's business, not the dataset's): a
    Hub cache snapshot (models--ORG--NAME/snapshots/REV) by ORG/NAME, else by its directory's
    name; with the architecture its config.json names, where it can be read, since a directory
    called `target` names no model."""
    where = Path(path)
    name = next((p.removeprefix("models--").replace("--", "/") for p in where.parts if p.startswith("models--")),
                where.name)
    try:
        config = json.loads((where / "config.json").read_text())
        named = config.get("architectures")
        architecture = named[0] if isinstance(named, list) and named else config.get("model_type")
    except (OSError, ValueError, AttributeError):  # gone from this machine, or not a config
        architecture = None
    return f"`{name}`" + (f" ({architecture})" if architecture else "")


def dataset_card(job: Job, data_files: str = DATA_FILES, summary: str = "") -> str:
    """The card; models are named by model_name, and sampling fields a row may set are said to
    vary by row."""
    s = job.sampling
    drafter = model_name(job.model.drafter) if job.model.drafter else "none (target-only decoding)"
    per_row = job.input.sampling_columns
    fields = ("temperature", "top_p", "top_k", "min_p", "max_new_tokens", "n", "seed")
    sampling = ", ".join(f"{f} {getattr(s, f)}" + (f" (per row: column `{per_row[f]}`)" if f in per_row else "")
                         for f in fields)
    return f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: {data_files}
tags:
- synthetic
- dflash-batch
---
# Generated with dflash-batch

One row per (input row, sample): `response`, `finish_reason`, `status` (error rows carry
`error_type` and `error`), speculative-decoding counters and the input's passthrough columns.

- target: {model_name(job.model.target)}
- drafter: {drafter}
- sampling (the job's; a row's column replaces it where set): {sampling}
{summary}"""
