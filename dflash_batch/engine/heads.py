"""Shared heads (plan/heads.py finds them): a head's pages, the state kept at its end, its members.

The first member of a head to be admitted (its leader) prefills it, with a chunk that stops at
the head's exact end; there the engine keeps what the rest of the prompt needs that pages do
not hold: the KDA recurrent and convolution states (Kimi-K3), the drafter's ring of its last
positions, and for prompt logprobs the head's scores and its last position's log-probs.

The head's whole pages (target K/V or MLA latents, and the drafter's context, which share
slots) are written once, into pages of a pool past the rows' own pages, and every member's
page table points at them: they are read-only from then on, and counted by their readers. The
head's last partial page is copied into each member's own page at that index, where the
member's tail goes on. Every other member waits, admitted, until the head is kept; then it
starts from the kept state with those pages, and prefills only its tail.

A head's kept state is dropped when its last member has entered; its pages return to the pool
when, besides, no sequence reads them. A member that finds no room in the pool, or comes back
(a retry) after its head was dropped, prefills its whole prompt itself: the same outputs. A
full pool only delays sharing: the head's next member admitted once pages are free leads it.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from dflash_batch.engine.cache import RowRings, slots
from dflash_batch.engine.request import Logprobs, Request, RequestKey, SamplingParams
from dflash_batch.engine.sequence import Sequence
from dflash_batch.limits import MIN_HEAD_TOKENS
from dflash_batch.plan.heads import SharedHead, shared_heads

Copy = Callable[[list[int], list[int]], None]  # copy cache slots src -> dst (every slot-indexed cache)

LIVE_HEADS = 2  # heads whose pages the pool holds at once: one being admitted, one still read


def scores_kind(params: SamplingParams) -> Hashable:
    """What rows sharing a head must agree on besides its tokens: the head's prompt logprobs are
    scored once, by its leader, at one number of top logprobs and one temperature (None: the
    row asks for none)."""
    return None if params.prompt_logprobs is None else (params.prompt_logprobs, params.temperature)


def plan_heads(requests: list[Request], longest: int) -> tuple[list[Request], dict[RequestKey, SharedHead]]:
    """The requests in their admission order (a head's members together), and each member's
    head, `longest` tokens at most (a longer one is shared that far). Rows share a head only
    with rows of their scores_kind."""
    if longest < MIN_HEAD_TOKENS:
        return requests, {}
    order, heads = shared_heads([r.prompt_ids for r in requests], [scores_kind(r.params) for r in requests])
    heads = [dataclasses.replace(h, length=min(h.length, longest)) for h in heads]
    return [requests[i] for i in order], {requests[i].key: h for h in heads for i in h.members}


def pool_bound(longest: int, page_size: int, pages_per_row: int) -> int:
    """The pages of a bucket's head pool: LIVE_HEADS heads of `longest` tokens, or of a row
    (allocated with the bucket's caches whatever its rows share: the memory plan counts them,
    and windows whose heads differ reuse the caches)."""
    return LIVE_HEADS * min(-(-longest // page_size), pages_per_row) if longest >= MIN_HEAD_TOKENS else 0


@dataclass
class Kept:
    """What a head keeps at its end, besides its pages."""

    state: list[torch.Tensor] | None      # the target's recurrent state (None: attention only)
    rings: list[torch.Tensor]             # the drafter's ring rows (its last positions)
    prompt_logprobs: Logprobs | None      # entries 0..length-1 (members that ask for them)
    edge: torch.Tensor | None             # log-probs at the head's last position: score token `length`


class LiveHead:
    def __init__(self, head: SharedHead, pages: list[int], page_size: int):
        """`pages`: its pool pages, enough for every position of the head."""
        self.head, self.pages = head, pages
        self.length = head.length
        self.whole_pages = head.length // page_size  # shared by reference; a partial one is copied
        self.partial = range(self.whole_pages * page_size, head.length)  # the positions copied
        self.leader: Sequence | None = None   # prefilling the head (None once it is kept)
        self.waiting: list[Sequence] = []     # members admitted, waiting to enter
        self.kept: Kept | None = None
        self.readers = 0                      # sequences whose page tables hold its pages


class HeadPool:
    """One generate call's heads over the pool pages first_page .. first_page + pages - 1;
    `recurrent`: the target whose recurrent state a head keeps (save_state, restore_state), if
    it has one."""

    def __init__(self, heads: dict[RequestKey, SharedHead], first_page: int, pages: int, page_size: int,
                 recurrent=None):
        self.of, self.recurrent = heads, recurrent
        self.free = list(range(first_page, first_page + pages))  # a heap: the lowest pages first
        self.page_size = page_size
        self.live: dict[int, LiveHead] = {}
        self.reading: dict[Sequence, LiveHead] = {}  # the head whose pages each member's table holds
        # Members of each head admitted so far (with room for the head or not), by head index.
        self.admitted: dict[int, set[RequestKey]] = {}
        self.ended: set[int] = set()  # heads whose members were all admitted and whose pages went back

    def join(self, seq: Sequence, follows: bool) -> None:
        """An admitted sequence: a member of a head takes its pages (and leads it, or waits for
        it, unless it `follows` a sequence with its prompt, which forks it: engine.py)."""
        head = self.of.get(seq.request.key)
        if head is None or head.index in self.ended:
            return
        # Counted whether or not it gets the head: its pages go back once every member has come.
        self.admitted.setdefault(head.index, set()).add(seq.request.key)
        if head.kind != scores_kind(seq.params):
            return  # a head planned without kinds: its kept scores would not be this row's
        live = self.live.get(head.index)
        if live is None:
            need = -(-head.length // self.page_size)
            if need > len(self.free):
                return
            live = self.live[head.index] = LiveHead(head, sorted(heapq.heappop(self.free) for _ in range(need)),
                                                    self.page_size)
        elif live.kept is None and live.leader is None:
            return  # kept state dropped: its members have all entered
        live.readers += 1
        self.reading[seq] = live
        seq.pages[:live.whole_pages] = live.pages[:live.whole_pages]
        if follows:
            return
        if live.kept is None and live.leader is None:
            live.leader = seq
        else:
            live.waiting.append(seq)

    def waits(self, seq: Sequence) -> bool:
        """A member whose head is not kept yet (it prefills nothing until then)."""
        live = self.reading.get(seq)
        return live is not None and live.kept is None and seq in live.waiting

    def entering(self, seqs: list[Sequence]) -> list[Sequence]:
        """Members among `seqs` whose head is kept: they enter it before they prefill."""
        return [s for s in seqs if (live := self.reading.get(s)) is not None and live.kept is not None
                and s in live.waiting]

    def stop(self, seq: Sequence) -> int | None:
        """Where a leader's prefill must stop a chunk: its head's end."""
        live = self.reading.get(seq)
        return live.length if live is not None and live.leader is seq else None

    def keep(self, leader: Sequence, copy: Copy, rings: RowRings, edge: torch.Tensor | None) -> None:
        """The leader's prefill reached the head's end: keep its partial page (in the head's own
        page), recurrent state, ring rows, prompt logprobs and `edge` (the log-probs of its last
        position, or None)."""
        live = self.reading[leader]
        copy(slots(leader.pages, live.partial, self.page_size), slots(live.pages, live.partial, self.page_size))
        state = self.recurrent.save_state(leader.row) if self.recurrent is not None else None
        logprobs = leader.prompt_logprobs.cut(live.length) if leader.prompt_logprobs is not None else None
        live.kept = Kept(state, [ring.clone() for ring in rings.of(leader.row)], logprobs, edge)
        live.leader = None
        self._tidy(live)

    def enter(self, seq: Sequence, copy: Copy, rings: RowRings,
              score: Callable[[Logprobs, torch.Tensor, list[int], int], None]) -> None:
        """A waiting member starts at its head's end: the partial page copied into its own page,
        the kept state and ring rows restored; `score` records its first prompt token past the
        head from the kept log-probs."""
        live = self.reading[seq]
        kept = live.kept
        copy(slots(live.pages, live.partial, self.page_size), slots(seq.pages, live.partial, self.page_size))
        if kept.state is not None:
            self.recurrent.restore_state(kept.state, seq.row)
        # None now where the bucket stopped speculating since (speculation: auto): no drafter reads them.
        for ring, saved in zip(rings.of(seq.row), kept.rings):
            ring.copy_(saved)
        seq.prefilled = seq.cached = live.length
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs = kept.prompt_logprobs.cut(live.length)
            score(seq.prompt_logprobs, kept.edge[None], [seq.prompt[live.length]], seq.params.prompt_logprobs)
        live.waiting.remove(seq)
        self._tidy(live)

    def leave(self, seq: Sequence) -> None:
        """`seq` leaves the batch (finished, failed or sent back): it reads its head's pages no
        more; a leader that had not reached the head's end hands it to a waiting member."""
        live = self.reading.pop(seq, None)
        if live is None:
            return
        live.readers -= 1
        if seq in live.waiting:
            live.waiting.remove(seq)
        if live.leader is seq:
            live.leader = live.waiting.pop(0) if live.waiting else None
        self._tidy(live)

    def _tidy(self, live: LiveHead) -> None:
        admitted = len(self.admitted[live.head.index]) >= len(live.head.members)
        if live.leader is None and not live.waiting and (admitted or live.kept is None):
            live.kept = None  # nobody can enter it any more (a retry prefills its prompt itself)
            if live.readers == 0:
                for page in live.pages:
                    heapq.heappush(self.free, page)
                del self.live[live.head.index]
                if admitted:
                    self.ended.add(live.head.index)
