"""How many drafts a round verifies, by batch size (`speculation: auto`), from what a round costs
here and what the drafter's proposals have been worth.

A round that verifies k of the block's drafts runs the target over k + 1 rows a sequence. While
the batch is small the target is bound by reading its weights and the extra rows are almost
free; in a large batch it is bound by compute and they cost nearly their share, so the k that
yields the most tokens per second falls as the batch grows (and is 0, target-only, where the
drafts no longer pay). The decision needs two measurements:

- cost: the seconds a round takes at each batch size (the padded sizes rounds run at) and each
  k, timed on this device when the bucket starts (a round of padding rows for each pair) and
  refreshed by every round that runs: a round's own time moves its batch size's costs by the
  difference from the table (longer context, sampling, the host's share of a round);
- worth: the chance that draft j is accepted given the j - 1 before it were, per position, over
  the last `window` trials of that position (a round that verified k drafts and accepted a of
  them is a trial of positions 1 .. min(a + 1, k)). With k drafts verified a round yields
  E(k) = 1 + sum over j <= k of P(drafts 1..j all accepted) tokens.

k(n) = argmax over k of E(k) / cost(n, k). Until `explore` sequence-rounds have been seen every
round verifies the whole block, so each position is measured; a drafter that does not pay even
by an optimistic estimate is turned off sooner. Every rank sees the same rounds but times its
own: rank 0 decides and the group follows (engine.py, parallel.agreed). A pinned bucket
(`speculation: {drafts: K}`) and an always-on one (k = block - 1) keep the same record, for the
stats.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

EXPLORE = 32  # sequence-rounds verified at the whole block before any decision
EARLY = 8  # ... unless after this many even an optimistic estimate says the drafts pay nowhere
REFRESH = 0.2  # weight of a round's own time in its batch size's correction


@dataclass
class Acceptance:
    """Per-position acceptance over sliding windows of trials."""
    drafts: int  # the block's drafts, B - 1
    window: int
    trials: list[deque] = field(init=False)
    hits: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.trials = [deque() for _ in range(self.drafts)]
        self.hits = [0] * self.drafts

    def record(self, accepted: int, verified: int) -> None:
        """One sequence-round that verified `verified` drafts and accepted `accepted` of them."""
        for j in range(min(accepted + 1, verified)):
            hit = int(j < accepted)
            self.trials[j].append(hit)
            self.hits[j] += hit
            if len(self.trials[j]) > self.window:
                self.hits[j] -= self.trials[j].popleft()

    @property
    def samples(self) -> int:
        """Trials of the first draft (one per sequence-round that verified any), up to the window."""
        return len(self.trials[0]) if self.drafts else 0

    def rates(self) -> list[float | None]:
        """P(draft j accepted | drafts before it accepted), j = 1 .. B - 1 (None: never tried)."""
        return [h / len(t) if t else None for h, t in zip(self.hits, self.trials)]

    def expected_tokens(self, k: int, optimistic: bool = False) -> float:
        """Tokens a round yields verifying k drafts: 1 + sum over j <= k of P(first j accepted).
        `optimistic`: each rate as if the next trial were accepted, (hits + 1) / (trials + 1), and
        a position never tried as likely as the one before it."""
        total, chain, rate = 1.0, 1.0, 1.0
        for h, t in list(zip(self.hits, self.trials))[:k]:
            if optimistic:
                rate = (h + 1) / (len(t) + 1) if t else rate
            else:
                rate = h / len(t) if t else 0.0
            chain *= rate
            total += chain
        return total


class Schedule:
    """One bucket's record: acceptance by position, the cost table and the k chosen over time.
    `pinned`: k for every round (None: decided by batch size, auto)."""

    def __init__(self, block: int, sizes: list[int], window: int, pinned: int | None, min_acc_len: float = 1.0):
        self.block, self.sizes, self.pinned = block, sorted(sizes), pinned
        self.window, self.min_acc_len = window, min_acc_len
        self.acceptance = Acceptance(block - 1, window)
        self.explore = min(EXPLORE, window)
        self.off = False  # set by the engine once an auto bucket has stopped speculating
        self.costs: dict[int, list[float]] = {}  # size -> seconds of a round at k = 0 .. B - 1
        self.correction: dict[int, float] = {}   # size -> seconds the rounds run took beyond the table
        self.rounds: dict[int, dict[int, int]] = {}  # size -> k -> rounds run
        self.changes: list[tuple[int, int, int]] = []  # (round, size, k) whenever k changed
        self.total_rounds = 0
        self.k: int | None = None  # the last round's

    # -- measuring -----------------------------------------------------------------------------
    def time_rounds(self, run: Callable[[int, int], float]) -> None:
        """Fill the cost table: run(size, width) times one round of padding rows (seconds, the
        device synchronised). Each pair is run once untimed, then the faster of two timings."""
        for size in self.sizes:
            run(size, self.block)  # the first round at a size allocates what later ones reuse
            self.costs[size] = [min(run(size, k + 1) for _ in range(2)) for k in range(self.block)]

    def size_of(self, n: int) -> int:
        """The table's batch size for a round of n rows: the smallest at or above it."""
        return next((s for s in self.sizes if s >= n), self.sizes[-1])

    def cost(self, size: int, k: int) -> float:
        return self.costs[size][k] + self.correction.get(size, 0.0)

    # -- deciding ------------------------------------------------------------------------------
    def drafts(self, n: int) -> int:
        """How many drafts the round of n rows verifies."""
        if self.pinned is not None:
            return self.pinned
        if not self.costs or self.acceptance.samples < self.explore:
            return self.block - 1
        return self.best(self.size_of(n))

    def best(self, size: int, optimistic: bool = False) -> int:
        """The k with the most expected tokens per second at this size (the smaller k on a tie)."""
        rate = [self.acceptance.expected_tokens(k, optimistic) / self.cost(size, k) for k in range(self.block)]
        return max(range(self.block), key=lambda k: (rate[k], -k))

    def below_floor(self) -> bool:
        """An auto bucket's whole-block acceptance length, over a full window, is below
        min_acc_len (`engine.auto_speculation`). Where every round verified the whole block this
        is the window's own 1 + accepted / sequence-rounds (rounds cut by a sequence's end left out)."""
        return (self.pinned is None and self.acceptance.samples >= self.window
                and self.acceptance.expected_tokens(self.block - 1) < self.min_acc_len)

    def restart(self) -> None:
        """Measure the acceptance again from nothing (after a switch that could not be made)."""
        self.acceptance = Acceptance(self.block - 1, self.window)

    def pays_nowhere(self) -> bool:
        """Measured, no batch size gains from the drafts: the smallest would verify none (while
        exploring: not even by an optimistic estimate, after EARLY sequence-rounds)."""
        if self.pinned is not None or not self.costs or self.acceptance.samples < min(EARLY, self.explore):
            return False
        return self.best(self.sizes[0], optimistic=self.acceptance.samples < self.explore) == 0

    def record(self, n: int, k: int, seconds: float, accepted: list[int]) -> None:
        """A round of n rows verified k drafts in `seconds`; `accepted`: the drafts each sequence
        kept, of those whose round was not cut by their end."""
        size = self.size_of(n)
        by_k = self.rounds.setdefault(size, {})
        by_k[k] = by_k.get(k, 0) + 1
        if k != self.k:
            self.changes.append((self.total_rounds, size, k))
            self.k = k
        self.total_rounds += 1
        for a in accepted:
            self.acceptance.record(a, k)
        if size in self.costs:
            miss = seconds - self.costs[size][k]
            self.correction[size] = (1 - REFRESH) * self.correction.get(size, miss) + REFRESH * miss

    def stats(self) -> dict:
        """What the run's stats keep of it (times in milliseconds)."""
        rates = self.acceptance.rates()
        return {
            "block_size": self.block, "mode": "auto" if self.pinned is None else f"drafts {self.pinned}",
            "acceptance_by_position": rates, "trials_by_position": [len(t) for t in self.acceptance.trials],
            "expected_tokens": [self.acceptance.expected_tokens(k) for k in range(self.block)],
            "cost_ms": {str(s): [round(1e3 * self.cost(s, k), 3) for k in range(self.block)] for s in self.costs},
            "rounds_by_k": {str(s): {str(k): c for k, c in sorted(by.items())} for s, by in sorted(self.rounds.items())},
            "changes": self.changes[-200:],  # (round, batch size, k): the last 200
        }
