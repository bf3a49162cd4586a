"""jobs/slurm/array.sbatch as bash runs it (dflash-batch replaced by a stub that prints its
arguments): a plain array leaves the shard to the Slurm variables; with DFLASH_SHARDS the task id
is the shard index (a partial rerun of some shards); extra arguments reach `dflash-batch run`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent / "jobs" / "slurm" / "array.sbatch"


def run_template(tmp_path: Path, env: dict, *args: str) -> list[str]:
    stub = tmp_path / "bin" / "dflash-batch"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    full = {"PATH": f"{stub.parent}:{os.environ['PATH']}", "SLURM_ARRAY_TASK_ID": "5", **env}
    out = subprocess.run(["bash", str(TEMPLATE), *args], env=full, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_plain_array(tmp_path):
    assert run_template(tmp_path, {}, "job.yaml") == ["run", "job.yaml", "--no-progress"]


def test_partial_rerun_and_extra_arguments(tmp_path):
    args = run_template(tmp_path, {"DFLASH_SHARDS": "16"}, "job.yaml", "--output-dir", "out2")
    assert args == ["run", "job.yaml", "--no-progress", "--shard", "5/16", "--output-dir", "out2"]
