"""Prepared rows through the engine into output rows: an ok row per finished sample, an error
row for a row that could not run (bad input, a grammar that fails, a duplicate id) or a request
the engine failed on alone. Rows go to `commit` as they finish, a list at a time that must be
committed together; where they go (Parquet parts through runner.py, a Ray batch through ray.py)
is the caller's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Container

from tqdm import tqdm

from dflash_batch.conversation import Conversation, Conversations
from dflash_batch.engine.request import Completion, Engine, Request, RequestKey, SamplingParams, SpecCounters
from dflash_batch.io.outputs import CONVERSATION_COLUMNS
from dflash_batch.io.turn_journal import TurnJournal
from dflash_batch.grammar import Grammars, asks_for_grammar, wants_grammar
from dflash_batch.job import Job, SamplingSpec
from dflash_batch.keys import Shard
from dflash_batch.plan.buckets import Bucket, assign_bucket, plan_buckets
from dflash_batch.plan.rows import PreparedRow, sample_seed
from dflash_batch.reasoning import Delimiters, split_reasoning
from dflash_batch.tokenizer import Tokenizer, stop_token_ids


def optional_columns(job: Job, delimiters: Delimiters | None) -> list[str]:
    """The optional output columns a job writes (io/outputs.py's OPTIONAL_COLUMNS)."""
    def asked(field: str) -> bool:  # by the job, or by rows
        return getattr(job.sampling, field) is not None or job.input.rows_may_set(field)

    # logprobs go with the ids of the tokens they score (export writes their text and bytes)
    with_ids = job.output.include_token_ids or asked("logprobs")
    optional = [c for c, on in (("response_token_ids", with_ids),
                                ("rendered_prompt", job.output.include_prompt),
                                ("reasoning", delimiters is not None)) if on]
    optional += ["logprobs", "top_logprob_ids", "top_logprobs"] * asked("logprobs")
    optional += ["prompt_logprobs", "prompt_top_logprob_ids", "prompt_top_logprobs"] * asked("prompt_logprobs")
    optional += list(CONVERSATION_COLUMNS) * job.conversations + ["turn_token_ids"] * (job.conversations and with_ids)
    return optional


class RowDecoder:
    """One job's rows through one engine. `done`: the (row_id, sample_index) keys not to generate
    (committed before); `commit`: takes rows that must land in the same part (a sample's row and
    the error rows of later input rows with its id: they share its key, so a resume that found
    one committed without the others would skip them); `progress`: a bar per bucket."""

    def __init__(self, job: Job, shard: Shard, tokenizer: Tokenizer, engine: Engine, config_hash: str,
                 delimiters: Delimiters | None, done: Container[tuple[str, int]],
                 commit: Callable[[list[dict]], None], progress: bool = False,
                 journal: TurnJournal = TurnJournal(None)):
        """`journal`: where conversations keep their finished turns (io/turn_journal.py)."""
        self.job, self.shard, self.tok, self.engine = job, shard, tokenizer, engine
        self.config_hash, self.delimiters, self.done = config_hash, delimiters, done
        self.commit, self.progress = commit, progress
        self.buckets = plan_buckets(job)
        self.eos = tuple(stop_token_ids(job.model.target, tokenizer))
        self.optional = optional_columns(job, delimiters)
        self.default_params = self._params(job.sampling)
        vocab = engine.vocab_size or tokenizer.vocab_size  # a stand-in engine may not say
        self.grammars = Grammars(tokenizer, vocab, list(self.eos)) if asks_for_grammar(job) else None
        self.conversations = Conversations(job, tokenizer, journal) if job.conversations else None
        self.talks: dict[RequestKey, Conversation] = {}  # the conversations running, by key
        # Conversations whose next turn outgrew their bucket, by the bucket they go on in.
        self.moved: dict[int, list[tuple[PreparedRow, Request]]] = {}
        self.later: dict[str, list[PreparedRow]] = {}  # a window's rows whose id an earlier row holds
        self.to_commit: dict[str, int] = {}  # the samples those ids' first rows have still to commit

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

    def _ok_row(self, row: PreparedRow, seed: int, c: Completion, prompt_ids: list[int] | None = None) -> dict:
        """`prompt_ids`: what the completion followed (a conversation's last turn: its history)."""
        out = {**self._base_row(row, c.key[1], seed), "status": "ok", "response": c.text,
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
               "completion_tokens": len(c.token_ids), "response_token_ids": c.token_ids,
               "cached_tokens": c.cached_tokens,
               "ttft_s": c.ttft_s, "latency_s": c.latency_s}
        if self.delimiters is not None:
            by_string = c.stop_reason is not None and c.stop_reason in row.sampling.stop
            ids = c.token_ids[:-1] if c.finish_reason == "stop" and not by_string else c.token_ids
            out["reasoning"], out["response"] = split_reasoning(
                prompt_ids or row.prompt_ids, ids, c.stop_reason if by_string else None, self.delimiters,
                self.tok.decode)
        for prefix, lp in (("", c.logprobs), ("prompt_", c.prompt_logprobs)):
            if lp is not None:
                out.update({f"{prefix}logprobs": lp.token, f"{prefix}top_logprob_ids": lp.top_ids,
                            f"{prefix}top_logprobs": lp.top})
        if c.spec is not None:
            rounds, accepted, verified = c.spec.rounds, c.spec.accepted, c.spec.drafts_verified
            out.update(spec_block_size=c.spec.block_size, spec_rounds=rounds, spec_accepted=accepted,
                       spec_drafts_verified=verified, spec_histogram=c.spec.histogram,
                       spec_verified_histogram=c.spec.verified_histogram,
                       acc_len=1 + accepted / rounds if rounds else None,
                       proposal_acceptance=accepted / verified if verified else None)
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
            if self.conversations is None:
                reqs.append(Request((row.row_id, i), row.prompt_ids, params, grammar))
                continue
            talk = self.conversations.start((row.row_id, i), row.messages, row.template_kwargs, row.followups,
                                            row.prompt_ids, params)
            if talk.end is not None:  # it ended in a killed run before its row was committed
                self._commit_sample(row, i, self._conversation_row(row, params.seed, talk, None))
                continue
            self.talks[talk.key] = talk
            reqs.append(Request(talk.key, talk.history, params, grammar, talk))
        return reqs

    def _conversation_row(self, row: PreparedRow, seed: int, talk: Conversation, c: Completion | None) -> dict:
        """A conversation's row: its last turn's response and finish, every turn's tokens and
        acceptance counted together, and its per-turn columns. `c`: its engine's last word (an
        error ends it there), None where it ended in a killed run."""
        self.talks.pop(talk.key, None)
        if c is not None and c.error_type is not None:
            failed = self._failed_row(row, seed, c)
            return {**failed, **talk.columns()} if talk.turns else failed
        turns, last = talk.turns, talk.turns[-1]
        rounds = [n for t in turns for n in t.per_round or ()]
        spec = SpecCounters(last.block_size, rounds, [n for t in turns for n in t.verified or ()]) \
            if last.block_size else None
        whole = Completion(talk.key, last.token_ids, last.text, last.finish_reason, last.stop_reason, spec,
                           turns[0].ttft_s, sum(t.latency_s for t in turns), cached_tokens=turns[0].cached_tokens)
        out = self._ok_row(row, seed, whole, talk.history[:len(talk.history) - len(last.token_ids)])
        return {**out, "completion_tokens": sum(len(t.token_ids) for t in turns), **talk.columns()}

    def _move(self, row: PreparedRow, seed: int, c: Completion) -> None:
        """A conversation whose next turn outgrew its bucket goes on, prefilled whole, in the first
        bucket it fits; where none does, it ends (context_full)."""
        talk = self.talks[c.key]
        larger = assign_bucket(len(c.next_prompt) + talk.params.max_new_tokens, [b.max_tokens for b in self.buckets])
        if larger is None:
            talk.end = "context_full"
            self._commit_sample(row, c.key[1], self._conversation_row(row, seed, talk, c))
            return
        self.moved.setdefault(larger, []).append((row, Request(c.key, c.next_prompt, talk.params, None, talk)))

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

    def run_bucket(self, bucket: Bucket, rows: list[PreparedRow],
                   moved: list[tuple[PreparedRow, Request]] = ()) -> None:
        """`moved`: conversations going on here from a smaller bucket."""
        by_key = {}
        requests = []
        for row, req in [(row, req) for row in rows for req in self._requests(row)] + list(moved):
            by_key[req.key] = (row, req.params.seed)
            requests.append(req)
        if not requests:
            return
        bar = tqdm(total=len(requests), desc=f"bucket {bucket.name}", unit="req",
                   disable=not self.progress, leave=True, dynamic_ncols=True)
        tokens, rounds, accepted, t0 = 0, 0, 0, time.monotonic()
        prompted = cached = 0  # prompt tokens of the finished requests (sample 0), and of those taken from heads
        shown = t0
        try:
            for c in self.engine.generate(requests, bucket):  # a list: the engine may count it
                row, seed = by_key.pop(c.key)
                if c.next_prompt is not None:
                    self._move(row, seed, c)
                elif c.key in self.talks:
                    self._commit_sample(row, c.key[1], self._conversation_row(row, seed, self.talks[c.key], c))
                else:
                    self._commit_sample(row, c.key[1], self._ok_row(row, seed, c) if c.error_type is None
                                        else self._failed_row(row, seed, c))
                tokens += len(c.token_ids)
                if c.key[1] == 0 and c.error_type is None:  # once a request, as the stats count (ledger.once_a_request)
                    prompted, cached = prompted + len(row.prompt_ids), cached + c.cached_tokens
                if c.spec is not None:
                    rounds, accepted = rounds + c.spec.rounds, accepted + c.spec.accepted
                bar.update(1)
                if (now := time.monotonic()) - shown > 0.5:  # formatting per row would cost more
                    shown = now
                    post = {"tok/s": f"{tokens / (now - t0):.0f}"}
                    if rounds:
                        post["acc_len"] = f"{1 + accepted / rounds:.2f}"
                    if cached:
                        post["cached"] = f"{cached / prompted:.0%}"  # of prompt tokens: shared heads, forks
                    schedule = getattr(self.engine, "schedules", {}).get(bucket.name)
                    if schedule is not None and schedule.k is not None and not schedule.off:
                        post["k"] = schedule.k  # drafts the last round verified
                    bar.set_postfix(post, refresh=False)
        finally:
            bar.close()
        if by_key:
            raise RuntimeError(f"engine returned no result for {len(by_key)} request(s), e.g. "
                               f"{next(iter(by_key))}")

    def run_window(self, rows: list[PreparedRow]) -> None:
        """A row id twice in a window would be two requests under one key: a later row with an
        earlier row's id is not run; its samples' error rows (duplicate_id, or its own error) are
        committed with the first row's samples, in the same part."""
        first: dict[str, PreparedRow] = {}
        self.later, self.to_commit = {}, {}
        for row in rows:
            if row.row_id not in first:
                first[row.row_id] = row
                continue
            if not row.error_type:
                row.fail("duplicate_id", f"row id {row.row_id!r} is also an earlier input row's; this row was not "
                         "run (dflash-batch validate lists duplicate ids)")
            self.later.setdefault(row.row_id, []).append(row)
        for row_id in self.later:
            self.to_commit[row_id] = sum((row_id, i) not in self.done for i in range(first[row_id].sampling.n))
        by_bucket: dict[int, list[PreparedRow]] = {}
        for row in first.values():
            if not row.error_type and (self.grammars is not None or wants_grammar(row.sampling)):
                self._check_grammar(row)
            if row.error_type:
                self.commit_errors(row)
            else:
                by_bucket.setdefault(row.bucket, []).append(row)
        for b, bucket in enumerate(self.buckets):  # in order: a conversation moves only to a larger one
            moved = self.moved.pop(b, [])
            if b in by_bucket or moved:
                self.run_bucket(bucket, by_bucket.get(b, []), moved)

    def close(self) -> None:
        """Stop the conversations' threads and close their journal."""
        if self.conversations is not None:
            self.conversations.close()

    def commit_errors(self, row: PreparedRow) -> None:
        """A failed row's samples not committed yet, as error rows."""
        for i in range(row.sampling.n):
            if (row.row_id, i) not in self.done:
                self._commit_sample(row, i, self._error_row(row, i))

    def _commit_sample(self, row: PreparedRow, sample_index: int, out: dict) -> None:
        """A sample's row, with the error rows of the window's later rows under its key; with the
        row's last sample, also theirs past its n (per-row n), so that the later rows' keys are all
        committed once the row's are (a resume skips a row whose keys are, and must skip them too)."""
        later = self.later.get(row.row_id)
        if not later:
            self.commit([out])
            return
        rows = [out, *(self._error_row(r, sample_index) for r in later if sample_index < r.sampling.n)]
        self.to_commit[row.row_id] -= 1
        if not self.to_commit[row.row_id]:
            rows += [self._error_row(r, i) for r in later for i in range(row.sampling.n, r.sampling.n)
                     if (row.row_id, i) not in self.done]
        self.commit(rows)
