"""The engine: continuous-batching speculative decoding behind `request.Engine`."""

from __future__ import annotations

from dflash_batch.job import Job, JobError
from dflash_batch.plan.tokenize import Tokenizer


def build_engine(job: Job, tokenizer: Tokenizer):
    """The engine for the job's model pair (loads the checkpoints; fails before any work)."""
    raise JobError(f"no engine for this model: {job.model.target} (the decoding engine is not "
                   "built yet in this version of dflash-batch)")
