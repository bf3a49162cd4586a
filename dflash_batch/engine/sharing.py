"""Samples of one prompt (engine.share_prompts): a sequence admitted while another with the same
prompt (and the same prompt logprobs asked) is prefilling follows it: it waits, then forks from
that prefill (cache slots, recurrent state, and its first token drawn from the same logits)
and never runs the prompt itself. Prompts that only begin alike share a head instead
(plan/heads.py, engine/heads.py).
"""

from __future__ import annotations

from dflash_batch.engine.sequence import Sequence


class PromptIndex:
    def __init__(self) -> None:
        self.leaders: dict[tuple[int, ...], Sequence] = {}  # prompt -> the sequence prefilling it

    def leader(self, seq: Sequence) -> Sequence | None:
        """The sequence prefilling this prompt that `seq` can follow."""
        lead = self.leaders.get(tuple(seq.prompt))
        same = lead is not None and lead.params.prompt_logprobs == seq.params.prompt_logprobs
        return lead if same else None

    def add(self, seq: Sequence) -> None:
        """A sequence that runs its prompt: one with this prompt admitted meanwhile may follow it."""
        self.leaders.setdefault(tuple(seq.prompt), seq)

    def prefilled(self, seq: Sequence) -> None:
        """Its prefill is done (or it left): nothing can follow it any more."""
        if self.leaders.get(tuple(seq.prompt)) is seq:
            del self.leaders[tuple(seq.prompt)]
