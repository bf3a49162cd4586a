"""Per-row draft counts: each row of a round verifies only the drafts worth verifying.

Every draft a round verifies costs the target a row of its forward, accepted or not. Rows differ:
the drafter is sure of a code row's whole block and unsure of a story's second draft. The drafter
says so itself: its probability p of each draft. A `Calibration` turns p into the chance the
target accepts that draft once the ones before it were, learned from the run's own verified
drafts (by bins of p and the row's kind: whether it samples, what its last round kept; starting
from p itself); the chance that drafts 1..j of a row are all accepted is the product of theirs,
c_j, which falls with j.

A round then verifies, over all rows together, the drafts with the highest c first, for as long
as they pay (`row_widths`): with m drafts verified it expects R + c_(1) + .. + c_(m) tokens (R
rows, each emits at least one) in the seconds the bucket's cost curve gives m (the timings
engine/schedule.py keeps of rounds at each k, read between its points: `seconds_at`), and it
takes the m with the most tokens a second, of those that take every row's first draft. A row's
c falls with j, so what a row verifies is always its first drafts; and each verifies one at
least: the drafter has run already, the first draft costs one row of the verify, and a row that
verifies none is not measured (its last round stays what it was, and bins no row verifies keep
their estimate: a row the drafter once missed could verify none from then on). In a round
captured as a CUDA graph the shape is fixed (n rows x the schedule's width): a draft costs
nothing more there, the round takes the best drafts that fill it (a flat curve), the rest of
the shape masked.

The verify then runs the rows' anchors and chosen drafts packed one after the other (a ragged
forward, `ragged_rows`); a row's drafts past its count are blanked (-1), so none can be accepted,
and its logits rows past them read its anchor's (finite, never kept). Lossless: every emitted
token is still the target's own choice at its position.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from dflash_batch import parallel

if TYPE_CHECKING:
    from dflash_batch.engine.batch import DecodeBatch
    from dflash_batch.engine.schedule import Schedule
    from dflash_batch.engine.sequence import Sequence

# Upper edges of the bins of the drafter's probability of a draft (the last bin runs to 1).
EDGES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
PRIOR = 8.0  # trials' weight of the drafter's own word in a bin's chance (each bin's mid-point)
WINDOW = 4096  # a bin's trials are halved past this, so its chance follows the run
# What a row's last round that verified drafts did: none yet, kept none, kept some, kept all.
# Acceptance runs in streaks (a row the drafter follows keeps following it), so a row's own
# last round says more than the drafter's probability alone: each has its own bins.
FRESH, MISSED, SOME, ALL = range(4)
KINDS = 8  # a row's kind: whether it samples, and its last round (kind_of)


def kind_of(sampled: int | torch.Tensor, last: int | torch.Tensor) -> int | torch.Tensor:
    """The calibration's kind of a row: its last round (FRESH .. ALL) and whether it samples (the
    drafter proposes the greedy path: a sampling row takes it less often at the same confidence)."""
    return sampled + 2 * last


def last_round(accepted: int, verified: int, before: int) -> int:
    """A row's last round after one that verified `verified` drafts and kept `accepted`."""
    return before if verified == 0 else MISSED if accepted == 0 else ALL if accepted == verified else SOME


class Calibration:
    """P(a draft is accepted | the drafts before it were), by the bin of the drafter's probability
    of it and the row's kind (kind_of), over the run's verified drafts: (hits + PRIOR * mid) /
    (trials + PRIOR) a bin, the bins of kind 0 first."""

    def __init__(self):
        lows = (0.0, *EDGES)
        self.mids = [(lo + hi) / 2 for lo, hi in zip(lows, (*EDGES, 1.0))] * KINDS
        self.trials = [0.0] * len(self.mids)
        self.hits = [0.0] * len(self.mids)

    def record(self, probs: list[list[float]], verified: list[int], accepted: list[int], kinds: list[int]) -> None:
        """Rows whose drafts had these probabilities verified `verified` of them and accepted
        `accepted` (`kinds`: each row's kind when it chose): draft j of a row is a trial if the
        ones before it were accepted."""
        for p, v, a, kind in zip(probs, verified, accepted, kinds):
            for j in range(min(a + 1, v)):
                b = bisect.bisect_right(EDGES, p[j]) + kind * (len(EDGES) + 1)
                self.trials[b] += 1
                self.hits[b] += j < a
        for b, t in enumerate(self.trials):
            if t > WINDOW:
                self.trials[b], self.hits[b] = t / 2, self.hits[b] / 2

    def rates(self) -> list[float]:
        return [(h + PRIOR * m) / (t + PRIOR) for h, t, m in zip(self.hits, self.trials, self.mids)]


def round_params(calibration: Calibration, size: int, costs: list[float]) -> list[float]:
    """What row_widths reads of a round, as DecodeBatch.draft_params holds it: the calibrated
    chance of each bin (kind 0's, then kind 1's, ..), then the round's cost curve: a round of
    `size` rows verifying k drafts each takes costs[k - 1] seconds, k = 1 .. block - 1
    (engine/schedule.py's table)."""
    return [*calibration.rates(), size, *costs]


def ready_rows(batch: DecodeBatch, schedule: Schedule, n: int, captured: bool) -> None:
    """Write what a per-row round of n rows reads: the calibration's rates and the round's cost
    curve. A draft costs nothing more in a captured round (its shape is paid) or while the
    schedule explores (every draft is verified, so each position and bin is measured): the curve
    is flat there. Rank 0's on every rank: each timed its own cost table, and ranks that chose
    apart would run verifies of different shapes."""
    size, costs = schedule.curve(n)
    if captured or schedule.exploring:
        costs = [costs[-1]] * len(costs)
    params = round_params(schedule.calibration, size, costs)
    parallel.agreed_tensor(batch.draft_params.copy_(torch.tensor(params, dtype=torch.float64)))


def seconds_at(drafts: torch.Tensor, size: torch.Tensor | float, costs: torch.Tensor) -> torch.Tensor:
    """A round's seconds verifying `drafts` drafts in all, on the cost curve of rounds of `size`
    rows (costs[k - 1]: k drafts each): linear between the curve's points (drafts = size x k),
    and past its ends along its first and last pieces (flat where it has one point)."""
    if costs.numel() == 1:
        return costs[0].expand(drafts.shape)
    k = drafts.to(costs.dtype) / size
    piece = (k.floor() - 1).clamp(0, costs.numel() - 2).long()
    low, high = costs[piece], costs[piece + 1]
    return low + (k - 1 - piece) * (high - low)


def learn(calibration: Calibration, batch: DecodeBatch, kept: list[tuple[int, int, Sequence]]) -> None:
    """After a per-row round: the drafts its sequences kept and verified are the calibration's
    trials (of the sequences whose round their end did not cut short), and each row's last
    round is this one."""
    if not kept:
        return
    rows = max(seq.row for _, _, seq in kept) + 1
    probs, last = batch.draft_probs[:rows].tolist(), batch.draft_last[:rows].tolist()
    calibration.record([probs[seq.row] for _, _, seq in kept], [v for _, v, _ in kept], [a for a, _, _ in kept],
                       [kind_of(seq.params.temperature > 0, last[seq.row]) for _, _, seq in kept])
    device = batch.draft_last.device
    batch.draft_last[torch.tensor([seq.row for _, _, seq in kept], device=device)] = torch.tensor(
        [last_round(a, v, last[seq.row]) for a, v, seq in kept], device=device)


def row_widths(probs: torch.Tensor, budget: torch.Tensor, kinds: torch.Tensor, edges: torch.Tensor,
               params: torch.Tensor, most: int) -> torch.Tensor:
    """Rows verified a sequence (anchor + its drafts), [n], for a round whose drafts have the
    drafter's probabilities `probs` [n, D]: the drafts that pay, at most `most` in all (see the
    module). `budget` [n]: tokens each row may still emit (0: padding, which verifies none);
    `kinds` [n]: each row's kind (kind_of); `edges`: the bins' (EDGES); `params`: round_params.
    No host read: a captured round runs it."""
    n, D = probs.shape
    bins = edges.numel() + 1
    rates, size, costs = params[:KINDS * bins].to(probs.dtype), params[KINDS * bins], params[KINDS * bins + 1:]
    at = torch.bucketize(probs, edges, right=True) + bins * kinds[:, None]
    chance = torch.cumprod(rates[at], 1)
    room = (budget - 1).clamp(0, D)  # drafts past a row's budget could never be emitted
    chance = chance.masked_fill(torch.arange(D, device=probs.device) >= room[:, None], 0.0)
    first = room > 0  # rows that verify their first draft, whatever it is worth (see the module)
    key = chance.clone()
    key[:, 0] += first  # chances are <= 1: first drafts sort before every other
    order = key.flatten().sort(descending=True, stable=True)[1]
    m = min(most, n * D)
    order = order[:m]
    top = chance.flatten()[order]
    rows = (budget > 0).sum().to(costs.dtype)
    tokens = rows + torch.cat([top.new_zeros(1), top.cumsum(0)]).to(costs.dtype)
    seconds = seconds_at(torch.arange(m + 1, device=probs.device), size, costs)
    too_few = torch.arange(m + 1, device=probs.device) < first.sum().clamp(max=m)
    worthless = torch.cat([top.new_zeros(1, dtype=torch.bool), top <= 0])
    rate = (tokens / seconds).masked_fill(too_few | worthless, float("-inf"))
    take = torch.arange(m, device=probs.device) < rate.argmax()  # the first best: the fewer drafts on a tie
    chosen = torch.zeros(n * D, dtype=torch.bool, device=probs.device).scatter(0, order, take)
    return 1 + chosen.view(n, D).sum(1)


def ragged_rows(widths: torch.Tensor, block: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed layout of a verify whose row b runs its first widths[b] of `block` positions,
    rows one after the other in `tokens` rows (padding past them): (live [n, block], where each
    position runs [n, block] (`tokens`: not run), the logits row each position reads [n * block])."""
    live = torch.arange(block, device=widths.device) < widths[:, None]
    start = (widths.cumsum(0) - widths)[:, None]
    at = torch.where(live, start + torch.arange(block, device=widths.device), tokens)
    return live, at, torch.where(live, at, start).reshape(-1)


def packed(values: torch.Tensor, at: torch.Tensor, tokens: int, fill: int) -> torch.Tensor:
    """values [n, block] (or flat) at the packed rows `at` (ragged_rows) -> [tokens]; rows no
    position runs hold `fill`."""
    out = values.new_full((tokens + 1,), fill)
    return out.index_copy_(0, at.reshape(-1), values.reshape(-1))[:tokens]
