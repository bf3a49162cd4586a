"""Whether compiling a bucket's decode round pays (torch.compile, the CPU path).

Compiling costs tens of seconds before the next round and then saves a part of every round. A
bucket starts eagerly and times its first rounds; from their seconds and tokens a round, and
the tokens its requests may still ask for, it estimates what the rounds left would save and
compiles only if that exceeds what compiling costs. A job whose rows fit a few rounds never
compiles; a long one compiles after a few eager rounds. Once a round has been compiled in the
process the cost is paid, and later buckets use it from their first round.

The two constants were measured by benchmarks/startup.py (a tiny Qwen3 target on 2 cores,
cold cache): compiling took 41 s and saved 21% of an eager round (11.2 ms -> 8.8 ms at batch
24). A cache that already holds the round (engine.cache_dir) makes compiling cheaper than
this; the estimate stays on the side of not compiling.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Sized

from dflash_batch.engine.request import Request

COMPILE_SECONDS = 41.0
SAVED_FRACTION = 0.21
TIMED_ROUNDS = 8


class CompileWhenItPays:
    """Fed every eager round of a bucket; `verdict` says when to compile (and why not)."""

    def __init__(self, requests: Iterable[Request]):
        # Requests handed over as a stream cannot be counted: they compile at once.
        self.tokens_left = sum(r.params.max_new_tokens for r in requests) if isinstance(requests, Sized) else None
        self.rounds, self.seconds, self.tokens = 0, 0.0, 0

    def record(self, seconds: float, tokens: int) -> None:
        """An eager round took `seconds` and emitted `tokens` over its sequences."""
        self.rounds, self.seconds, self.tokens = self.rounds + 1, self.seconds + seconds, self.tokens + tokens

    def verdict(self) -> tuple[bool, str] | None:
        """None while the first rounds are timed; then (compile, why)."""
        if self.tokens_left is None:
            return True, "the requests came as a stream (not counted)"
        if self.rounds < TIMED_ROUNDS:
            return None
        left = max(self.tokens_left - self.tokens, 0)
        rounds_left = left * self.rounds / max(self.tokens, 1)
        round_s = self.seconds / self.rounds
        saved = rounds_left * round_s * SAVED_FRACTION
        why = (f"at most ~{rounds_left:.0f} rounds left of {round_s * 1e3:.1f} ms would save ~{saved:.0f} s, "
               f"compiling costs ~{COMPILE_SECONDS:.0f} s")
        return saved > COMPILE_SECONDS, why
