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

k(n) = argmax over k of E(k) / cost(n, k). Under per-row draft counts (engine/row_drafts.py, auto's
default) k = 0 still means target-only rounds; otherwise each row verifies its own number, chosen
from the same cost table (`curve`). Until `explore` sequence-rounds have been seen every
round verifies the whole block, so each position is measured; a drafter that does not pay even
by an optimistic estimate is turned off sooner. Every rank sees the same rounds but times its
own: rank 0 decides and the group follows (engine.py, parallel.agreed). A pinned bucket
(`speculation: {drafts: K}`) and an always-on one (k = block - 1) keep the same record, for the
stats.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from dflash_batch.engine.row_drafts import Calibration, seconds_at

EXPLORE = 32  # sequence-rounds verified at the whole block before any decision
EARLY = 8  # ... unless after this many even an optimistic estimate says the drafts pay nowhere
REFRESH = 0.2  # weight of a round's own time in its batch size's correction
NOWHERE = -1  # a round's plan: the drafts pay at no batch size (Schedule.plan)


@dataclass
class Acceptance:
    """Per-position acceptance over sliding windows of trials. A position's window is a queue of
    rounds, [trials, hits] each; the sequences of one round are simultaneous, so the window drops
    a round's trials as if its hits came first."""
    drafts: int  # the block's drafts, B - 1
    window: int
    rounds: list[deque] = field(init=False)  # per position: [trials, hits] of each round, oldest first
    tried: list[int] = field(init=False)     # per position: trials in its window
    hits: list[int] = field(init=False)      # ... and the accepted among them

    def __post_init__(self) -> None:
        self.rounds = [deque() for _ in range(self.drafts)]
        self.tried = [0] * self.drafts
        self.hits = [0] * self.drafts

    def record(self, accepted: list[int], verified: list[int]) -> None:
        """One round: sequence i verified verified[i] drafts and kept accepted[i] of them, a trial
        of positions 1 .. min(accepted[i] + 1, verified[i]), accepted at the first accepted[i]."""
        trials, hits = [0] * self.drafts, [0] * self.drafts
        for a, v in zip(accepted, verified):
            for j in range(min(a + 1, v)):
                trials[j] += 1
                hits[j] += j < a
        for j, t in enumerate(trials):
            if t:
                self._add(j, t, hits[j])

    def _add(self, j: int, trials: int, hits: int) -> None:
        rounds = self.rounds[j]
        rounds.append([trials, hits])
        self.tried[j] += trials
        self.hits[j] += hits
        while self.tried[j] > self.window:  # drop the oldest trials, a round's hits first
            oldest = rounds[0]
            drop = min(oldest[0], self.tried[j] - self.window)
            dropped_hits = min(drop, oldest[1])
            oldest[0] -= drop
            oldest[1] -= dropped_hits
            self.tried[j] -= drop
            self.hits[j] -= dropped_hits
            if not oldest[0]:
                rounds.popleft()

    @property
    def samples(self) -> int:
        """Trials of the first draft (one per sequence-round that verified any), up to the window."""
        return self.tried[0] if self.drafts else 0

    def rates(self) -> list[float | None]:
        """P(draft j accepted | drafts before it accepted), j = 1 .. B - 1 (None: never tried)."""
        return [h / t if t else None for h, t in zip(self.hits, self.tried)]

    def expected(self, optimistic: bool = False) -> list[float]:
        """Tokens a round yields verifying k drafts, for k = 0 .. B - 1: 1 + sum over j <= k of
        P(first j accepted). `optimistic`: each rate as if the next trial were accepted,
        (hits + 1) / (trials + 1), and a position never tried as likely as the one before it."""
        out, total, chain, rate = [1.0], 1.0, 1.0, 1.0
        for h, t in zip(self.hits, self.tried):
            if optimistic:
                rate = (h + 1) / (t + 1) if t else rate
            else:
                rate = h / t if t else 0.0
            chain *= rate
            total += chain
            out.append(total)
        return out

    def expected_tokens(self, k: int) -> float:
        return self.expected()[k]


class Schedule:
    """One bucket's record: acceptance by position, the cost table and the k chosen over time.
    `pinned`: k for every round (None: decided by batch size, auto)."""

    def __init__(self, block: int, sizes: list[int], window: int, pinned: int | None, min_acc_len: float = 1.0,
                 per_row: bool = False):
        """`per_row`: (auto) each row of a round verifies the drafts worth it (engine/row_drafts.py)."""
        self.block, self.sizes, self.pinned = block, sorted(sizes), pinned
        self.calibration = Calibration() if per_row else None
        self.verified: dict[str, Counter] = {"one k": Counter(), "per row": Counter()}  # drafts a sequence-round
        self.kept = {"one k": 0, "per row": 0}  # drafts accepted, in those sequence-rounds
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

    def curve(self, n: int, corrected: bool = True) -> tuple[int, list[float]]:
        """The cost curve of a round of n rows: its table size and the seconds of a round of that
        many rows at k = 1 .. B - 1 drafts each (each drafts; k = 0 does not), never falling as k
        grows (a 2-core timing is noisy). `corrected`: with the size's correction (what the
        rounds run took beyond the table)."""
        size = self.size_of(n)
        shift = self.correction.get(size, 0.0) if corrected else 0.0
        return size, list(accumulate((c + shift for c in self.costs[size][1:]), max))

    @property
    def exploring(self) -> bool:
        """Still measuring: every round verifies the whole block (a per-row round every draft)."""
        return not self.costs or self.acceptance.samples < self.explore

    # -- deciding ------------------------------------------------------------------------------
    def drafts(self, n: int) -> int:
        """How many drafts the round of n rows verifies."""
        if self.pinned is not None:
            return self.pinned
        if self.exploring:
            return self.block - 1
        return self.best(self.size_of(n))

    def plan(self, n: int) -> int:
        """The round of n rows' k, or NOWHERE: the drafts pay at no batch size, so it verifies
        none and the bucket stops speculating after it. One number, so that under TP one
        broadcast makes rank 0's plan the group's (each rank timed its own rounds)."""
        return NOWHERE if self.pays_nowhere() else self.drafts(n)

    def why_stop(self, nowhere: bool) -> str | None:
        """Why an auto bucket stops speculating after this round (None: it goes on): the whole
        block's acceptance length below the floor, or (`nowhere`, the round's plan) drafts that
        pay at no batch size."""
        full = self.acceptance.expected_tokens(self.block - 1)
        if self.below_floor():
            return f"acc_len {full:.2f} over the last {self.acceptance.samples} sequence-rounds < {self.min_acc_len}"
        if nowhere:
            return f"the drafts pay at no batch size (acc_len {full:.2f} at the whole block, round costs timed here)"
        return None

    def best(self, size: int, optimistic: bool = False) -> int:
        """The k with the most expected tokens per second at this size (the smaller k on a tie)."""
        tokens = self.acceptance.expected(optimistic)
        rate = [tokens[k] / self.cost(size, k) for k in range(self.block)]
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

    def forget_run(self) -> None:
        """All but the cost table: a later run learns its acceptance and its rounds anew."""
        self.restart()
        self.off = False
        if self.calibration is not None:
            self.calibration = Calibration()
        for mode in self.verified:
            self.verified[mode].clear()
            self.kept[mode] = 0
        self.correction.clear()
        self.rounds.clear()
        self.changes.clear()
        self.total_rounds, self.k = 0, None

    def pays_nowhere(self) -> bool:
        """Measured, no batch size gains from the drafts: the smallest would verify none (while
        exploring: not even by an optimistic estimate, after EARLY sequence-rounds)."""
        if self.pinned is not None or not self.costs or self.acceptance.samples < min(EARLY, self.explore):
            return False
        return self.best(self.sizes[0], optimistic=self.acceptance.samples < self.explore) == 0

    def record(self, n: int, k: int, seconds: float, accepted: list[int], verified: list[int],
               per_row: bool = False, drafts: int | None = None) -> None:
        """A round of n rows verified k drafts a sequence (`per_row`: each row those worth it,
        engine/row_drafts.py) in `seconds`; `accepted`, `verified`: the drafts each sequence kept
        and verified, of those whose round was not cut by their end; `drafts`: an eager per-row
        round's drafts verified in all (its cost follows them along the curve), None: the cost
        is the table's at k (a captured round's shape)."""
        size = self.size_of(n)
        by_k = self.rounds.setdefault(size, {})
        by_k[k] = by_k.get(k, 0) + 1
        if k != self.k:
            self.changes.append((self.total_rounds, size, k))
            self.k = k
        self.total_rounds += 1
        self.acceptance.record(accepted, verified)
        mode = "per row" if per_row else "one k"
        self.verified[mode].update(verified)
        self.kept[mode] += sum(accepted)
        if size in self.costs:
            predicted = self.costs[size][k] if drafts is None else float(
                seconds_at(torch.tensor(drafts), size, torch.tensor(self.curve(n, corrected=False)[1])))
            miss = seconds - predicted
            self.correction[size] = (1 - REFRESH) * self.correction.get(size, miss) + REFRESH * miss

    def stats(self) -> dict:
        """What the run's stats keep of it (times in milliseconds)."""
        rates = self.acceptance.rates()
        return {
            "block_size": self.block, "mode": "auto" if self.pinned is None else f"drafts {self.pinned}",
            "acceptance_by_position": rates, "trials_by_position": list(self.acceptance.tried),
            "expected_tokens": self.acceptance.expected(),
            "cost_ms": {str(s): [round(1e3 * self.cost(s, k), 3) for k in range(self.block)] for s in self.costs},
            "rounds_by_k": {str(s): {str(k): c for k, c in sorted(by.items())} for s, by in sorted(self.rounds.items())},
            "changes": self.changes[-200:],  # (round, batch size, k): the last 200
            "per_row": self.calibration is not None,
            # Sequence-rounds by the drafts they verified, and drafts verified per draft kept, of
            # the rounds with one k (exploring, pinned, or per_row off) and of per-row rounds.
            "drafts_verified": {mode: {str(k): c for k, c in sorted(by.items())} for mode, by in self.verified.items()},
            "verified_per_kept": {mode: round(sum(k * c for k, c in by.items()) / self.kept[mode], 3)
                                  if self.kept[mode] else None for mode, by in self.verified.items()},
            "calibration": None if self.calibration is None else [round(r, 3) for r in self.calibration.rates()],
        }
