"""The Python API: a job run over rows held in memory, its output rows yielded as they finish.

    import dflash_batch
    for row in dflash_batch.generate([{"id": "a", "prompt": "..."}], "jobs/x.yaml"):
        ...

The rows are first written to OUT_DIR/inputs/ (JSONL, or Parquet for an Arrow table) and the
job runs on that file as `dflash-batch run` would on it: the same row ids (the job's id_column,
else a hash of the file and the row's index), error rows, parts and resume (a second call with
the same rows and output directory yields only the rows not committed before).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_batch.job import Job, load_job, parse_job
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import EngineFactory, run_job

_DONE = object()


def generate(rows: Iterable[dict] | pa.Table, job: Job | str | Path | dict, *,
             engine_factory: EngineFactory | None = None, shard: Shard = Shard(0, 1),
             progress: bool = False) -> Iterator[dict]:
    """Run `job` (a Job, a job file, or a job document; its input.paths are replaced) over `rows`
    (dicts or an Arrow table) and yield each output row as it finishes. `engine_factory`: the
    engine to use (default: built from the job, as the CLI does)."""
    if not isinstance(job, Job):
        job = load_job(job) if isinstance(job, str | Path) else parse_job(job, base_dir=Path.cwd())
    openai = job.input.format == "openai_batch"  # request lines: JSONL, as the format reads them
    if openai and isinstance(rows, pa.Table):
        rows = rows.to_pylist()
    spool = Path(job.output.dir) / "inputs" / ("rows.parquet" if isinstance(rows, pa.Table) else "rows.jsonl")
    spool.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(rows, pa.Table):
        pq.write_table(rows, spool)
    else:
        with open(spool, "wb") as f:
            for row in rows:
                f.write(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    spooled = {"paths": [str(spool)], "format": "openai_batch" if openai else "auto"}
    job = job.model_copy(update={"input": job.input.model_copy(update=spooled)})
    if engine_factory is None:
        from dflash_batch.build import build_engine

        engine_factory = build_engine
    # The run goes on in a thread; rows come back through a bounded queue (a slow consumer
    # slows the run rather than piling rows up in memory).
    finished: queue.Queue[Any] = queue.Queue(maxsize=1024)

    def work() -> None:
        try:
            run_job(job, engine_factory, shard, progress=progress, on_row=finished.put)
            finished.put(_DONE)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            finished.put(e)

    thread = threading.Thread(target=work, name="dflash-batch-run", daemon=True)
    thread.start()
    while (item := finished.get()) is not _DONE:
        if isinstance(item, BaseException):
            raise item
        yield item
    thread.join()
