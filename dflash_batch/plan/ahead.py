"""Rows prepared ahead of the engine: read, templated and tokenised in worker processes.

Preparing a chat row costs ~35 us of Python (JSON, the row checks, the jinja template, the
tokenizer); in the engine's process that would share one GIL with the engine loop and the output
writer, so `input.workers` processes do it instead. Batches are dealt round-robin (worker k
prepares input batches k, k + W, k + 2W, ...) and taken back in input order, so a run is the same
whatever the number of workers. `input.workers: 0` prepares in a thread of the main process.

Workers ignore SIGINT/SIGTERM (the runner decides when to stop and kills them); one whose runner
was killed dies on its next write. Each is at most one batch and a pipe's buffer ahead.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import subprocess
import sys
import threading
import traceback
from collections.abc import Container, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from dflash_batch.io.inputs import expand_paths, read_records
from dflash_batch.job import Job, JobError
from dflash_batch.plan.rows import PreparedRow, RowPreparer
from dflash_batch.plan.shards import Shard
from dflash_batch.tokenizer import Tokenizer

Batch = list[PreparedRow]
_DONE = "done"

# The data path makes and frees millions of short-lived, acyclic objects (records, rows,
# requests, output rows). At Python's default thresholds (a young collection every 700
# allocations) the collector's passes over them cost as much as the data path itself (2x the
# main process's CPU a row, measured); collections every 100k allocations cost little.
GC_THRESHOLDS = (100_000, 50, 100)


@contextmanager
def fewer_gc_passes() -> Iterator[None]:
    old = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def prepared_batches(job: Job, tokenizer: Tokenizer, shard: Shard, done: Container[tuple[str, int]],
                     vocab_size: int | None, part: tuple[int, int] = (0, 1),
                     files: list[tuple[Path, str]] | None = None) -> Iterator[Batch]:
    """This shard's rows still to do, one input batch at a time (part, files: see read_records)."""
    preparer = RowPreparer(job, tokenizer, vocab_size, shard, done)
    for records in read_records(job.input, part, files):
        yield preparer.prepare(records)


# A worker's first statements: ignore the signals meant for the runner (Slurm signals every
# process of a job; the runner decides when to stop and kills its workers), keep stdout for the
# stream (a stray print goes to stderr), and import from the runner's own sys.path (given as
# arguments), so that a worker runs this very dflash_batch whatever its working directory holds.
_BOOTSTRAP = """import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
sys.path[:] = sys.argv[1:]
from dflash_batch.plan.ahead import serve
serve(out)
"""


def prepare_ahead(job: Job, tokenizer: Tokenizer, shard: Shard, done: Container[tuple[str, int]],
                  vocab_size: int | None) -> Iterator[Batch]:
    """prepared_batches, computed ahead by `input.workers` processes. Close the iterator to stop
    the workers early."""
    workers = job.input.workers
    files = expand_paths(job.input.paths, job.input.format)  # once: every worker reads the same files
    if workers == 0:
        yield from _in_thread(prepared_batches(job, tokenizer, shard, done, vocab_size, files=files))
        return
    # Plain interpreters rather than multiprocessing: nothing of the caller's __main__ is
    # re-imported, and a worker whose runner is gone dies on its next write (broken pipe).
    command = [sys.executable, "-c", _BOOTSTRAP, *sys.path]
    procs: list[subprocess.Popen] = []
    try:
        for k in range(workers):
            procs.append(p := subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
            pickle.dump((job, shard, done, vocab_size, (k, workers), files), p.stdin,
                        protocol=pickle.HIGHEST_PROTOCOL)
            p.stdin.close()
        k = 0
        while (item := _receive(procs[k], k)) != _DONE:
            yield item
            k = (k + 1) % workers
        # Every other worker must be done too: batches are dealt by number, so one with more
        # would mean the workers saw different inputs.
        if any(_receive(procs[j], j) != _DONE for j in range(workers) if j != k):
            raise RuntimeError("the input files changed while they were read; rerun to resume")
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


def _receive(proc: subprocess.Popen, k: int) -> Batch | str:
    try:
        item = pickle.load(proc.stdout)
    except (EOFError, pickle.UnpicklingError):  # no more, or a batch cut short
        raise RuntimeError(f"row preparation worker {k} died (exit code {proc.wait()}) before finishing "
                           "its rows; its error is above") from None
    if isinstance(item, BaseException):
        raise item
    return item


def serve(out: BinaryIO) -> None:
    """A worker's main: arguments from stdin, prepared batches (then _DONE, or the error) to `out`."""
    job, shard, done, vocab_size, part, files = pickle.load(sys.stdin.buffer)
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        tokenizer = Tokenizer(job.model.tokenizer or job.model.target, job.model.chat_template)
        for batch in prepared_batches(job, tokenizer, shard, done, vocab_size, part, files):
            pickle.dump(batch, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
        pickle.dump(_DONE, out)
    except BrokenPipeError:  # the runner is gone
        os._exit(1)
    except BaseException as e:  # handed to the runner, which re-raises it
        if not isinstance(e, JobError):  # a bug, not bad input: keep the worker's traceback
            traceback.print_exc()
        pickle.dump(_picklable(e), out)
    out.close()


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"row preparation failed:\n{''.join(traceback.format_exception(e))}")


def _in_thread(items: Iterator[Batch], depth: int = 2) -> Iterator[Batch]:
    """Iterate `items` in a background thread, `depth` items ahead; its errors re-raise here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()  # set when the consumer goes away, so the thread does not block

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(_DONE)
        except BaseException as e:  # handed to the consumer, which re-raises it
            q.put(e)

    threading.Thread(target=produce, daemon=True, name="dflash-prepare").start()
    try:
        while (item := q.get()) != _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
