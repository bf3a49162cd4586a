"""`dflash-batch run` with the test engine, printing as the interpreter starts to exit whether this
process's group is still up: a rank's state at the moment its gloo threads begin to race the
interpreter's teardown (dflash_batch/parallel.py leave_group). For tests/test_multinode.py.

usage: python -m tests.rank_exit_probe run JOB_FILE [RUN OPTIONS...]   (as torchrun's worker)
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

from dflash_batch import build
from dflash_batch.cli import main
from tests.fake_engine import fake_factory

if __name__ == "__main__":
    build.build_engine = fake_factory()  # _run_shard imports it when the run starts
    # atexit handlers run before finalization, in the reverse order of registration: after every
    # handler torch registered at import, so this line sees the group as the teardown will.
    atexit.register(lambda: print(f"group up at exit: {dist.is_initialized()}", flush=True))
    main()
