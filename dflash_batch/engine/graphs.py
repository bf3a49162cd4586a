"""CUDA graphs of a Round: one per (padded batch size, greedy or sampled, verify width).

Captured when the bucket starts (or an auto bucket stops speculating: before its sequences move
into the new batch), while every row of the batch is padding, so warm-up and capture change
nothing a sequence will read (padding rows write only scratch slots and the scratch
recurrent state). Before each replay the engine has the attention backend plan the round from
host-side lengths (flashinfer's plan must run outside the graph); the graph then reads the
batch's static tensors, which the host keeps current between rounds.
"""

from __future__ import annotations

import torch

from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.round import Round


class RoundGraphs:
    def __init__(self, step: Round, batch: DecodeBatch, sizes: list[int], max_kv: int,
                 widths: list[int] | None = None, per_row: bool = False):
        """`widths`: the verify widths rounds may run at (engine/schedule.py); default the block.
        `per_row`: a round of width W > 1 verifies each row's drafts worth it, n * (W - 1) in
        all at most, in a verify of n * W rows (engine/row_drafts.py)."""
        self.step, self.batch, self.max_kv, self.per_row = step, batch, max_kv, per_row
        self.graphs: dict[tuple[int, bool, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        # Largest first: the smaller graphs reuse the memory pool the largest one reserved. Sizes
        # past the batch's rows have no rows to run on (a bucket with fewer sequences).
        for size in sorted((s for s in sizes if s <= batch.rows), reverse=True):
            for width in sorted(widths or [batch.block], reverse=True):
                for greedy in (True, False):
                    self._capture(size, greedy, width)

    def covers(self, size: int, width: int | None = None) -> bool:
        return (size, True, width or self.batch.block) in self.graphs and not self.batch.reshaped

    def replay(self, size: int, greedy: bool, width: int | None = None) -> None:
        """Run the round of `size` rows (the attention backend has planned it)."""
        self.graphs[(size, greedy, width or self.batch.block)].replay()

    def _capture(self, size: int, greedy: bool, width: int) -> None:
        self.step.attention.plan_round(self.batch, size, {"draft": [], "verify": []}, graph=True,
                                       widths={"verify": width})  # all padding
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernels compiled and planned outside the capture
            for _ in range(2):
                self._run(size, greedy, width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        mode = torch.cuda.get_sync_debug_mode()
        with torch.cuda.graph(graph, pool=self.pool):  # (entering it synchronizes the device)
            # A sync inside a capture fails it anyway; this names the op that synced.
            torch.cuda.set_sync_debug_mode("error")
            try:
                self._run(size, greedy, width)
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        self.pool = graph.pool()
        self.graphs[(size, greedy, width)] = graph

    def _run(self, size: int, greedy: bool, width: int) -> None:
        per_row = self.per_row and width > 1
        self.step(self.batch, size, greedy, self.max_kv, width, per_row=per_row, fixed=per_row)
