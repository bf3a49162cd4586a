"""`dflash-batch run` with the test engine, printing whether this process's group is still up
when its exit handlers run, and (`teardown`) if the interpreter's teardown begins: a rank must
end without it, where the gloo threads an engine run leaves would race it (cli.end_rank). For
tests/test_multinode.py.

usage: python -m tests.rank_exit_probe run JOB_FILE [RUN OPTIONS...]   (as torchrun's worker)
"""

from __future__ import annotations

import atexit
import os

import torch.distributed as dist

from dflash_batch import build
from dflash_batch.cli import main
from tests.fake_engine import fake_factory


class Teardown:
    # `write` bound now: the teardown may have emptied this module (and sys.stdout) by then.
    def __del__(self, write=os.write) -> None:
        write(1, b"interpreter teardown\n")


if __name__ == "__main__":
    build.build_engine = fake_factory()  # _run_shard imports it when the run starts
    # atexit handlers run before finalization, in the reverse order of registration: after every
    # handler torch registered at import, so this line sees the group as the teardown will.
    atexit.register(lambda: print(f"group up at exit: {dist.is_initialized()}", flush=True))
    # Module globals are freed in the teardown: a rank that has one prints this line.
    teardown = Teardown()
    main()
