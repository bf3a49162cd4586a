"""From input records to prepared rows: id, prompt tokens, sampling, bucket, or an error.

Everything wrong with one row (bad JSON, missing or mistyped prompt, empty prompt, a malformed
chat message, over-long prompt, a bad per-row override) becomes an error row here; the job goes on.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from dflash_batch.io.inputs import Record
from dflash_batch.io.openai_batch import RequestError, request_fields
from dflash_batch.job import GRAMMAR_FIELDS, Job, SamplingSpec
from dflash_batch.plan.buckets import assign_bucket
from dflash_batch.plan.messages import message_problem
from dflash_batch.plan.shards import Shard, hash64, shard_of
from dflash_batch.tokenizer import Tokenizer
from dflash_batch.tools import module_tools


@dataclass(slots=True)
class PreparedRow:
    row_id: str
    passthrough: tuple[Any, ...]      # input.passthrough_columns' values, in that order
    sampling: SamplingSpec
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    bucket: int | None = None
    prompt_truncated: bool = False
    error_type: str | None = None
    error: str | None = None
    overrides: dict[str, Any] | None = None  # per-row sampling overrides, if any
    # A conversation's first messages, chat template arguments and scripted later user turns.
    messages: list[dict] | None = None
    template_kwargs: dict[str, Any] | None = None
    followups: list | None = None

    def fail(self, kind: str, message: str) -> None:
        self.error_type, self.error, self.prompt_ids = kind, message, None

    def __reduce__(self) -> tuple:
        # Rows cross from the preparing workers by pickle; rebuilding from positional fields
        # unpickles several times faster than the default slots state.
        return PreparedRow, (self.row_id, self.passthrough, self.sampling, self.prompt_ids, self.prompt_text,
                             self.bucket, self.prompt_truncated, self.error_type, self.error, self.overrides,
                             self.messages, self.template_kwargs, self.followups)


def fallback_row_id(source: str, index: int) -> str:
    return f"{hash64(f'{source}:{index}'):016x}"


def sample_seed(job_seed: int, row_id: str, sample_index: int) -> int:
    return hash64(f"{job_seed}:{row_id}:{sample_index}") & (2**63 - 1)


class RowPreparer:
    """Turns batches of records into the prepared rows of one shard of one job, leaving out
    rows whose samples are all committed."""

    def __init__(self, job: Job, tokenizer: Tokenizer, vocab_size: int | None = None,
                 shard: Shard = Shard(0, 1), done: Container[tuple[str, int]] = frozenset()):
        self.job, self.spec, self.tok, self.vocab_size = job, job.input, tokenizer, vocab_size
        self.shard, self.done = shard, done
        self.edges = [b.max_tokens for b in job.resolved_buckets()]
        self.base_sampling = job.sampling.model_dump()
        self.keep_text = job.output.include_prompt
        self.openai = job.input.format == "openai_batch"
        tools = job.conversation.tools if job.conversation else None
        self.tool_definitions = module_tools(tools)[1] if tools else None
        changed = job.retry.changes if job.retry else {}
        self.retry_sets = {k.split(".")[1] for k in changed if k.startswith("sampling.")}

    def _mine(self, row_id: str) -> bool:
        return self.shard.count == 1 or shard_of(row_id, self.shard.count) == self.shard.index

    def _all_done(self, row_id: str, n: int) -> bool:
        return all((row_id, i) in self.done for i in range(n))

    def row_id(self, rec: Record, data: dict | None) -> tuple[str, str | None]:
        col = "custom_id" if self.openai else self.spec.id_column
        if col is None or data is None:
            return fallback_row_id(rec.source, rec.index), None
        value = data.get(col)
        if isinstance(value, str) and value:
            return value, None
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value), None
        return fallback_row_id(rec.source, rec.index), f"id column {col!r} is {value!r}"

    def _columns(self, rec: Record) -> tuple[dict | None, str | None]:
        """The record's columns (an OpenAI request line: its fields mapped onto ours, see
        io/openai_batch.py), and what makes the row an error, if anything."""
        if rec.error:
            return None, rec.error
        if not self.openai:
            return rec.data, None
        try:
            return request_fields(rec.data), None
        except RequestError as e:
            return {"custom_id": rec.data.get("custom_id")}, f"line {rec.index + 1}: {e}"

    def _sampling(self, data: dict, row: PreparedRow) -> None:
        if self.openai:  # the request body's fields, named as the body names them in errors
            overrides, names = dict(data["sampling"]), {f: f"body.{b}" for f, b in data["origin"].items()}
        else:
            overrides = {f: data.get(c) for f, c in self.spec.sampling_columns.items() if data.get(c) is not None}
            names = self.spec.sampling_columns
        for field in self.retry_sets:  # a retry's --set sampling.X wins over the row's own X
            overrides.pop(field, None)
        if not overrides:
            return
        kwargs = overrides.get("chat_template_kwargs")
        if isinstance(kwargs, dict):  # the row's keys over the job's
            overrides["chat_template_kwargs"] = {**self.base_sampling["chat_template_kwargs"], **kwargs}
        base = self.base_sampling
        if any(f in overrides for f in GRAMMAR_FIELDS):  # a row's grammar replaces the job's
            base = {**base, **dict.fromkeys(GRAMMAR_FIELDS)}
        try:
            row.sampling = SamplingSpec.model_validate({**base, **overrides})
            row.overrides = overrides
        except ValidationError as e:
            def where(loc: tuple) -> str:  # the column of a field; a check across fields has none
                return names.get(str(loc[0]), str(loc[0])) if loc else "sampling"
            bad = "; ".join(f"{where(x['loc'])}: {x['msg']}" for x in e.errors())
            row.fail("bad_sampling_override", bad)

    def _prompt_source(self, data: dict) -> tuple[str, str, str, Any]:
        """(kind 'text'|'chat'|'ids', the key holding the prompt, its name in errors, the tools)."""
        spec = self.spec
        if self.openai:
            key = next(k for k in ("messages", "prompt", "input_ids") if k in data)
            kind = {"messages": "chat", "prompt": "text", "input_ids": "ids"}[key]
            return kind, key, f"body.{'prompt' if kind == 'ids' else key}", data.get("tools")
        tools = data.get(spec.tools_column) if spec.tools_column else None
        if spec.prompt_column:
            return "text", spec.prompt_column, spec.prompt_column, None
        if spec.messages_column:
            return "chat", spec.messages_column, spec.messages_column, tools
        return "ids", spec.input_ids_column, spec.input_ids_column, None

    def _prompt(self, data: dict, row: PreparedRow) -> tuple[str, Any] | None:
        """('text'|'chat'|'ids', value) or None after recording an error."""
        spec = self.spec
        kind, key, col, tools = self._prompt_source(data)
        value = data.get(key)
        if value is None:
            row.fail("missing_prompt", f"column {col!r} is missing or null")
            return None
        if kind == "text":
            if not isinstance(value, str):
                row.fail("bad_prompt_type", f"column {col!r} must be a string, got {type(value).__name__}")
            elif not value.strip():
                row.fail("empty_prompt", f"column {col!r} is empty")
            else:
                return "text", value
        elif kind == "chat":
            if not isinstance(value, list):
                row.fail("bad_prompt_type", f"column {col!r} must be a list of {{role, content}} messages")
            elif not value:
                row.fail("empty_prompt", f"column {col!r} has no messages")
            elif (problem := message_problem(value)) is not None:
                row.fail("bad_message", f"{col}{problem}")
            else:
                if spec.system_prompt and value[0].get("role") != "system":
                    value = [{"role": "system", "content": spec.system_prompt}, *value]
                kwargs = row.sampling.chat_template_kwargs
                if tools is not None:
                    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                        where = "body.tools" if self.openai else spec.tools_column
                        row.fail("bad_prompt_type", f"column {where!r} must be a list of tool objects")
                        return None
                    kwargs = {**kwargs, "tools": tools}
                if self.job.conversations:
                    if self.tool_definitions and "tools" not in kwargs:  # the row's own tools win
                        kwargs = {**kwargs, "tools": self.tool_definitions}
                    row.messages, row.template_kwargs = value, kwargs
                    if (followups := self._followups(data, row)) is None:
                        return None
                    row.followups = followups
                try:
                    return "chat", self.tok.render_chat(value, kwargs)
                except Exception as e:  # a template error concerns this row only
                    row.fail("chat_template_error", f"{type(e).__name__}: {e}")
        else:
            if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                    and t >= 0 for t in value)):
                row.fail("bad_prompt_type", f"column {col!r} must be a list of non-negative ints")
            elif not value:
                row.fail("empty_prompt", f"column {col!r} is empty")
            else:
                return "ids", list(value)
        return None

    def _followups(self, data: dict, row: PreparedRow) -> list | None:
        """The row's later user turns (none: an empty list), or None after recording an error."""
        col = self.spec.followups_column
        value = data.get(col) if col else None
        if value is None:
            return []
        if not isinstance(value, list):
            row.fail("bad_followups", f"column {col!r} must be a list of user turns (strings or messages), "
                     f"got {type(value).__name__}")
            return None
        for i, turn in enumerate(value):
            if isinstance(turn, str):
                continue
            problem = message_problem([turn]) if isinstance(turn, dict) else f" is a {type(turn).__name__}"
            if problem is not None:
                row.fail("bad_followups", f"column {col!r} item {i}{problem.removeprefix('[0]')}: each must be a "
                         "string or a {role, content} message")
                return None
        return value

    def _fit(self, row: PreparedRow) -> None:
        """Apply the overflow policy and pick the bucket."""
        limit, max_new = self.edges[-1], row.sampling.max_new_tokens
        budget = limit - max_new
        n = len(row.prompt_ids)
        if n == 0:  # a chat template can render to nothing
            row.fail("empty_prompt", "the prompt has no tokens after templating and tokenising")
            return
        if self.vocab_size is not None and max(row.prompt_ids) >= self.vocab_size:
            row.fail("token_out_of_range", f"prompt token id {max(row.prompt_ids)} is outside the "
                     f"model's vocabulary of {self.vocab_size}")
            return
        if self.vocab_size is not None and max(row.sampling.logit_bias, default=-1) >= self.vocab_size:
            row.fail("token_out_of_range", f"logit_bias token id {max(row.sampling.logit_bias)} is outside "
                     f"the model's vocabulary of {self.vocab_size}")
            return
        if budget < 1:
            row.fail("max_new_tokens_too_large", f"max_new_tokens {max_new} leaves no room for a "
                     f"prompt within {limit} tokens")
            return
        if n > budget:
            policy = self.job.overflow
            if policy == "error":
                row.fail("prompt_too_long", f"prompt has {n} tokens; with max_new_tokens {max_new} "
                         f"it exceeds {limit} (set overflow: truncate_left/truncate_right to truncate)")
                return
            row.prompt_ids = row.prompt_ids[-budget:] if policy == "truncate_left" else row.prompt_ids[:budget]
            row.prompt_truncated = True
        row.bucket = assign_bucket(len(row.prompt_ids) + max_new, self.edges)

    def samples(self, records: list[Record]) -> Iterator[tuple[str, int]]:
        """(row id, output rows it makes) of each record, without templating or tokenising: an
        error row makes the job's n, a row with a valid per-row n its own (plan/expected.py)."""
        for rec in records:
            data, problem = self._columns(rec)
            row_id, id_problem = self.row_id(rec, data)
            row = PreparedRow(row_id, (), self.job.sampling)
            if not problem and not id_problem:
                self._sampling(data, row)
            yield row_id, row.sampling.n

    def prepare(self, records: list[Record]) -> list[PreparedRow]:
        rows, texts, chats = [], [], []
        passthrough = self.spec.passthrough_columns
        per_row_n = self.spec.rows_may_set("n")
        for rec in records:
            data, problem = self._columns(rec)
            row_id, id_problem = self.row_id(rec, data)
            # Skip a row whose samples are all committed; with a per-row n, once its n is known.
            if not self._mine(row_id) or (not per_row_n and self._all_done(row_id, self.job.sampling.n)):
                continue
            data = data or {}
            row = PreparedRow(row_id, tuple(map(data.get, passthrough)), self.job.sampling)
            if problem:
                row.fail("bad_request" if rec.error is None else "bad_input_line", f"{rec.source}: {problem}")
            elif id_problem:
                row.fail("bad_row_id", f"{rec.source} row {rec.index}: {id_problem}")
            else:
                self._sampling(data, row)
            if per_row_n and self._all_done(row_id, row.sampling.n):
                continue
            rows.append(row)
            if row.error_type:
                continue
            prompt = self._prompt(data, row)
            if prompt is None:
                continue
            kind, value = prompt
            if kind == "ids":
                row.prompt_ids = value
            else:
                row.prompt_text = value
                (texts if kind == "text" else chats).append(row)
        for group, special in ((texts, True), (chats, False)):
            if group:
                for row, ids in zip(group, self.tok.encode_batch([r.prompt_text for r in group], special)):
                    row.prompt_ids = ids
                    if not self.keep_text:
                        row.prompt_text = None
        for row in rows:
            if row.prompt_ids is not None:
                self._fit(row)
        return rows
