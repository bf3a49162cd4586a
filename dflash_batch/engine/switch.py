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
    off: bool = False  # set by the engine once it has switched

    def record(self, accepted: list[int]) -> bool:
        """Add one round's accepted drafts (one entry per sequence); True when speculation should
        stop: a full window whose acceptance length is below the threshold."""
        for n in accepted:
            self.recent.append(n)
            self.accepted += n
            if len(self.recent) > self.rounds:
                self.accepted -= self.recent.popleft()
        return not self.off and len(self.recent) >= self.rounds and self.acc_len < self.min_acc_len

    def restart(self) -> None:
        """Measure a whole window again (after a switch that could not be made)."""
        self.recent.clear()
        self.accepted = 0

    @property
    def acc_len(self) -> float:
        """1 + accepted drafts per sequence-round, over the window."""
        return 1 + self.accepted / max(len(self.recent), 1)
