"""The engine's queue of one generate call (engine.py drives it): requests waiting, rows taken,
sequences prefilling and decoding."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable

from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.heads import HeadPool
from dflash_batch.engine.request import Request
from dflash_batch.engine.sequence import Sequence
from dflash_batch.engine.sharing import PromptIndex


class Queue:
    """One generate call's sequences: the requests still to start (with those sent back to
    start over in front), the rows they take, which prefill and which decode, and how many may
    run at once after a failure."""

    def __init__(self, requests: Iterable[Request], rows: int, prefill_budget: int, heads: HeadPool):
        self.incoming, self.again = iter(requests), deque()
        self.free_rows = list(range(rows))  # a heap: new sequences take the lowest row
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence | None] = [None] * rows  # the sequence decoding in each row
        self.limit, self.prefill_budget = rows, prefill_budget
        self.min_prefill = min(prefill_budget, 16)
        self.suspects: set = set()  # keys of requests that start over one at a time
        self.exhausted = False
        self.prompts = PromptIndex()
        self.heads = heads

    def active(self) -> int:
        waiting = sum(len(s.followers) for s in self.prefilling)
        return len(self.prefilling) + waiting + sum(s is not None for s in self.running)

    def start(self, seq: Sequence, share: bool) -> None:
        """Prefill `seq`, or (`share`) let it follow a sequence prefilling the same prompt; a
        member of a shared head joins it."""
        leader = self.prompts.leader(seq) if share else None
        if leader is not None:
            leader.followers.append(seq)
        else:
            self.prefilling.append(seq)
            if share:
                self.prompts.add(seq)
        self.heads.join(seq, follows=leader is not None)

    def prefilled(self, seq: Sequence) -> None:
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        self.prompts.prefilled(seq)

    def decode(self, seq: Sequence, batch: DecodeBatch) -> None:
        batch.put(seq.row, seq)
        self.running[seq.row] = seq

    def room(self) -> bool:
        limit = 1 if self.suspects else self.limit
        return bool(self.free_rows) and self.active() < limit and not (self.exhausted and not self.again)

    def next_request(self) -> tuple[Request | None, int]:
        req = self.again.popleft() if self.again else next(self.incoming, None)
        if req is None:
            self.exhausted = True
            return None, -1
        return req, heapq.heappop(self.free_rows)

    def pause(self, seq: Sequence, batch: DecodeBatch) -> None:
        """Take a sequence out of prefill or decode, keeping its row, its pages and any shared
        head's: a conversation between two turns (engine/turns.py)."""
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        self.prompts.prefilled(seq)
        if self.running[seq.row] is seq:
            self.running[seq.row] = None
            batch.clear(seq.row)

    def forget(self, seq: Sequence, batch: DecodeBatch) -> None:
        """Take a sequence out of prefill or decode (its row is freed by `release`)."""
        self.pause(seq, batch)
        self.heads.leave(seq)

    def release(self, seq: Sequence, batch: DecodeBatch) -> None:
        self.forget(seq, batch)
        heapq.heappush(self.free_rows, seq.row)
        self.suspects.discard(seq.request.key)

    def requeue(self, seqs: list[Sequence], batch: DecodeBatch) -> None:
        """Send sequences back to start over, in front of the queue, in their order."""
        for seq in seqs:
            self.forget(seq, batch)
            heapq.heappush(self.free_rows, seq.row)
        self.again.extendleft(reversed([s.request for s in seqs]))
