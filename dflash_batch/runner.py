"""One job, one shard, from input files to committed Parquet parts.

    records (io.inputs) -> this shard's rows, minus those already committed (plan.shards, io.ledger)
    -> tokens + bucket (plan.rows), both in worker processes (plan.ahead)
    -> engine, bucket by bucket (engine.request.Engine)
    -> output rows -> Parquet parts (io.outputs) -> shard stats (io.ledger)

Input is processed in windows of `input.window_rows` rows so memory stays flat in the input size;
inside a window every bucket is drained in turn so each batch holds similar lengths.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_batch import parallel
from dflash_batch.conversation import check_conversations
from dflash_batch.engine.request import Engine
from dflash_batch.grammar import Grammars, asks_for_grammar
from dflash_batch.io.fingerprint import input_identity
from dflash_batch.io.inputs import check_inputs
from dflash_batch.io.ledger import (check_run, keys_to_skip, lock_run, shard_dir, shard_finished, shard_lock,
                                   write_shard_stats)
from dflash_batch.io.outputs import RESERVED, PartWriter, check_writable, output_record, part_metadata
from dflash_batch.io.progress import Progress, progress_path, slurm_of
from dflash_batch.io.turn_journal import TurnJournal
from dflash_batch.job import Job, JobError, check_model_paths
from dflash_batch.models.layers.expert_parallel import routing_stats
from dflash_batch.output_rows import RowDecoder
from dflash_batch.plan.ahead import fewer_gc_passes, prepare_ahead
from dflash_batch.plan.rows import PreparedRow
from dflash_batch.plan.shards import Shard
from dflash_batch.tokenizer import Tokenizer
from dflash_batch.reasoning import Delimiters, find_delimiters

EngineFactory = Callable[[Job, Tokenizer], Engine]
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # preemption, Ctrl-C: both commit finished rows and stop


class Preempted(BaseException):
    """SIGTERM or SIGINT (`signum`) arrived: finished rows were committed, the rest is left for the
    resumed run. A BaseException, as KeyboardInterrupt is: raised from the signal handler anywhere
    in the engine, it must pass every `except Exception` that isolates a failing request."""

    def __init__(self, signum: int = signal.SIGTERM, together: bool = False):
        super().__init__(signum)
        self.signum = signum
        self.together = together  # every tensor-parallel rank stopped at this row: they wait for rank 0's commit


@dataclass
class RunResult:
    shard: Shard
    rows_written: int
    stats: dict[str, dict]
    already_complete: bool = False  # finished before, for these inputs: nothing was loaded
    progress: Progress | None = None  # this run's rows and error rows (None: nothing was run)


class _Run:
    def __init__(self, job: Job, shard: Shard, tokenizer: Tokenizer, engine: Engine, config_hash: str,
                 progress: bool, delimiters: Delimiters | None = None, on_row: Callable[[dict], None] | None = None,
                 *, tally: Progress):
        self.job, self.shard, self.engine = job, shard, engine
        self.tally = tally  # this run's rows, error rows and progress file
        self.on_row = on_row
        out_dir = Path(job.output.dir)
        self.rows = RowDecoder(job, shard, tokenizer, engine, config_hash, delimiters,
                               keys_to_skip(out_dir, shard.index, job), self._commit,
                               progress=progress and parallel.run_rank() == 0,
                               journal=TurnJournal(shard_dir(out_dir, shard.index), parallel.run_rank() == 0))
        self.writer = None if parallel.run_rank() else PartWriter(
            shard_dir(out_dir, shard.index), passthrough=job.input.passthrough_columns,
            optional=self.rows.optional, rows_per_part=job.output.rows_per_part,
            flush_seconds=job.output.flush_seconds, compression=job.output.compression,
            metadata=part_metadata(job, config_hash))
        self.stop = threading.Event()
        self.running = self.committing = False  # where on_signal may stop the run at once
        self.signum = signal.SIGTERM  # the first stop signal's (the exit code says which)
        # Several ranks agree on stopping, at a committed row; data-parallel groups stop there too (never
        # inside a forward whose dispatch the other groups wait on).
        self.ranks_agree = parallel.run_size() > 1 or parallel.data_parallel()[1] > 1

    def _commit(self, rows: list[dict]) -> None:
        self.committing = True  # a SIGTERM now only sets stop: the check below acts on it
        if self.writer is not None:  # tensor-parallel ranks other than 0 decode but do not write
            self.writer.add(rows)
            if self.on_row is not None:
                for row in rows:
                    self.on_row(output_record(row, self.job.input.passthrough_columns, self.rows.optional))
        for row in rows:
            self.tally.row(row, self.committed())
        self.committing = False
        # Every rank commits the same rows in the same order; they agree on stopping here.
        stop = parallel.any_rank(self.stop.is_set()) if self.ranks_agree else self.stop.is_set()
        if stop:
            self._stop(together=self.ranks_agree)

    def committed(self) -> int:
        return self.writer.committed_rows if self.writer is not None else 0

    def _stop(self, together: bool = False) -> None:
        self.running = False  # first: a second signal must not cut the flush on the way out
        raise Preempted(self.signum, together)

    def on_signal(self, signum: int, _frame: object = None) -> None:
        """SIGTERM or SIGINT: stop. On one rank, at once: the rows finished so far are committed
        on the way out (run), however long the round or the row in progress would take.
        Tensor-parallel ranks stop at the next committed row instead, all at the same one (their
        collectives match), and so does each data-parallel group (between forwards)."""
        if not self.stop.is_set():
            self.signum = signum
        self.stop.set()
        if self.running and not self.committing and not self.ranks_agree:
            self._stop()

    # -- the loop ------------------------------------------------------------------------------
    def _preemptible(self, batches: Iterator[list[PreparedRow]]) -> Iterator[list[PreparedRow]]:
        try:
            yield from batches
        except (RuntimeError, OSError):
            if not self.stop.is_set():
                raise
            # A worker killed by the job's SIGTERM before it could ignore it: still a preemption.
            self.running = False
            raise Preempted(self.signum) from None

    def run(self) -> int:
        window: list[PreparedRow] = []
        # Rows are prepared ahead in other processes while the engine decodes this window.
        batches = prepare_ahead(self.job, self.rows.tok, self.shard, self.rows.done,
                                getattr(self.engine, "vocab_size", None))
        self.running = True
        self.tally.start()
        try:
            if self.stop.is_set():  # a signal while the model loaded
                self._stop()
            try:
                for rows in self._preemptible(batches):
                    window += rows
                    if len(window) >= self.job.input.window_rows:
                        self.rows.run_window(window)
                        window = []
            finally:
                batches.close()
            self.rows.run_window(window)
        except Preempted:
            self.running = False
            if self.writer is not None:  # every finished row, now
                self.writer.flush()
            self._serve_other_groups()
            raise
        finally:
            self.running = False
            self.rows.close()
        if self.writer is not None:
            self.writer.flush()
        self._serve_other_groups()
        return self.committed()

    def _serve_other_groups(self) -> None:
        """Under expert parallelism this group's experts serve every data-parallel group: once its
        own rows are committed it runs the others' forwards with none of its own until all are done."""
        if self.job.model.expert_parallel:
            self.engine.target.serve_experts()


def check_job(job: Job) -> None:
    """What fails the whole job, checked before any tokenizer or checkpoint is read: the model
    paths first (a typo named by its field), then the output directory and columns, the input
    files and their columns."""
    check_model_paths(job.model)
    check_writable(Path(job.output.dir))
    check_passthrough(job)
    check_inputs(job.input)


def check_passthrough(job: Job) -> None:
    """No input column the job passes through may take an output column's name."""
    for col in job.input.passthrough_columns:
        if col in RESERVED:
            raise JobError(f"input.passthrough_columns: {col!r} collides with an output column")


def open_tokenizer(job: Job) -> tuple[Tokenizer, Delimiters | None]:
    """The job's tokenizer, and its think delimiters when the job splits reasoning; refuses a
    tokenizer that cannot serve the job."""
    where = job.model.tokenizer or job.model.target
    tokenizer = Tokenizer(where, job.model.chat_template)
    if job.input.messages_column and tokenizer.chat_template is None:
        raise JobError(f"input.messages_column: the tokenizer of {where} has no chat template; set "
                       "model.chat_template, or give raw text with input.prompt_column")
    if asks_for_grammar(job):  # xgrammar present, and the job's own grammar compiles
        try:
            eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
            Grammars(tokenizer, tokenizer.vocab_size, eos).compile(job.sampling)
        except ValueError as e:
            raise JobError(str(e)) from None
    check_conversations(job, tokenizer)
    split = job.output.split_reasoning
    return tokenizer, find_delimiters(tokenizer, job.output.reasoning_delimiters, where) if split else None


def schedules(engine: object) -> dict[str, dict]:
    """The speculation schedules an engine kept, by bucket (engines without them: none)."""
    return {name: s.stats() for name, s in getattr(engine, "schedules", {}).items()}


def expert_stats(job: Job, engine: object) -> dict | None:
    """A MoE target's routing this run (routed tokens per layer and expert, the ranks' loads:
    expert_parallel.routing_stats) and the forwards this group served for the others with no rows
    of its own; None for a dense target."""
    target = getattr(engine, "target", None)
    layers = getattr(target, "moe_layers", dict)()
    if not layers:
        return None
    m = job.model
    stats = routing_stats({i: moe.routed_tokens.tolist() for i, moe in layers.items()},
                          m.data_parallel_size * m.tensor_parallel_size, m.redundant_experts, target.expert_placement)
    return {**stats, "idle_forwards": parallel.idle_forwards}


def run_job(job: Job, engine_factory: EngineFactory, shard: Shard, progress: bool = True,
            job_file: str | None = None, on_row: Callable[[dict], None] | None = None) -> RunResult:
    """Run this shard of the job. Everything that can make the job fail as a whole (inputs,
    tokenizer, run.json, checkpoints) is checked before the first row is generated. `on_row`
    gets each output row (a dict of its columns) as it finishes (api.py)."""
    check_job(job)
    tokenizer, delimiters = open_tokenizer(job)
    out_dir = Path(job.output.dir)
    check_run(out_dir, job, shard)  # a changed job is refused before any checkpoint loads
    inputs = input_identity(job, out_dir)
    finished = shard_finished(out_dir, shard.index, inputs)
    if job.model.expert_parallel:  # a finished group still loads its experts while another group has rows
        finished = not parallel.any_group(not finished)
    if finished:  # a resubmitted finished task: no model to load
        return RunResult(shard, 0, {}, already_complete=True)
    on_main = threading.current_thread() is threading.main_thread()
    early: list[int] = []  # a stop signal while the model loads stops the run before its first row

    def while_loading(signum: int, _frame: object) -> None:
        if early and signum == signal.SIGINT:  # a second Ctrl-C: no row is finished yet, stop now
            raise Preempted(signum)
        early.append(signum)

    previous = {s: signal.signal(s, while_loading) for s in STOP_SIGNALS} if on_main else {}
    try:
        with shard_lock(out_dir, shard.index) if parallel.run_rank() == 0 else contextlib.nullcontext():
            tally = Progress(progress_path(out_dir, shard.index) if parallel.run_rank() == 0 else None,
                             log=not progress, slurm=slurm_of(os.environ))
            run = None
            try:
                engine = engine_factory(job, tokenizer)
                # run.json only once the checkpoints loaded, so a mistyped path cannot tie the directory
                # to it. Rank 0 creates it; every rank reads the committed rows before any rank writes
                # more, so all ranks schedule the same requests (their collectives must match).
                config_hash = lock_run(out_dir, job, shard, job_file) if parallel.run_rank() == 0 else None
                parallel.barrier()
                config_hash = config_hash or lock_run(out_dir, job, shard, job_file)
                run = _Run(job, shard, tokenizer, engine, config_hash, progress, delimiters, on_row, tally=tally)
                parallel.barrier()
                for s in previous:
                    signal.signal(s, run.on_signal)
                if early:
                    run.signum = early[0]
                    run.stop.set()
                with fewer_gc_passes():
                    written = run.run()
                stats = (write_shard_stats(out_dir, shard.index, complete=True, inputs=inputs,
                                           schedule=schedules(engine), experts=expert_stats(job, engine))
                         if parallel.run_rank() == 0 else {})
            except BaseException as e:
                # Stats are recomputed from the committed parts; a failure writing them now (the
                # disk that stopped the run may still be full) must not hide why the run stopped.
                # Preempted, the seconds before SIGKILL are not spent reading every part back.
                if parallel.run_rank() == 0 and run is not None:
                    with contextlib.suppress(Exception):
                        write_shard_stats(out_dir, shard.index, complete=False, inputs=inputs,
                                          count=not isinstance(e, Preempted), schedule=schedules(run.engine),
                                          experts=expert_stats(job, run.engine))
                tally.end("stopped" if isinstance(e, Preempted) else "failed", run.committed() if run else 0)
                if isinstance(e, Preempted) and e.together:
                    parallel.barrier()  # no rank exits before rank 0 committed: srun stops a step at its first exit
                raise
            tally.end("finished", written)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return RunResult(shard, written, stats, progress=tally)
