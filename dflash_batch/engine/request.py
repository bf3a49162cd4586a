"""The engine's doorstep: requests in, finished completions out.

The runner knows files, rows and buckets; the engine knows only these values. Any engine (the
real one, or a test double) implements `Engine.generate`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from dflash_batch.plan.buckets import Bucket

RequestKey = tuple[str, int]  # (row_id, sample_index)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()   # already includes EOS unless ignore_eos
    seed: int = 0                          # this sample's own seed
    min_p: float = 0.0
    min_tokens: int = 0                    # stop ids are held back until this many tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    repetition_penalty: float = 1.0        # engine/sampling.py's penalize_ defines the three
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None            # top logprobs per generated token (None: none, 0: its own only)
    prompt_logprobs: int | None = None     # the same for each prompt token after the first

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the target's own logits: no sampling, no bias, penalty or held stop ids."""
        return self.temperature <= 0 and not self.min_tokens and not self.logit_bias and not self.penalized


@dataclass(slots=True)
class Logprobs:
    """Per token: its logprob and the top-k (id, logprob) of the target's distribution at its
    position, log_softmax(logits / temperature) (temperature 0 counts as 1), before logit bias,
    penalties and filters."""

    token: list[float | None] = field(default_factory=list)
    top_ids: list[list[int] | None] = field(default_factory=list)
    top: list[list[float] | None] = field(default_factory=list)

    def add(self, token: float | None, top_ids: list[int] | None, top: list[float] | None) -> None:
        self.token.append(token)
        self.top_ids.append(top_ids)
        self.top.append(top)

    def cut(self, n: int) -> Logprobs:
        return Logprobs(self.token[:n], self.top_ids[:n], self.top[:n])


class Matcher(Protocol):
    """A grammar's state along one sample's tokens (xgrammar's GrammarMatcher is one)."""

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> Any:
        """Row `index` of an int32 [rows, ceil(vocab / 32)] CPU tensor: bit t set iff token t may come next."""

    def accept_token(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool: ...


class Turns(Protocol):
    """A conversation's host side (conversation.py): what follows each of its turns."""

    def ended(self, turn: Completion) -> Future[list[int] | None]:
        """The tokens that open the next turn after this turn's own (the chat template's end of
        turn, tool results, the next user message, the assistant's header), or None: the
        conversation is over. The future may be completed on another thread (a tool call)."""
        ...


@dataclass(slots=True)
class Request:
    key: RequestKey
    prompt_ids: list[int]
    params: SamplingParams
    grammar: Callable[[], Matcher] | None = None  # structured output: a fresh matcher per attempt
    turns: Turns | None = None  # a conversation: its later turns go on from this request's caches


@dataclass(slots=True)
class SpecCounters:
    """Per-sequence speculation record, a round at a time, in order: the drafts each verify
    round accepted (the last round counts only the tokens kept before a stop or max_new_tokens)
    and the drafts it verified (fewer than block_size - 1 when a schedule verifies k of them;
    engine.py says how the last round counts)."""

    block_size: int
    per_round: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)

    def add(self, accepted: int, verified: int) -> None:
        self.per_round.append(accepted)
        self.verified.append(verified)

    @property
    def rounds(self) -> int:
        return len(self.per_round)

    @property
    def accepted(self) -> int:
        return sum(self.per_round)

    @property
    def drafts_verified(self) -> int:
        return sum(self.verified)

    @property
    def histogram(self) -> list[int]:
        """histogram[n] = rounds in which n drafts were accepted, n = 0..block_size-1."""
        return self._count(self.per_round)

    @property
    def verified_histogram(self) -> list[int]:
        """verified_histogram[n] = rounds that verified n drafts, n = 0..block_size-1."""
        return self._count(self.verified)

    def _count(self, values: list[int]) -> list[int]:
        hist = [0] * self.block_size
        for n in values:
            hist[n] += 1
        return hist


@dataclass(slots=True)
class Completion:
    key: RequestKey
    token_ids: list[int]
    text: str
    finish_reason: str             # "stop" | "length" | "error"
    stop_reason: str | None        # the stop string, or the stop token id as text
    spec: SpecCounters | None      # None when the bucket ran without a drafter
    ttft_s: float                  # admission -> first token
    latency_s: float               # admission -> finished
    error_type: str | None = None  # why this request failed (finish_reason "error"); others go on
    error: str | None = None
    logprobs: Logprobs | None = None         # one per generated token (sampling.logprobs)
    prompt_logprobs: Logprobs | None = None  # one per prompt token, None at the first
    cached_tokens: int = 0         # prompt tokens taken from a shared head or a sample's forked prefill
    computed_tokens: int = 0       # prompt tokens the target ran for it (a conversation's turn: the new ones)
    # A conversation whose next turn did not fit the bucket: that turn's whole prompt (the history
    # and its opening), for a larger bucket to prefill.
    next_prompt: list[int] | None = None


class Engine(Protocol):
    vocab_size: int | None  # prompts with ids outside it become error rows

    def generate(self, requests: Iterable[Request], bucket: Bucket) -> Iterator[Completion]:
        """Decode requests with continuous batching; yield each as it finishes."""
        ...
