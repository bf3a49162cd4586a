"""One sample being generated: its pages, tokens, drafts and counters (host-side bookkeeping)."""

from __future__ import annotations

import dataclasses
import time

from dflash_batch.engine.request import Completion, Logprobs, Request, SpecCounters


class Sequence:
    def __init__(self, request: Request, pages: list[int], block_size: int, row: int):
        self.request = request
        self.row = row                     # its batch row, and its recurrent-state slot (hybrid targets)
        self.params = request.params
        self.prompt = request.prompt_ids
        self.pages = pages
        self.prefilled = 0                 # prompt tokens whose target K/V is written
        # Sequences with the same prompt that wait for this one's prefill and copy it (engine.py).
        self.followers: list[Sequence] = []
        self._start_turn(block_size)

    def _start_turn(self, block_size: int) -> None:
        """What a sample (or a conversation's turn) counts from its start."""
        self.cached = 0                    # prompt tokens taken from a shared head or a forked prefill
        self.computed = 0                  # prompt tokens the target ran for this sequence
        self.tokens: list[int] = []        # generated tokens; the last one is the next anchor
        self.spec = SpecCounters(block_size) if block_size > 1 else None
        self.matcher = self.request.grammar() if self.request.grammar is not None else None  # structured output
        self.logprobs = Logprobs() if self.params.logprobs is not None else None
        self.prompt_logprobs = Logprobs() if self.params.prompt_logprobs is not None else None
        if self.prompt_logprobs is not None:
            self.prompt_logprobs.add(None, None, None)  # nothing predicts the first prompt token
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.text: str | None = None       # set when a stop string cut the output
        self.cut_by_stop_string = False    # tokens a round kept were cut on the host (past the recurrent state)
        self.error_type: str | None = None
        self.error: str | None = None
        self.t_admit = time.monotonic()
        self.t_first: float | None = None

    def next_turn(self, opening: list[int], block_size: int) -> None:
        """Go on with the conversation in this row: the prompt becomes the history (prompt and
        generated tokens) and the next turn's `opening`; the caches hold every position before
        the anchor (engine/turns.py checks it), so only the anchor and the opening are prefilled."""
        self.prefilled = self.position
        self.prompt = self.prompt + self.tokens + opening
        self.request = dataclasses.replace(self.request, prompt_ids=self.prompt)  # a retry starts here
        self._start_turn(block_size)

    @property
    def position(self) -> int:
        """Position of the anchor (the last generated token): how many tokens have committed K/V."""
        return len(self.prompt) + len(self.tokens) - 1

    def append(self, new: list[int]) -> int:
        """Add a round's tokens, cut at a stop token or max_new_tokens; returns how many were kept."""
        room = self.params.max_new_tokens - len(self.tokens)
        kept = new[:room]
        for i, t in enumerate(kept):
            if t in self.params.stop_token_ids:
                kept = kept[:i + 1]
                self.finish_reason, self.stop_reason = "stop", str(t)
                break
        self.tokens += kept
        if self.finish_reason is None and len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return len(kept)

    @property
    def plain_greedy(self) -> bool:
        """Its next token is the argmax of the target's own logits (engine.py's fast path)."""
        return self.params.plain_greedy and self.matcher is None

    def check_stop_strings(self, decode, checked_tokens: int) -> None:
        """Cut the output before the first stop string that the tokens since `checked_tokens`
        completed; the tokens are cut after the one that completed it."""
        stops = self.params.stop
        if not stops:
            return
        for k in range(max(checked_tokens, 1), len(self.tokens) + 1):
            text = decode(self.tokens[:k])
            hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
            if hits:
                i, s = min(hits)
                self.cut_by_stop_string = len(self.tokens) > k
                self.tokens = self.tokens[:k]
                self.text, self.finish_reason, self.stop_reason = text[:i], "stop", s
                return

    def fail(self, error_type: str, error: str) -> None:
        """This request failed on its own (the rest of its batch goes on): an error row."""
        self.finish_reason, self.error_type, self.error, self.text = "error", error_type, error, ""

    def completion(self, decode) -> Completion:
        now = time.monotonic()
        if self.text is None:
            ends_on_stop_token = self.finish_reason == "stop"
            self.text = decode(self.tokens[:-1] if ends_on_stop_token else self.tokens)
        ok = self.finish_reason != "error"
        return Completion(key=self.request.key, token_ids=self.tokens, text=self.text,
                          finish_reason=self.finish_reason, stop_reason=self.stop_reason, spec=self.spec,
                          ttft_s=(self.t_first or now) - self.t_admit, latency_s=now - self.t_admit,
                          error_type=self.error_type, error=self.error, cached_tokens=self.cached,
                          computed_tokens=self.computed,
                          # a stop string may have cut tokens the round had scored
                          logprobs=self.logprobs.cut(len(self.tokens)) if ok and self.logprobs else None,
                          prompt_logprobs=self.prompt_logprobs if ok else None)
