"""The dataset card an output directory carries, so that `datasets.load_dataset(OUT_DIR)` loads
its rows as they are: YAML front matter naming the committed parts as the train split (the
stats files and run.json are then not read as data), and what made the rows."""

from __future__ import annotations

from dflash_batch.job import Job

DATA_FILES = "data/shard-*/part-*.parquet"  # committed parts only: temporaries are hidden files


def dataset_card(job: Job, data_files: str = DATA_FILES, summary: str = "") -> str:
    s = job.sampling
    drafter = job.model.drafter or "none (target-only decoding)"
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

- target: `{job.model.target}`
- drafter: `{drafter}`
- sampling: temperature {s.temperature}, top_p {s.top_p}, top_k {s.top_k}, min_p {s.min_p},
  max_new_tokens {s.max_new_tokens}, n {s.n}, seed {s.seed}
{summary}"""
