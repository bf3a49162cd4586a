"""Conversations between their turns: a sequence whose turn ended keeps its row, pages,
recurrent state and drafter rings while its conversation makes the next turn (a tool call, a
user simulator: Request.turns, off the engine's thread); the next turn then prefills only its
own tokens from the row's caches.

A turn goes on in its row only where the caches hold exactly the sequence's history: K/V and
drafter context are written by position (later writes replace what a round wrote past the
end), and a recurrent state is committed up to the last token a round kept (round.py), but a
stop string cuts tokens on the host after the state moved past them. Such a turn (on a hybrid
target) is prefilled again whole, as a request of its own in the same generate call; a turn
that would not fit the bucket goes back to the caller with its whole prompt (next_prompt)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait

from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.queue import Queue
from dflash_batch.engine.request import Completion
from dflash_batch.engine.sequence import Sequence


class Parked:
    """One generate call's sequences between two turns, in the order their turns ended."""

    def __init__(self, recurrent: bool, capacity: int, keep: bool = True):
        """`recurrent`: the target keeps a recurrent state (a stop string's cut cannot be kept);
        `capacity`: the tokens a row holds (the bucket's max_tokens); `keep`: later turns go on
        from the row's caches (else each is prefilled whole, as a single-turn engine must)."""
        self.recurrent, self.capacity, self.keep = recurrent, capacity, keep
        self.waiting: dict[Sequence, tuple[Future, Completion]] = {}

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def park(self, seq: Sequence, q: Queue, batch: DecodeBatch, decode: Callable[[list[int]], str]) -> bool:
        """A finished sequence of a conversation waits for its next turn (False: not one, or it failed)."""
        turns = seq.request.turns
        if turns is None or seq.finish_reason == "error":
            return False
        q.pause(seq, batch)
        done = seq.completion(decode)
        self.waiting[seq] = (turns.ended(done), done)
        return True

    def wait(self) -> None:
        """Until a next turn is made (nothing else to run meanwhile)."""
        wait([f for f, _ in self.waiting.values()], return_when=FIRST_COMPLETED)

    def ready(self, q: Queue, batch: DecodeBatch, block: int) -> Iterator[Completion]:
        """Sequences whose next turn is made go on: in their row (prefilling its opening), or
        whole as a new request; yields the completions of conversations that ended or must move
        to a larger bucket (their rows freed)."""
        for seq, (future, done) in list(self.waiting.items()):
            if not future.done():
                continue
            del self.waiting[seq]
            try:
                opening = future.result()
            except Exception as error:  # noqa: BLE001 - the conversation's own failure ends only it
                opening = None
                done = dataclasses.replace(done, finish_reason="error", error_type="conversation_error",
                                           error=f"{type(error).__name__}: {error}"[:2000])
            history = seq.prompt + seq.tokens
            if opening is not None and len(history) + len(opening) + seq.params.max_new_tokens > self.capacity:
                done = dataclasses.replace(done, next_prompt=history + opening)
                opening = None
            if opening is None:
                q.release(seq, batch)
                yield done
            elif not self.keep or (self.recurrent and seq.cut_by_stop_string):  # (the state is past the turn's end)
                request = dataclasses.replace(seq.request, prompt_ids=history + opening)
                q.release(seq, batch)
                q.again.append(request)
            else:
                seq.next_turn(opening, block)
                q.prefilling.append(seq)
