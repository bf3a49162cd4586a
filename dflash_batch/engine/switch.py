"""Speculation per bucket, decided by what it yields (`speculation: auto`).

Speculation pays only while the drafter's proposals are accepted often enough: at long context
or on text unlike the drafter's training data a round's extra cost (the draft, a B-row verify)
may buy less than one token. An auto bucket speculates until the acceptance length over its
last `rounds` sequence-rounds (one per running sequence per round) falls below `min_acc_len`;
it then decodes target-only for the rest of the run, as if configured `speculation: false`.
Every rank sees the same rounds and decides the same.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class AutoSpeculation:
    min_acc_len: float
    rounds: int
    recent: deque = field(default_factory=deque)  # drafts accepted in each of the last sequence-rounds
    accepted: int = 0  # their sum
    seen: int = 0      # sequence-rounds recorded in all
    off: bool = False

    def record(self, accepted: list[int]) -> bool:
        """Add one round's accepted drafts (one entry per sequence); True when this round turns
        speculation off."""
        for n in accepted:
            self.recent.append(n)
            self.accepted += n
            if len(self.recent) > self.rounds:
                self.accepted -= self.recent.popleft()
        self.seen += len(accepted)
        if self.off or len(self.recent) < self.rounds or self.acc_len >= self.min_acc_len:
            return False
        self.off = True
        return True

    @property
    def acc_len(self) -> float:
        """1 + accepted drafts per sequence-round, over the window."""
        return 1 + self.accepted / max(len(self.recent), 1)
