"""Run a job file with the test engine in a child process (for kill/resume tests).

usage: python -m tests.run_fake_job JOB_FILE DELAY_S
"""

from __future__ import annotations

import sys

from dflash_batch.cli import EXIT_PREEMPTED, exit_now
from dflash_batch.job import load_job
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import Preempted, run_job
from tests.fake_engine import fake_factory

if __name__ == "__main__":
    try:
        run_job(load_job(sys.argv[1]), fake_factory(delay_s=float(sys.argv[2])), Shard(0, 1), progress=False)
    except Preempted:
        exit_now(EXIT_PREEMPTED)  # as `dflash-batch run` exits
