"""The Python API: a job run over rows held in memory, its output rows yielded as they finish.

    import dflash_batch
    for row in dflash_batch.generate([{"id": "a", "prompt": "..."}], "jobs/x.yaml"):
        ...

The rows are first written to OUT_DIR/inputs/ (JSONL, or Parquet for an Arrow table) and the
job runs on that file as `dflash-batch run` would on it: the same row ids (the job's id_column,
else a hash of the file and the row's index), error rows, parts and resume. A second call with
the same rows and output directory resumes: it yields the rows committed before (read back from
the parts), then the others as they finish, so the caller gets every row of the run; other rows
are refused (the run's input changed). Closing the generator (a `break` out of the caller's loop)
stops the run at the next row that finishes, with every finished row committed. One call at a
time runs on an output directory: the shard's OS lock keeps other processes out, not this one.
"""

from __future__ import annotations

import filecmp
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_batch.engine.request import Engine
from dflash_batch.io.ledger import part_files
from dflash_batch.job import Job, JobError, parse_job, read_job_file
from dflash_batch.plan.shards import Shard
from dflash_batch.tokenizer import Tokenizer
from dflash_batch.runner import EngineFactory, Preempted, run_job

_DONE = object()
_ROWS = "<the rows given to generate>"  # input.paths of a job that names none (generate replaces them)
_running: set[Path] = set()  # output directories a generate call of this process is running
_running_lock = threading.Lock()


def as_job(job: Job | str | Path | dict) -> Job:
    """The job; a job file or document may leave input.paths out."""
    if isinstance(job, Job):
        return job
    if isinstance(job, str | Path):
        doc, source, base = read_job_file(Path(job)), str(job), Path(job).resolve().parent
    else:
        doc, source, base = job, "<job>", Path.cwd()
    if isinstance(doc, dict) and isinstance(doc.get("input"), dict) and "paths" not in doc["input"]:
        doc = {**doc, "input": {**doc["input"], "paths": [_ROWS]}}
    return parse_job(doc, source, base)


def _spool(rows: Iterable[dict] | pa.Table, job: Job) -> Job:
    """Write the rows under OUT_DIR/inputs/; the job, reading them."""
    openai = job.input.format == "openai_batch"  # request lines: JSONL, as the format reads them
    if openai and isinstance(rows, pa.Table):
        rows = rows.to_pylist()
    spool = Path(job.output.dir) / "inputs" / ("rows.parquet" if isinstance(rows, pa.Table) else "rows.jsonl")
    spool.parent.mkdir(parents=True, exist_ok=True)
    new = spool.with_name(f".{spool.name}.tmp")
    if isinstance(rows, pa.Table):
        pq.write_table(rows, new)
    else:
        with open(new, "wb") as f:
            for row in rows:
                f.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    filecmp.clear_cache()  # its cache keys on mtime, which a quick rewrite may keep
    if spool.is_file() and filecmp.cmp(new, spool, shallow=False):
        new.unlink()  # the same rows: the file keeps its mtime, so a finished run is known as one
    else:
        os.replace(new, spool)
    spooled = {"paths": [str(spool)], "format": "openai_batch" if openai else "auto"}
    return job.model_copy(update={"input": job.input.model_copy(update=spooled)})


def _committed(out_dir: Path, index: int) -> Iterator[dict]:
    """The rows a shard committed, part by part, as its parts hold them."""
    for f in part_files(out_dir, index):
        yield from pq.read_table(f).to_pylist()


def generate(rows: Iterable[dict] | pa.Table, job: Job | str | Path | dict, *,
             engine_factory: EngineFactory | None = None, shard: Shard = Shard(0, 1),
             progress: bool = False) -> Iterator[dict]:
    """Run `job` (a Job, a job file, or a job document; its input.paths, which may be left out,
    are replaced) over `rows` (dicts or an Arrow table) and yield every output row of the run:
    those committed by an earlier call first, then each new one as it finishes. `engine_factory`:
    the engine to use (default: built from the job, as the CLI does)."""
    job = as_job(job)
    if engine_factory is None:
        _check_ranks(job)
    out_dir = Path(job.output.dir).resolve()
    with _running_lock:
        if out_dir in _running:
            raise JobError(f"{out_dir}: another generate call of this process is running on this output "
                           "directory; finish it, or close it (break out of its loop, or gen.close()), first")
        _running.add(out_dir)
    try:
        if engine_factory is None:
            from dflash_batch.build import build_engine

            engine_factory = build_engine
        yield from _run(_spool(rows, job), engine_factory, shard, progress)
    finally:
        with _running_lock:
            _running.discard(out_dir)


def _check_ranks(job: Job) -> None:
    """generate builds the engine in this process: a job of several ranks needs them all calling it
    in one process group (torchrun; tensor parallelism only), or `dflash-batch run`."""
    from dflash_batch import parallel

    m = job.model
    for field in ("pipeline_parallel_size", "data_parallel_size"):
        if getattr(m, field) > 1:
            raise JobError(f"model.{field} {getattr(m, field)}: generate runs one tensor-parallel group; run the "
                           "job with `dflash-batch run`")
    if m.tensor_parallel_size != parallel.run_size():
        raise JobError(f"model.tensor_parallel_size {m.tensor_parallel_size}, but this process is one of "
                       f"{parallel.run_size()} ranks: call generate on every rank of a group of that size "
                       "(torchrun), or run the job with `dflash-batch run`")


def _run(job: Job, engine_factory: EngineFactory, shard: Shard, progress: bool) -> Iterator[dict]:
    # The run goes on in a thread; rows come back through a bounded queue (a slow consumer
    # slows the run rather than piling rows up in memory).
    finished: queue.Queue[Any] = queue.Queue(maxsize=1024)
    closed = threading.Event()
    out_dir = Path(job.output.dir)

    def on_row(row: dict) -> None:
        if closed.is_set():  # the caller stopped reading: the run stops, committing what finished
            raise Preempted()
        finished.put(row)

    def committed_first(job: Job, tokenizer: Tokenizer) -> Engine:
        # run_job builds the engine holding the shard's lock: no other process can commit a row
        # between this read and the run's own list of the rows it skips.
        for row in _committed(out_dir, shard.index):
            on_row(row)
        return engine_factory(job, tokenizer)

    def work() -> None:
        try:
            result = run_job(job, committed_first, shard, progress=progress, on_row=on_row)
            if result.already_complete:
                for row in _committed(out_dir, shard.index):  # finished before: no engine was built
                    on_row(row)
            elif result.progress is not None and result.progress.too_many_errors(job.output.max_error_fraction):
                # as `run` exits 3: every row was yielded and committed, then the run says it failed
                finished.put(JobError(f"{out_dir}: more error rows than output.max_error_fraction "
                                      f"({job.output.max_error_fraction}), by error_type:\n"
                                      + "\n".join(result.progress.error_summary())))
                return
            finished.put(_DONE)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            finished.put(e)

    thread = threading.Thread(target=work, name="dflash-batch-run", daemon=True)
    thread.start()
    try:
        while (item := finished.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        closed.set()
        _drain(finished, thread)


def _drain(finished: queue.Queue, thread: threading.Thread) -> None:
    """Wait for the run's thread to end, emptying the queue so that a row it is putting goes in
    (its next one raises Preempted); a failure other than that stop is raised."""
    failure = None
    while thread.is_alive() or not finished.empty():
        try:
            item = finished.get(timeout=0.05)
        except queue.Empty:
            continue
        if isinstance(item, BaseException) and not isinstance(item, Preempted):
            failure = item
    if failure is not None:
        raise failure
