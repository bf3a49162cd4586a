"""dflash-batch as a stage of a Ray Data pipeline (`pip install 'dflash-batch[ray]'`):

    import ray
    import dflash_batch.ray
    from dflash_batch.ray import DFlashStage

    out = ray.data.read_parquet("prompts/").map_batches(
        DFlashStage, fn_constructor_kwargs={"job": "jobs/x.yaml", "output_dir": "out/x"},
        batch_size=256, batch_format="pyarrow", **dflash_batch.ray.resources())

Each actor of the pool builds one engine and takes batches of input rows (the columns the job's
input section names); it returns the output columns `dflash-batch run` writes, one row per
(input row, sample), error rows for bad rows (a bad row never fails the batch).

With an output directory, every batch's new rows are committed there as one Parquet part
before the batch returns, in the layout `dflash-batch run` writes (one shard), so report,
status and export read it. A row already committed, by an earlier run of the pipeline or by
an actor that died after committing and before returning (Ray then retries the batch on a
new actor), is read back instead of generated again, and a commit leaves out any row another
writer committed meanwhile: each (row_id, sample_index) is written once. Row ids come from
input.id_column, which such a stage needs (a row's position in a Ray batch does not survive a
restart). Without an output directory rows only flow on. `resources()` gives map_batches the
actors the cluster can hold; once every batch came back, `finish(output_dir)` marks the output
finished for status, export and retry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_batch.api import as_job
from dflash_batch.engine.request import Engine
from dflash_batch.io.inputs import Record
from dflash_batch.io.ledger import (RAY_IDENTITY, RAY_INPUT, key_hash, lock_run, part_files, shard_dir, shard_lock,
                                   write_shard_stats)
from dflash_batch.io.outputs import PartWriter, part_metadata, rows_to_table
from dflash_batch.job import Job, JobError, check_model_paths
from dflash_batch.keys import Shard
from dflash_batch.output_rows import RowDecoder
from dflash_batch.plan.rows import RowPreparer
from dflash_batch.runner import EngineFactory, check_passthrough, open_tokenizer

SHARD = Shard(0, 1)  # a Ray stage's run is one shard: its rows are dealt out by Ray, not by a hash


class DFlashStage:
    """A callable class for `Dataset.map_batches`: one engine per actor. `job`: a job file, a
    job document or a Job (its input.paths may be left out: Ray gives the rows); `output_dir`:
    where rows are committed (it replaces output.dir; None: rows only flow on); `threads`: torch
    threads on a CPU (default: as Ray set OMP_NUM_THREADS, the actor's CPUs); `engine_factory`:
    as runner.py's (default: built from the job, as `dflash-batch run` does)."""

    def __init__(self, job: Job | str | Path | dict, output_dir: str | Path | None = None,
                 threads: int | None = None, engine_factory: EngineFactory | None = None):
        import torch

        job = as_job(job)
        self.out_dir = None if output_dir is None else Path(output_dir)
        update = {"input": job.input.model_copy(update={"paths": [RAY_INPUT]})}
        if self.out_dir is not None:
            update["output"] = job.output.model_copy(update={"dir": str(self.out_dir)})
        self.job = job = job.model_copy(update=update)
        check_model_paths(job.model)
        check_passthrough(job)
        if job.retry is not None:
            raise JobError("retry: a retry run reads its parent's input files again; run it with `dflash-batch run`")
        if job.model.ranks > 1:
            field = next(f for f in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
                         if getattr(job.model, f) > 1)
            raise JobError(f"model.{field} > 1 is not supported in a Ray stage yet: one actor holds one rank; "
                           "run such a model with `dflash-batch run` (torchrun or srun)")
        if self.out_dir is not None and job.input.id_column is None and job.input.format != "openai_batch":
            raise JobError("input.id_column: a Ray stage that commits to an output directory needs row ids "
                           "that survive a restart (a row's place in a Ray batch does not); name the column "
                           "that holds them, or give no output_dir to let rows only flow on")
        if threads:
            torch.set_num_threads(threads)
        self.tokenizer, delimiters = open_tokenizer(job)
        if engine_factory is None:
            from dflash_batch.build import build_engine

            engine_factory = build_engine
        self.engine: Engine = engine_factory(job, self.tokenizer)
        config_hash = "-"
        if self.out_dir is not None:
            config_hash = lock_run(self.out_dir, job, SHARD, inputs=RAY_IDENTITY)
        self.metadata = part_metadata(job, config_hash)
        self.committed: set[int] = set()  # key hashes of the committed (row_id, sample_index)
        self.parts_of: dict[str, set[Path]] = {}  # row id -> the parts holding its committed samples
        self.read_parts: set[Path] = set()
        self.done = _Committed(self.committed)
        self.preparer = RowPreparer(job, self.tokenizer, getattr(self.engine, "vocab_size", None), SHARD, self.done)
        self.new_rows: list[dict] = []
        self.rows = RowDecoder(job, SHARD, self.tokenizer, self.engine, config_hash, delimiters, self.done,
                               self.new_rows.extend)

    def __call__(self, batch: pa.Table | dict) -> pa.Table:
        table = batch if isinstance(batch, pa.Table) else pa.table(batch)
        records = table.to_pylist()
        # Without ids, a row's id derives from the batch's content and its place in it.
        source = "ray-" + hashlib.blake2b(orjson.dumps(records, default=str), digest_size=8).hexdigest()
        records = [Record(source, i, data) for i, data in enumerate(records)]
        self._learn_committed()
        ids = {self.preparer.row_id(rec, rec.data)[0] for rec in records}
        self.new_rows.clear()
        self.rows.run_window(self.preparer.prepare(records))
        new, written = self.new_rows, None
        if self.out_dir is not None:
            new, written = self.commit(self.new_rows)
        tables = [rows_to_table(new, self.job.input.passthrough_columns, self.rows.optional, self.metadata)]
        tables += self._read_committed(ids, written)
        return pa.concat_tables(tables, promote_options="permissive").replace_schema_metadata(None)

    def commit(self, rows: list[dict]) -> tuple[list[dict], Path | None]:
        """Write the rows no writer has committed yet as one part, holding the shard's lock; the
        rows written and their part."""
        if not rows:
            return [], None
        path = None
        with shard_lock(self.out_dir, SHARD.index, wait=True):
            self._learn_committed()
            rows = [r for r in rows if key_hash(r["row_id"], r["sample_index"]) not in self.committed]
            if rows:  # numbered after the parts any writer committed, under the lock
                writer = PartWriter(shard_dir(self.out_dir, SHARD.index), passthrough=self.job.input.passthrough_columns,
                                    optional=self.rows.optional, metadata=self.metadata, rows_per_part=len(rows),
                                    flush_seconds=float("inf"), compression=self.job.output.compression)
                path = writer.write_part(rows)
                self._learned(path, [(r["row_id"], r["sample_index"]) for r in rows])
        return rows, path

    def _learn_committed(self) -> None:
        """Index the keys of the parts written since the last look (by any writer)."""
        for path in part_files(self.out_dir, SHARD.index) if self.out_dir is not None else []:
            if path not in self.read_parts:
                t = pq.read_table(path, columns=["row_id", "sample_index"])
                self._learned(path, zip(t["row_id"].to_pylist(), t["sample_index"].to_pylist()))

    def _learned(self, path: Path, keys: Iterable[tuple[str, int]]) -> None:
        """The part at `path` holds these (row_id, sample_index)."""
        for r, s in keys:
            self.committed.add(key_hash(r, s))
            self.parts_of.setdefault(r, set()).add(path)
        self.read_parts.add(path)

    def _read_committed(self, ids: set[str], written: Path | None) -> list[pa.Table]:
        """The committed rows of these row ids but those this batch wrote (in `written`)."""
        parts = sorted({p for i in ids for p in self.parts_of.get(i, ())} - {written})
        wanted = pa.array(sorted(ids), pa.string())
        tables = [pq.read_table(p) for p in parts]
        return [t.filter(pc.is_in(t["row_id"], value_set=wanted)) for t in tables]


def resources(threads: int = 1) -> dict:
    """map_batches' actor count and each actor's resources, for the cluster Ray is connected to
    (started here if it is not): an actor a GPU on a cluster with GPUs; else `threads` CPUs an
    actor and as many actors as leave a CPU free. Actors holding every CPU would leave none to
    the tasks that read the input, and the pipeline would wait forever."""
    import ray

    if not ray.is_initialized():
        ray.init()
    cluster = ray.cluster_resources()
    if gpus := int(cluster.get("GPU", 0)):
        return {"num_gpus": 1, "concurrency": gpus}
    return {"num_cpus": threads, "concurrency": max(1, (int(cluster.get("CPU", 1)) - 1) // threads)}


def finish(output_dir: str | Path) -> None:
    """Mark a pipeline's output finished, once every batch came back (the dataset written,
    materialized or iterated to its end): `status` then says complete, and export and retry
    take it as a whole run. Rows committed after it (another pipeline into the same directory)
    unmark it."""
    out = Path(output_dir)
    if not (out / "run.json").exists():
        raise JobError(f"{out}: no run.json; no stage committed to it")
    with shard_lock(out, SHARD.index, wait=True):  # no stage's commit in between
        write_shard_stats(out, SHARD.index, complete=True, inputs=RAY_IDENTITY)


class _Committed:
    """(row_id, sample_index) in it: committed (RowPreparer and RowDecoder skip such keys)."""

    def __init__(self, committed: set[int]):
        self.committed = committed

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key_hash(*key) in self.committed
