"""Pipeline lanes: a bucket's running rows split into lanes whose rounds interleave across the
pipeline stages, so that no stage waits for a whole round to come back.

A round run whole goes through the stages one after the other, and the next round can start
only once the last stage has decided this one and drafted the next: with S stages each one works
1/S of the time. With lanes (`engine.micro_batches` of them, rows split evenly into contiguous
ranges), each lane decodes rounds of its own and the stages take the lanes in turn: while the last
stage verifies, decides and drafts lane m's next round, the first stage verifies lane m + 1's. With
at least as many lanes as stages, every stage has a lane to work on.

What a lane's round sends: the first stage's carry goes on stage by stage as in any forward; the
last stage posts what it decided (the rows' ids, positions, results and accepted drafts, and their
logprobs) and then the lane's next drafts to every earlier stage, without waiting. An earlier stage
takes them when lane m's turn comes back: it commits the same accepted rows and keeps the same
tokens, then verifies the drafts.

Every rank keeps every lane's sequences the same way, in the same order (lane m's round r after
lane m - 1's), so each knows without asking whether a lane goes on: it stops when its rows are
done, once enough rows are free for waiting requests (LANES_REFILL), or (speculation: auto) after
LANES_REPLAN rounds, when the ranks agree anew on the drafts to verify. The engine then admits and
prefills them with the pipe drained and starts the lanes again. A lane's round is the round of its
rows: rows are independent in a round (engine/round.py), so the tokens are those of whole rounds.

Lanes run rounds eagerly and whole through the stages (a backend that plans on the host plans
each lane's forwards as a round of their own). The engine keeps whole rounds (the stages
taking a round's micro-batches in turn) where a round is captured as a graph, a row follows a
grammar (its masks are written on the host between draft and verify), the compile policy times
rounds, or requests restart one at a time after a failure (Engine._lanes_fit). A failure inside
lanes, with messages between stages in flight, ends the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash_batch import parallel
from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.emitted import take_round
from dflash_batch.engine.queue import Queue
from dflash_batch.engine.round import Round, round_kv_lens
from dflash_batch.engine.sequence import Sequence
from dflash_batch.models.stages import even_bounds

# Lanes stop for new requests once this share of the bucket's rows is free (at least one row):
# admitting a request drains the pipe for its prefill, so requests are admitted a few at a time.
LANES_REFILL = 1 / 16
# Under speculation: auto, lanes stop after this many rounds each, so that the ranks agree on the
# drafts to verify again (engine/schedule.py: the plan follows the acceptance measured so far).
LANES_REPLAN = 8


@dataclass
class Lane:
    batch: DecodeBatch        # its rows, as a batch of their own
    drafted: tuple = ()       # the last stage's: what the lane's next verify reads (Round.draft)
    rounds: int = 0           # rounds of it this rank has verified
    posted: list = field(default_factory=list)  # the last stage's sends of the lane in flight

    def settled(self) -> None:
        """Wait until what the last stage posted of this lane has been received: at the next
        round's decision it has been (the earlier stages took it before they verified that
        round), so this costs nothing there and keeps a lane's copies in flight to one round's."""
        for work in self.posted:
            work.wait()
        self.posted.clear()

    def running(self, q: Queue) -> list[Sequence | None]:
        return q.running[self.batch.first_row:self.batch.first_row + self.batch.rows]


@dataclass
class LanesRun:
    """What one stretch of interleaved rounds did: `accepted[r]`, the drafts each sequence kept and
    verified in round r of its lane (a round of every lane: the schedule's record of a round of the batch);
    `ended`, the sequences that ended (their rows released)."""

    accepted: list[list[tuple[int, int, Sequence]]]
    ended: list[Sequence]
    seconds: float


def run_lanes(q: Queue, batch: DecodeBatch, step: Round, size: int, lanes: int, width: int, greedy: bool,
              decode: Callable[[list[int]], str], rounds: int | None = None) -> LanesRun:
    """Decode the running rows 0..size-1 in `lanes` lanes, `width` rows verified a sequence, until
    the lanes stop (see the module), or after `rounds` rounds each; `greedy`: every row is plain
    greedy; `decode`: for stop strings."""
    started = time.perf_counter()
    bounds = even_bounds(size, lanes)
    live = [Lane(batch.lane(a, b)) for a, b in zip(bounds, bounds[1:]) if a < b]
    live = [lane for lane in live if any(lane.running(q))]
    refill = max(1, int(len(q.running) * LANES_REFILL))
    record = LanesRun([], [], 0.0)
    stopping = False  # set once enough rows are free, at the same lane's round on every rank
    last, block = parallel.last_stage(), step.block

    def max_kv(lane: Lane) -> int:
        return max(s.position for s in lane.running(q) if s is not None) + block

    def goes_on(lane: Lane) -> bool:
        """Keep what lane's round emitted; whether the lane runs another round."""
        nonlocal stopping
        kept = take_round(lane.batch, lane.running(q), block, decode)
        while len(record.accepted) < lane.rounds:
            record.accepted.append([])
        record.accepted[lane.rounds - 1] += kept
        for seq in lane.running(q):
            if seq is not None and seq.finish_reason:
                q.release(seq, batch)
                record.ended.append(seq)
        stopping = stopping or (len(q.free_rows) >= refill and q.room())
        return not stopping and lane.rounds != rounds and any(lane.running(q))

    def plan(lane: Lane) -> None:  # a backend that plans on the host (flashinfer) lays out the lane's forwards
        step.attention.plan_round(lane.batch, lane.batch.rows, round_kv_lens(lane.running(q), block, width), False,
                                  {"verify": width})

    def draft(lane: Lane) -> None:  # the last stage: the lane's next drafts, posted
        plan(lane)
        lane.drafted = step.draft(lane.batch, lane.batch.rows, max_kv(lane), width, lane=True)
        lane.posted += parallel.post_to_stages(lane.batch.ids)

    stretch = list(live)  # every lane of this stretch (`live`: those still running rounds)
    if last:
        for lane in live:
            draft(lane)
    while live:
        for lane in list(live):
            b, n = lane.batch, lane.batch.rows
            if last:
                plan(lane)  # the layout its drafts were made with, which the verify reads
                accepted = step.check(b, n, greedy, lane.drafted)
                lane.settled()
                lane.posted += parallel.post_to_stages(*step.decided(b, n, accepted))
                step.settle(b, n, accepted)
                lane.rounds += 1
                if goes_on(lane):
                    draft(lane)
                else:
                    live.remove(lane)
                continue
            if lane.rounds:  # take what the last stage decided of the lane's previous round
                accepted = torch.zeros(n, dtype=torch.int64, device=b.ids.device)
                parallel.recv_from_last_stage(*step.decided(b, n, accepted))
                step.settle(b, n, accepted)
                if not goes_on(lane):
                    live.remove(lane)
                    continue
            parallel.recv_from_last_stage(b.ids)
            plan(lane)
            step.check(b, n, greedy, step.draft(b, n, max_kv(lane), width, lane=True))
            lane.rounds += 1
    for lane in stretch:
        lane.settled()
    record.seconds = time.perf_counter() - started
    return record
