"""Prompt sharing (engine.share_prompts): where a new sequence can take its prompt's cache from.

    follow  a sequence prefilling the same prompt (and asking for the same prompt logprobs): the
            new one waits, then forks from that prefill (cache slots, recurrent state, and its
            first token drawn from the same logits) and never runs the prompt itself;
    copy    an active sequence whose prefill has passed a common prefix: before its first chunk
            the new one copies that prefix's cache slots and prefills the rest (and waits while
            an earlier sequence is still prefilling the prefix). A prompt equal to a prefilled
            one copies all but its last token (whose logits the first token needs).
            Attention-only targets: a recurrent state has moved past the prefix and cannot be
            rewound to it.

Prefixes are found through chained hashes of GRAIN-token blocks of each active prompt, checked
token by token before a copy. A sequence leaves the index when it leaves the batch: its row's
pages may then be rewritten.
"""

from __future__ import annotations

import itertools

from dflash_batch.engine.sequence import Sequence

GRAIN = 64  # prompt tokens per block of the prefix index


def block_keys(prompt: list[int]) -> list[int]:
    """keys[i] identifies prompt[:(i + 1) * GRAIN] (a hash chained over its blocks)."""
    keys, h = [], 0
    for end in range(GRAIN, len(prompt) + 1, GRAIN):
        h = hash((h, tuple(prompt[end - GRAIN:end])))
        keys.append(h)
    return keys


class PromptIndex:
    def __init__(self) -> None:
        self.leaders: dict[tuple[int, ...], Sequence] = {}       # prompt -> the sequence prefilling it
        self.whole: dict[tuple[int, ...], list[Sequence]] = {}   # prompt -> active sequences
        self.blocks: dict[int, list[Sequence]] = {}              # block key -> active sequences
        self.keys: dict[int, list[int]] = {}                     # id(sequence) -> its block keys
        self.order: dict[int, int] = {}                          # id(sequence) -> admission order
        self.admitted = itertools.count()

    def leader(self, seq: Sequence) -> Sequence | None:
        """The sequence prefilling this prompt that `seq` can follow."""
        lead = self.leaders.get(tuple(seq.prompt))
        same = lead is not None and lead.params.prompt_logprobs == seq.params.prompt_logprobs
        return lead if same else None

    def add(self, seq: Sequence, prefills: bool) -> None:
        """An active sequence; `prefills`: it runs its prompt (a sequence with this prompt may follow)."""
        key = tuple(seq.prompt)
        if prefills:
            self.leaders.setdefault(key, seq)
        self.whole.setdefault(key, []).append(seq)
        self.keys[id(seq)] = block_keys(seq.prompt)
        self.order[id(seq)] = next(self.admitted)
        for k in self.keys[id(seq)]:
            self.blocks.setdefault(k, []).append(seq)

    def prefilled(self, seq: Sequence) -> None:
        """Its prefill is done: nothing can follow it any more (it can still be copied)."""
        if self.leaders.get(tuple(seq.prompt)) is seq:
            del self.leaders[tuple(seq.prompt)]

    def remove(self, seq: Sequence) -> None:
        if id(seq) not in self.keys:
            return
        self.prefilled(seq)
        del self.order[id(seq)]
        for table, key in ((self.whole, tuple(seq.prompt)), *((self.blocks, k) for k in self.keys.pop(id(seq)))):
            table[key].remove(seq)
            if not table[key]:
                del table[key]

    def source(self, seq: Sequence) -> tuple[Sequence, int] | None:
        """An active sequence `seq` can copy its prompt's first k cache slots from, and k (k <
        len(prompt)): the same prompt prefilled, else the longest shared prefix in blocks (not
        when `seq` asks for prompt logprobs: the copied rows' logits would be missing)."""
        n = len(seq.prompt)
        for other in self.whole.get(tuple(seq.prompt), ()):
            if other is not seq and other.prefilled == n and other.params.prompt_logprobs == seq.params.prompt_logprobs:
                return other, n - 1
        if seq.params.prompt_logprobs is not None:
            return None
        keys = self.keys[id(seq)]
        for i in reversed(range(len(keys))):
            end = (i + 1) * GRAIN
            for other in self.blocks.get(keys[i], ()):
                if other is not seq and other.prefilled >= end and other.prompt[:end] == seq.prompt[:end]:
                    return other, min(end, n - 1)
        return None

    def waits(self, seq: Sequence) -> bool:
        """`seq` has not started and an earlier sequence is still prefilling a head they share:
        waiting lets it copy that head rather than compute it too."""
        keys = self.keys.get(id(seq))
        if seq.prefilled or not keys:
            return False
        for other in self.blocks.get(keys[0], ()):
            if other is seq or self.order[id(other)] > self.order[id(seq)] or other.prefilled >= len(other.prompt):
                continue
            theirs = self.keys[id(other)]
            shared = next((i for i, (a, b) in enumerate(zip(keys, theirs)) if a != b), min(len(keys), len(theirs)))
            if other.prefilled < shared * GRAIN:
                return True
        return False
