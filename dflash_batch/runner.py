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
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from dflash_batch import __version__, parallel
from dflash_batch.engine.request import Completion, Engine, Request, SamplingParams
from dflash_batch.grammar import Grammars, asks_for_grammar, wants_grammar
from dflash_batch.io.inputs import check_inputs, input_fingerprint
from dflash_batch.io.ledger import (check_run, keys_to_skip, lock_run, shard_dir, shard_finished, shard_lock,
                                   write_shard_stats)
from dflash_batch.io.outputs import RESERVED, PartWriter, output_record
from dflash_batch.io.progress import Progress, progress_path, slurm_of
from dflash_batch.job import Job, JobError, SamplingSpec, check_model_paths
from dflash_batch.plan.buckets import Bucket, plan_buckets
from dflash_batch.plan.ahead import fewer_gc_passes, prepare_ahead
from dflash_batch.plan.rows import PreparedRow, sample_seed
from dflash_batch.plan.shards import Shard
from dflash_batch.tokenizer import Tokenizer, stop_token_ids
from dflash_batch.reasoning import Delimiters, find_delimiters, split_reasoning

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
        self.job, self.shard, self.tok, self.engine = job, shard, tokenizer, engine
        self.tally = tally  # this run's rows, error rows and progress file
        self.on_row = on_row
        self.delimiters = delimiters
        self.config_hash, self.progress = config_hash, progress
        self.buckets = plan_buckets(job)
        self.eos = tuple(stop_token_ids(job.model.target, tokenizer))
        out_dir = Path(job.output.dir)
        self.done = keys_to_skip(out_dir, shard.index, job)
        def asked(field: str) -> bool:  # by the job, or by rows
            return getattr(job.sampling, field) is not None or job.input.rows_may_set(field)

        # logprobs go with the ids of the tokens they score (export writes their text and bytes)
        with_ids = job.output.include_token_ids or asked("logprobs")
        optional = [c for c, on in (("response_token_ids", with_ids),
                                    ("rendered_prompt", job.output.include_prompt),
                                    ("reasoning", delimiters is not None)) if on]
        optional += ["logprobs", "top_logprob_ids", "top_logprobs"] * asked("logprobs")
        optional += ["prompt_logprobs", "prompt_top_logprob_ids", "prompt_top_logprobs"] * asked("prompt_logprobs")
        self.optional = optional
        self.writer = None if parallel.rank() else PartWriter(
            shard_dir(out_dir, shard.index), passthrough=job.input.passthrough_columns,
            optional=optional, rows_per_part=job.output.rows_per_part,
            flush_seconds=job.output.flush_seconds, compression=job.output.compression,
            metadata={"dflash_batch.version": __version__, "dflash_batch.config_hash": config_hash,
                      "dflash_batch.job": job.model_dump_json()})
        self.stop = threading.Event()
        self.running = self.committing = False  # where on_signal may stop the run at once
        self.signum = signal.SIGTERM  # the first stop signal's (the exit code says which)
        self.tensor_parallel = parallel.world_size() > 1
        self.default_params = self._params(job.sampling)
        vocab = engine.vocab_size or tokenizer.vocab_size  # a stand-in engine may not say
        self.grammars = Grammars(tokenizer, vocab, list(self.eos)) if asks_for_grammar(job) else None

    # -- rows ----------------------------------------------------------------------------------
    def _base_row(self, row: PreparedRow, sample_index: int, seed: int | None = None) -> dict:
        if seed is None:
            seed = sample_seed(row.sampling.seed, row.row_id, sample_index)
        out = {"row_id": row.row_id, "sample_index": sample_index, "passthrough": row.passthrough,
               "seed": seed,
               "prompt_truncated": row.prompt_truncated, "shard_index": self.shard.index,
               "config_hash": self.config_hash, "rendered_prompt": row.prompt_text,
               "prompt_tokens": len(row.prompt_ids) if row.prompt_ids is not None else None}
        if row.bucket is not None:
            out["bucket"] = self.buckets[row.bucket].name
        return out

    def _error_row(self, row: PreparedRow, sample_index: int) -> dict:
        return {**self._base_row(row, sample_index), "status": "error", "finish_reason": "error",
                "error_type": row.error_type, "error": row.error}

    def _failed_row(self, row: PreparedRow, seed: int, c: Completion) -> dict:
        """A request the engine failed on alone (non-finite logits, out of memory alone, an
        exception only it raises): an error row, committed, so a resume never meets it again."""
        return {**self._base_row(row, c.key[1], seed), "status": "error", "finish_reason": "error",
                "error_type": c.error_type, "error": c.error, "latency_s": c.latency_s}

    def _ok_row(self, row: PreparedRow, seed: int, c: Completion) -> dict:
        out = {**self._base_row(row, c.key[1], seed), "status": "ok", "response": c.text,
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
               "completion_tokens": len(c.token_ids), "response_token_ids": c.token_ids,
               "ttft_s": c.ttft_s, "latency_s": c.latency_s}
        if self.delimiters is not None:
            by_string = c.stop_reason is not None and c.stop_reason in row.sampling.stop
            ids = c.token_ids[:-1] if c.finish_reason == "stop" and not by_string else c.token_ids
            out["reasoning"], out["response"] = split_reasoning(
                row.prompt_ids, ids, c.stop_reason if by_string else None, self.delimiters, self.tok.decode)
        for prefix, lp in (("", c.logprobs), ("prompt_", c.prompt_logprobs)):
            if lp is not None:
                out.update({f"{prefix}logprobs": lp.token, f"{prefix}top_logprob_ids": lp.top_ids,
                            f"{prefix}top_logprobs": lp.top})
        if c.spec is not None:
            rounds, accepted, b = c.spec.rounds, c.spec.accepted, c.spec.block_size
            out.update(spec_block_size=b, spec_rounds=rounds, spec_accepted=accepted,
                       spec_histogram=c.spec.histogram,
                       acc_len=1 + accepted / rounds if rounds else None,
                       proposal_acceptance=accepted / ((b - 1) * rounds) if rounds else None)
        return out

    def _params(self, s: SamplingSpec) -> SamplingParams:
        """Engine sampling parameters of a row (seed still 0): EOS joins the stop ids."""
        stops = tuple(dict.fromkeys(s.stop_token_ids if s.ignore_eos else (*self.eos, *s.stop_token_ids)))
        return SamplingParams(s.temperature, s.top_p, s.top_k, s.max_new_tokens, tuple(s.stop), stops,
                              min_p=s.min_p, min_tokens=s.min_tokens, logit_bias=tuple(s.logit_bias.items()),
                              repetition_penalty=s.repetition_penalty, frequency_penalty=s.frequency_penalty,
                              presence_penalty=s.presence_penalty, logprobs=s.logprobs,
                              prompt_logprobs=s.prompt_logprobs)

    def _requests(self, row: PreparedRow) -> list[Request]:
        s = row.sampling
        base = self._params(s) if row.overrides else self.default_params
        compiled = self.grammars.compile(s) if self.grammars is not None else None  # (checked: _check_grammar)
        grammar = self.grammars.matcher(compiled, base.stop_token_ids) if compiled is not None else None
        reqs = []
        for i in range(s.n):
            if (row.row_id, i) in self.done:
                continue
            params = dataclasses.replace(base, seed=sample_seed(s.seed, row.row_id, i))
            reqs.append(Request((row.row_id, i), row.prompt_ids, params, grammar))
        return reqs

    def _check_grammar(self, row: PreparedRow) -> None:
        """A row's grammar must compile and have a stop token to end on, or the row fails."""
        if self.grammars is None:  # only a request body can ask for one then (asks_for_grammar)
            row.fail("bad_grammar", "structured output needs xgrammar: pip install 'dflash-batch[structured]'")
            return
        try:
            if self.grammars.compile(row.sampling) is not None and not self._params(row.sampling).stop_token_ids:
                row.fail("bad_grammar", "structured output needs a stop token to end on: the tokenizer has "
                                        "no EOS; give sampling.stop_token_ids")
        except ValueError as e:
            row.fail("bad_grammar", str(e))

    def _commit(self, row: dict) -> None:
        self.committing = True  # a SIGTERM now only sets stop: the check below acts on it
        if self.writer is not None:  # tensor-parallel ranks other than 0 decode but do not write
            self.writer.add(row)
            if self.on_row is not None:
                self.on_row(output_record(row, self.job.input.passthrough_columns, self.optional))
        self.tally.row(row, self.committed())
        self.committing = False
        # Every rank commits the same rows in the same order; they agree on stopping here.
        stop = parallel.any_rank(self.stop.is_set()) if self.tensor_parallel else self.stop.is_set()
        if stop:
            self._stop(together=self.tensor_parallel)

    def committed(self) -> int:
        return self.writer.committed_rows if self.writer is not None else 0

    def _stop(self, together: bool = False) -> None:
        self.running = False  # first: a second signal must not cut the flush on the way out
        raise Preempted(self.signum, together)

    def on_signal(self, signum: int, _frame: object = None) -> None:
        """SIGTERM or SIGINT: stop. On one rank, at once: the rows finished so far are committed
        on the way out (run), however long the round or the row in progress would take.
        Tensor-parallel ranks stop at the next committed row instead, all at the same one (their
        collectives match)."""
        if not self.stop.is_set():
            self.signum = signum
        self.stop.set()
        if self.running and not self.committing and not self.tensor_parallel:
            self._stop()

    # -- the loop ------------------------------------------------------------------------------
    def _run_bucket(self, bucket: Bucket, rows: list[PreparedRow]) -> None:
        by_key = {}
        requests = []
        for row in rows:
            for req in self._requests(row):
                by_key[req.key] = (row, req.params.seed)
                requests.append(req)
        if not requests:
            return
        bar = tqdm(total=len(requests), desc=f"bucket {bucket.name}", unit="req",
                   disable=not self.progress or self.writer is None, leave=True, dynamic_ncols=True)
        tokens, rounds, accepted, t0 = 0, 0, 0, time.monotonic()
        shown = t0
        try:
            for c in self.engine.generate(iter(requests), bucket):
                row, seed = by_key.pop(c.key)
                self._commit(self._ok_row(row, seed, c) if c.error_type is None else self._failed_row(row, seed, c))
                tokens += len(c.token_ids)
                if c.spec is not None:
                    rounds, accepted = rounds + c.spec.rounds, accepted + c.spec.accepted
                bar.update(1)
                if (now := time.monotonic()) - shown > 0.5:  # formatting per row would cost more
                    shown = now
                    post = {"tok/s": f"{tokens / (now - t0):.0f}"}
                    if rounds:
                        post["acc_len"] = f"{1 + accepted / rounds:.2f}"
                    schedule = getattr(self.engine, "schedules", {}).get(bucket.name)
                    if schedule is not None and schedule.k is not None and not schedule.off:
                        post["k"] = schedule.k  # drafts the last round verified
                    bar.set_postfix(post, refresh=False)
        finally:
            bar.close()
        if by_key:
            raise RuntimeError(f"engine returned no result for {len(by_key)} request(s), e.g. "
                               f"{next(iter(by_key))}")

    def _run_window(self, rows: list[PreparedRow]) -> None:
        by_bucket: dict[int, list[PreparedRow]] = {}
        seen, duplicates = set(), []  # a row id twice in a window would be two requests under one key
        for row in rows:
            if row.row_id in seen and not row.error_type:
                row.fail("duplicate_id", f"row id {row.row_id!r} is also an earlier input row's; this row was not "
                         "run (dflash-batch validate lists duplicate ids)")
                duplicates.append(row)  # committed after the first row's answer, which a resume must not skip
                continue
            seen.add(row.row_id)
            if not row.error_type and (self.grammars is not None or wants_grammar(row.sampling)):
                self._check_grammar(row)
            if row.error_type:
                self._commit_errors(row)
            else:
                by_bucket.setdefault(row.bucket, []).append(row)
        for b in sorted(by_bucket):
            self._run_bucket(self.buckets[b], by_bucket[b])
        for row in duplicates:
            self._commit_errors(row)

    def _commit_errors(self, row: PreparedRow) -> None:
        """A failed row's samples not committed yet, as error rows."""
        for i in range(row.sampling.n):
            if (row.row_id, i) not in self.done:
                self._commit(self._error_row(row, i))

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
        batches = prepare_ahead(self.job, self.tok, self.shard, self.done,
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
                        self._run_window(window)
                        window = []
            finally:
                batches.close()
            self._run_window(window)
        except Preempted:
            self.running = False
            if self.writer is not None:  # every finished row, now
                self.writer.flush()
            raise
        finally:
            self.running = False
        if self.writer is None:
            return 0
        self.writer.flush()
        return self.writer.committed_rows


def check_job(job: Job) -> None:
    """What fails the whole job, checked before any tokenizer or checkpoint is read: the model
    paths first (a typo named by its field), then the output columns, the input files and their
    columns."""
    check_model_paths(job.model)
    for col in job.input.passthrough_columns:
        if col in RESERVED:
            raise JobError(f"input.passthrough_columns: {col!r} collides with an output column")
    check_inputs(job.input)


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
    split = job.output.split_reasoning
    return tokenizer, find_delimiters(tokenizer, job.output.reasoning_delimiters, where) if split else None


def schedules(engine: object) -> dict[str, dict]:
    """The speculation schedules an engine kept, by bucket (engines without them: none)."""
    return {name: s.stats() for name, s in getattr(engine, "schedules", {}).items()}


def run_job(job: Job, engine_factory: EngineFactory, shard: Shard, progress: bool = True,
            job_file: str | None = None, on_row: Callable[[dict], None] | None = None) -> RunResult:
    """Run this shard of the job. Everything that can make the job fail as a whole (inputs,
    tokenizer, run.json, checkpoints) is checked before the first row is generated. `on_row`
    gets each output row (a dict of its columns) as it finishes (api.py)."""
    check_job(job)
    tokenizer, delimiters = open_tokenizer(job)
    out_dir = Path(job.output.dir)
    check_run(out_dir, job, shard)  # a changed job is refused before any checkpoint loads
    inputs = input_fingerprint(job.input)
    if shard_finished(out_dir, shard.index, inputs):  # a resubmitted finished task: no model to load
        return RunResult(shard, 0, {}, already_complete=True)
    on_main = threading.current_thread() is threading.main_thread()
    early: list[int] = []  # a stop signal while the model loads stops the run before its first row

    def while_loading(signum: int, _frame: object) -> None:
        if early and signum == signal.SIGINT:  # a second Ctrl-C: no row is finished yet, stop now
            raise Preempted(signum)
        early.append(signum)

    previous = {s: signal.signal(s, while_loading) for s in STOP_SIGNALS} if on_main else {}
    try:
        with shard_lock(out_dir, shard.index) if parallel.rank() == 0 else contextlib.nullcontext():
            tally = Progress(progress_path(out_dir, shard.index) if parallel.rank() == 0 else None,
                             log=not progress, slurm=slurm_of(os.environ))
            run = None
            try:
                engine = engine_factory(job, tokenizer)
                # run.json only once the checkpoints loaded, so a mistyped path cannot tie the directory
                # to it. Rank 0 creates it; every rank reads the committed rows before any rank writes
                # more, so all ranks schedule the same requests (their collectives must match).
                config_hash = lock_run(out_dir, job, shard, job_file) if parallel.rank() == 0 else None
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
                                           schedule=schedules(engine)) if parallel.rank() == 0 else {})
            except BaseException as e:
                # Stats are recomputed from the committed parts; a failure writing them now (the
                # disk that stopped the run may still be full) must not hide why the run stopped.
                # Preempted, the seconds before SIGKILL are not spent reading every part back.
                if parallel.rank() == 0 and run is not None:
                    with contextlib.suppress(Exception):
                        write_shard_stats(out_dir, shard.index, complete=False, inputs=inputs,
                                          count=not isinstance(e, Preempted), schedule=schedules(run.engine))
                tally.end("stopped" if isinstance(e, Preempted) else "failed", run.committed() if run else 0)
                if isinstance(e, Preempted) and e.together:
                    parallel.barrier()  # no rank exits before rank 0 committed: srun stops a step at its first exit
                raise
            tally.end("finished", written)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return RunResult(shard, written, stats, progress=tally)
