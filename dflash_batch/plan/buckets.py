"""Length buckets: rows of similar total length (prompt + max_new_tokens) are decoded together."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from dflash_batch.job import AutoDrafts, Job, PinnedDrafts


@dataclass(frozen=True)
class Bucket:
    index: int
    name: str              # "0-2048", "2048-8192", ... (lower edge exclusive)
    max_tokens: int        # prompt + max_new_tokens fits in this
    max_num_seqs: int
    speculation: bool | str  # True, False or "auto" (engine/schedule.py)
    block_size: int | None  # None: the drafter's own
    drafts: int | None = None  # drafts every round verifies (speculation: {drafts: K}); None: the block's
    per_row: bool = True  # auto: each row verifies the drafts worth it (engine/row_drafts.py)


def plan_buckets(job: Job) -> list[Bucket]:
    specs = job.resolved_buckets()
    out, low = [], 0
    for i, b in enumerate(specs):
        pinned = b.speculation.drafts if isinstance(b.speculation, PinnedDrafts) else None
        auto = isinstance(b.speculation, AutoDrafts)
        speculation = True if pinned is not None else "auto" if auto else b.speculation
        out.append(Bucket(i, f"{low}-{b.max_tokens}", b.max_tokens, b.max_num_seqs or job.engine.max_num_seqs,
                          speculation, b.block_size, pinned, not auto or b.speculation.per_row))
        low = b.max_tokens
    return out


def assign_bucket(total_tokens: int, edges: list[int]) -> int | None:
    """Index of the smallest bucket whose edge holds total_tokens; None if none does."""
    i = bisect.bisect_left(edges, total_tokens)
    return i if i < len(edges) else None
