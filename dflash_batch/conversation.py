"""Rows that are conversations: after each assistant turn, the tool calls it wrote are run (the
job's tool module) or the next user turn comes (input.followups_column, then the user
simulator), and the next turn opens through the chat template; the engine goes on from the
row's caches (engine/turns.py), so a turn costs only its own tokens.

The model's history is its own tokens: a later turn's prompt is the earlier prompt, the tokens
generated, and the text the chat template puts between that turn's content and the next
generation (its end of turn, the tool results or user message, the assistant's header), found
by rendering the conversation with a marker where the last assistant content goes. A template
that would render earlier turns otherwise (Qwen3 drops old reasoning) is not re-applied to them:
the conversation goes on from what the model saw, as a single-turn row with that history would.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from dflash_batch.engine.request import Completion, RequestKey, SamplingParams
from dflash_batch.io.turn_journal import TurnJournal
from dflash_batch.job import ConversationSpec, Job, JobError
from dflash_batch.plan.messages import message_problem
from dflash_batch.tokenizer import Tokenizer
from dflash_batch.tools import Toolbox, import_object, module_tools, parse_calls, template_format

MARKER = "\u2063dflash-batch: the assistant's content\u2063"  # where a rendering puts the last turn's content


@dataclass(slots=True)
class Turn:
    """One assistant turn, as the output row and the journal keep it."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: str | None
    computed_tokens: int           # prompt tokens the target ran for it
    cached_tokens: int
    per_round: list[int] | None    # accepted drafts a round (None without speculation)
    verified: list[int] | None
    block_size: int | None
    ttft_s: float
    latency_s: float
    tool_calls: int = 0
    tool_errors: int = 0

    @classmethod
    def of(cls, c: Completion) -> Turn:
        spec = c.spec
        return cls(list(c.token_ids), c.text, c.finish_reason, c.stop_reason, c.computed_tokens, c.cached_tokens,
                   list(spec.per_round) if spec else None, list(spec.verified) if spec else None,
                   spec.block_size if spec else None, c.ttft_s, c.latency_s)


def check_conversations(job: Job, tokenizer: Tokenizer) -> tuple[str | None, Callable | None]:
    """Refuse, before any model loads, a tool module or simulator that cannot be imported and
    a tool-call format the chat template does not say; returns the tool-call format (None: no
    tools) and the simulator (None: none)."""
    spec = job.conversation or ConversationSpec()
    simulator = import_object(spec.followups.function, "conversation.followups.function") if spec.followups else None
    if spec.tools is None:
        return None, simulator
    module_tools(spec.tools)
    fmt = spec.tools.format if spec.tools.format != "auto" else template_format(tokenizer.chat_template)
    if fmt is None:
        raise JobError("conversation.tools.format: the chat template writes no tool calls this project reads "
                       "(hermes <tool_call> or kimi <|tool_call_begin|>); set it")
    return fmt, simulator


class Conversations:
    """A run's conversation settings, tools, simulator, threads and journal."""

    def __init__(self, job: Job, tokenizer: Tokenizer, journal: TurnJournal):
        spec = job.conversation or ConversationSpec()
        self.tok, self.journal, self.max_turns = tokenizer, journal, spec.max_turns
        # Threads that wait on a turn's tool calls and run the simulator: off the engine's thread.
        self.pool = ThreadPoolExecutor(spec.tool_workers, thread_name_prefix="dflash-turns")
        fmt, self.simulator = check_conversations(job, tokenizer)
        self.tools = Toolbox(spec.tools, fmt) if fmt is not None else None
        self.resumed = journal.read()

    def start(self, key: RequestKey, messages: list[dict], kwargs: dict[str, Any], followups: list,
              prompt_ids: list[int], params: SamplingParams) -> Conversation:
        """A row's conversation, after the turns a killed run finished (the journal's)."""
        conversation = Conversation(self, key, messages, kwargs, followups, prompt_ids, params)
        for entry in self.resumed.get(key, ()):
            conversation.replay(entry)
        return conversation

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.journal.close()


class Conversation:
    """One row's (one sample's) conversation: its messages, turns and history (Request.turns)."""

    def __init__(self, host: Conversations, key: RequestKey, messages: list[dict], kwargs: dict[str, Any],
                 followups: list, prompt_ids: list[int], params: SamplingParams):
        self.host, self.key, self.kwargs, self.params = host, key, kwargs, params
        self.messages = list(messages)
        self.followups = list(followups)   # the scripted user turns not used yet
        self.history = list(prompt_ids)    # every token the model has seen, the next turn's opening included
        self.turns: list[Turn] = []
        self.end: str | None = None        # why it ended (conversation_end), once it did

    # -- the engine's side (Request.turns) -------------------------------------------------------
    def ended(self, done: Completion) -> Future[list[int] | None]:
        turn = Turn.of(done)
        self.turns.append(turn)
        self.history = self.history + turn.token_ids  # a new list: a request may hold the last one
        message: dict[str, Any] = {"role": "assistant", "content": done.text}
        calls = []
        if self.host.tools is not None:
            message["content"], calls = self._calls(turn)
            if calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        self.messages.append(message)
        if len(self.turns) >= self.host.max_turns:
            return self._now(self._next, turn, [], "max_turns")
        if calls:
            return self.host.pool.submit(self._after_tools, turn, calls)
        if self.followups:
            return self._now(self._after_user, turn, self.followups.pop(0))
        if self.host.simulator is not None:
            return self.host.pool.submit(self._after_simulator, turn)
        return self._now(self._next, turn, [], "no_followup")

    @staticmethod
    def _now(step: Callable, *args: Any) -> Future[list[int] | None]:
        """A next step made at once (a scripted turn: every rank makes it at the same point), its
        failure the conversation's (a future's exception, as a pool's would be)."""
        future: Future[list[int] | None] = Future()
        try:
            future.set_result(step(*args))
        except Exception as e:  # noqa: BLE001 - ends this conversation only (engine/turns.py)
            future.set_exception(e)
        return future

    def _calls(self, turn: Turn) -> tuple[str, list]:
        """The turn's content before its tool calls, and the calls."""
        tok, tools = self.host.tok, self.host.tools
        written = tok.decode_special(turn.token_ids)
        before, calls = parse_calls(written, tools.format, len(self.turns) - 1)
        if not calls:
            return turn.text, []
        # The content is the text of the tokens before the first call's marker.
        lo, hi = 0, len(turn.token_ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(tok.decode_special(turn.token_ids[:mid])) <= len(before):
                lo = mid
            else:
                hi = mid - 1
        return tok.decode(turn.token_ids[:lo]), calls

    def _after_tools(self, turn: Turn, calls: list) -> list[int] | None:
        results = self.host.tools.run(calls)
        turn.tool_calls, turn.tool_errors = len(results), sum(r.error for r in results)
        added = [{"role": "tool", "tool_call_id": r.call.id, "name": r.call.name, "content": r.content}
                 for r in results]
        return self._next(turn, added, None)

    def _after_simulator(self, turn: Turn) -> list[int] | None:
        reply = self.host.simulator([dict(m) for m in self.messages])
        if reply is None:
            return self._next(turn, [], "no_followup")
        return self._after_user(turn, reply)

    def _after_user(self, turn: Turn, reply: Any) -> list[int] | None:
        message = {"role": "user", "content": reply} if isinstance(reply, str) else reply
        problem = message_problem([message])
        if problem is not None:
            raise ValueError(f"the next user turn {str(reply)[:80]!r} is not a string or a message: {problem}")
        return self._next(turn, [message], None)

    def _next(self, turn: Turn, added: list[dict], end: str | None) -> list[int] | None:
        """Record the turn (journal) with what it added, and the next turn's opening (None: `end`)."""
        opening = None if end else self._opening(turn, added)
        self.messages += added
        self.end = end
        self.history = self.history + (opening or [])
        self.host.journal.add(self.key, {"turn": asdict(turn), "messages": [self.messages[-1 - len(added)], *added],
                                         "opening": opening, "end": end})
        return opening

    def _opening(self, turn: Turn, added: list[dict]) -> list[int]:
        """The tokens between the turn's own and the next turn's first: what the chat template
        renders after the last assistant content, less the end-of-turn token the model wrote."""
        tok = self.host.tok
        marked = [*self.messages[:-1], {"role": "assistant", "content": MARKER}, *added]
        rendered = tok.render_chat(marked, self.kwargs)
        if MARKER not in rendered:
            raise ValueError("the chat template does not render an assistant turn's content: a conversation "
                             "cannot go on through it")
        after = rendered.split(MARKER, 1)[1]
        if turn.finish_reason == "stop" and turn.stop_reason not in self.params.stop:  # a stop token ended it
            end = tok.decode_special([int(turn.stop_reason)])
            after = after.removeprefix(end)
        return tok.encode_batch([after], False)[0]

    def replay(self, entry: dict) -> None:
        """A turn a killed run finished (its journal line)."""
        turn = Turn(**entry["turn"])
        self.turns.append(turn)
        self.history = self.history + turn.token_ids + (entry["opening"] or [])
        self.messages += entry["messages"]
        self.end = entry["end"]
        # The scripted turns come before the simulator's: those it used are gone.
        del self.followups[:sum(m.get("role") == "user" for m in entry["messages"])]

    # -- the output row ------------------------------------------------------------------------
    def columns(self) -> dict[str, Any]:
        """Its per-turn output columns."""
        return {"conversation": orjson.dumps(self.messages).decode(),
                "turn_prompt_tokens": [t.computed_tokens for t in self.turns],
                "turn_completion_tokens": [len(t.token_ids) for t in self.turns],
                "turn_token_ids": [t.token_ids for t in self.turns],
                "turn_finish_reasons": [t.finish_reason for t in self.turns],
                "turn_spec_rounds": [len(t.per_round) if t.per_round is not None else None for t in self.turns],
                "turn_spec_accepted": [sum(t.per_round) if t.per_round is not None else None for t in self.turns],
                "tool_calls": sum(t.tool_calls for t in self.turns),
                "tool_errors": sum(t.tool_errors for t in self.turns),
                "conversation_end": self.end}
