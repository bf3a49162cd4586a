"""Run a job file with the test engine in a child process, through the code `dflash-batch run`
runs (its messages and exit codes), for kill/resume/interrupt tests.

usage: python -m tests.run_fake_job JOB_FILE DELAY_S [--shard I/N] [--log F] [--load-s S] [--slow-flush S]

--shard: as `dflash-batch run --shard`; absent, the shard comes from the job and the environment
(Slurm's array variables, a Kubernetes indexed Job's), as `dflash-batch run` resolves it.
--log: the fake engine appends each row the runner took (tests/fake_engine.py); --load-s: the
engine takes this long to build, as a model loads; --slow-flush: each part commit waits this
long first, so a test can signal the run while it commits.
"""

from __future__ import annotations

import argparse
import os
import time

from dflash_batch.cli import _run_shard
from dflash_batch.io.outputs import PartWriter
from dflash_batch.job import load_job
from dflash_batch.plan.shards import parse_shard, resolve_shard
from tests.fake_engine import fake_factory

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("job_file")
    parser.add_argument("delay_s", type=float)
    parser.add_argument("--shard", type=parse_shard)
    parser.add_argument("--log")
    parser.add_argument("--load-s", type=float, default=0.0)
    parser.add_argument("--slow-flush", type=float, default=0.0)
    args = parser.parse_args()
    if args.slow_flush:
        flush = PartWriter.flush

        def slow_flush(self: PartWriter) -> None:
            if self.buffer:
                time.sleep(args.slow_flush)
            flush(self)

        PartWriter.flush = slow_flush
    factory = fake_factory(delay_s=args.delay_s, log=args.log)

    def loading(job, tokenizer):
        time.sleep(args.load_s)
        return factory(job, tokenizer)

    job = load_job(args.job_file)
    _run_shard(job, resolve_shard(job.sharding, os.environ, args.shard), False, args.job_file, loading)
