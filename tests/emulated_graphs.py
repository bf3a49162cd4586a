"""RoundGraphs without CUDA: what a capture and a replay do, run eagerly, so the engine's graph
path runs on the CPU. A capture plans the all-padding round and runs its warm-ups (as
graphs.py does before capturing); a replay runs the round at the captured size. Under tensor
parallelism every rank then issues the same collectives in the same order, captures and
replays alike, or the gloo group fails."""

from __future__ import annotations

from dflash_batch.engine.graphs import RoundGraphs


class EmulatedGraphs(RoundGraphs):
    def _capture(self, size: int, greedy: bool) -> None:
        self.step.attention.plan_round(self.batch, size, {"draft": [], "verify": []}, graph=True)
        for _ in range(2):
            self.step(self.batch, size, greedy, self.max_kv)
        self.graphs[(size, greedy)] = None

    def replay(self, size: int, greedy: bool) -> None:
        self.step(self.batch, size, greedy, self.max_kv)
