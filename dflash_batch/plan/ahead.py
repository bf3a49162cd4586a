"""Rows prepared ahead of the engine: read, templated and tokenised in worker processes.

Preparing a chat row costs ~35 us of Python (JSON, the row checks, the jinja template, the
tokenizer); in the engine's process that would share one GIL with the engine loop and the output
writer, so `input.workers` processes do it instead. Batches are dealt round-robin (worker k prepares input
batches k, k + W, k + 2W, ...) and taken back in input order, so a run is the same whatever the
number of workers. `input.workers: 0` prepares in a thread of the main process instead.

Workers ignore SIGINT/SIGTERM (the runner decides when to stop and kills them); one whose runner
was killed dies on its next write.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Container, Iterator
from contextlib import contextmanager

from dflash_batch.io.inputs import read_records
from dflash_batch.job import Job
from dflash_batch.plan.rows import PreparedRow, RowPreparer
from dflash_batch.plan.shards import Shard
from dflash_batch.plan.tokenize import Tokenizer

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
                     vocab_size: int | None, part: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
    """This shard's rows still to do, one input batch at a time (part: see read_records)."""
    preparer = RowPreparer(job, tokenizer, vocab_size, shard, done)
    for records in read_records(job.input, part):
        yield preparer.prepare(records)


def prepare_ahead(job: Job, tokenizer: Tokenizer, shard: Shard, done: Container[tuple[str, int]],
                  vocab_size: int | None) -> Iterator[Batch]:
    """prepared_batches, computed ahead by `input.workers` processes. Close the iterator to stop
    the workers early."""
    workers = job.input.workers
    if workers == 0:
        yield from _in_thread(prepared_batches(job, tokenizer, shard, done, vocab_size))
        return
    # Plain interpreters rather than multiprocessing: nothing of the caller's __main__ is
    # re-imported, and a worker whose runner is gone dies on its next write (broken pipe).
    # They import from the runner's own sys.path, so they run this very dflash_batch.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    command = [sys.executable, "-c", "from dflash_batch.plan.ahead import serve; serve()"]
    procs: list[subprocess.Popen] = []
    try:
        for k in range(workers):
            procs.append(p := subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env))
            pickle.dump((job, shard, done, vocab_size, (k, workers)), p.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            p.stdin.close()
        k = 0
        while (item := _receive(procs[k], k)) != _DONE:
            yield item
            k = (k + 1) % workers
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


def _receive(proc: subprocess.Popen, k: int) -> Batch | str:
    try:
        item = pickle.load(proc.stdout)
    except EOFError:
        raise RuntimeError(f"row preparation worker {k} died (exit code {proc.wait()}) before finishing "
                           "its rows; its error is above") from None
    if isinstance(item, BaseException):
        raise item
    return item


def serve() -> None:
    """A worker's main: arguments from stdin, prepared batches (then _DONE, or the error) to stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print must not corrupt the stream
    job, shard, done, vocab_size, part = pickle.load(sys.stdin.buffer)
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        tokenizer = Tokenizer(job.model.tokenizer or job.model.target, job.model.chat_template)
        for batch in prepared_batches(job, tokenizer, shard, done, vocab_size, part):
            pickle.dump(batch, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
        pickle.dump(_DONE, out)
    except BrokenPipeError:  # the runner is gone
        os._exit(1)
    except BaseException as e:  # handed to the runner, which re-raises it
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
