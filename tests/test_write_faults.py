"""A full disk or an I/O error at each write step (the part file's bytes, its fsync, its rename,
the directory's fsync, the shard's stats, the dataset card, run.json) stops the run with a
message that names the file, the step and the error; every part committed before it is intact
and readable, no temporary file is left, and rerunning the same job (disk fixed) resumes to
exactly the rows of an uninterrupted run. The engine is the deterministic test double: the data path is under test."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import dflash_batch.io.outputs as outputs
from dflash_batch.io.outputs import CommitError
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

VOLATILE = {"ttft_s", "latency_s"}


def job(tmp_path: Path, model_dir: Path, out: str):
    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": f"prompt {i} " + "ox " * (i % 5)} for i in range(30)])
    doc = base_job(model_dir, ["p.jsonl"], input={"workers": 0}, output={"dir": out, "rows_per_part": 4})
    return write_job(tmp_path, doc, f"{out}.yaml")


def rows(out: Path) -> dict:
    return {(r["row_id"], r["sample_index"]): {k: v for k, v in r.items() if k not in VOLATILE} for r in read_out(out)}


class Fault:
    """Fail the `nth` call of one file operation with `code`; count the calls."""

    def __init__(self, code: int, nth: int, when=lambda *args: True):
        self.code, self.nth, self.when, self.calls = code, nth, when, 0

    def __call__(self, real):
        def faulty(*args, **kwargs):
            if self.when(*args):
                self.calls += 1
                if self.calls == self.nth:
                    raise OSError(self.code, os.strerror(self.code))
            return real(*args, **kwargs)
        return faulty


class _FailingFile:
    def __init__(self, f, fault):
        self.f, self.fault = f, fault

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def write(self, data):
        return self.fault(self.f.write)(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def _path(arg) -> str:
    return os.readlink(f"/proc/self/fd/{arg}") if isinstance(arg, int) else str(arg)


def committed_file(*args) -> bool:
    """Whether a file operation is on what a run commits (parts, stats, run.json, the card), not
    on the progress file: that one is a sign of life, whose faults warn (tested below)."""
    return not any(f"{os.sep}progress" in _path(a) for a in args[:2] if isinstance(a, (int, str, os.PathLike)))


STEPS = {
    # step: (what to patch, the call to fail, the words the message must hold)
    "part bytes": ("open", 3, "writing failed"),
    "part fsync": ("fsync", 3, "syncing failed"),
    "part rename": ("replace", 2, "renaming it into place failed"),
    "directory fsync": ("dirsync", 2, "syncing its directory failed"),
    "stats": ("stats", 1, "shard-00000.json: writing failed"),
    "dataset card": ("link", 1, "README.md: cannot create it"),
    "run.json": ("link", 2, "run.json: cannot create it"),
}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
@pytest.mark.parametrize("step", STEPS)
def test_write_fault_loses_nothing_committed(tmp_path, model_dir, monkeypatch, step, code):
    run_job(job(tmp_path, model_dir, "ref"), fake_factory(), Shard(0, 1), progress=False)
    expected = rows(tmp_path / "ref")
    out = tmp_path / "out"
    what, nth, words = STEPS[step]
    fault = Fault(code, nth, when=committed_file)
    if what in ("open", "stats"):  # the n-th part's bytes, or the stats file's
        real_open, name = open, "part-" if what == "open" else "stats"
        monkeypatch.setattr(outputs, "open", lambda p, mode="r", *a, **k: _FailingFile(real_open(p, mode, *a, **k), fault)
                            if name in str(p) else real_open(p, mode, *a, **k), raising=False)
    elif what == "fsync":
        monkeypatch.setattr(os, "fsync", fault(os.fsync))
    elif what == "replace":
        monkeypatch.setattr(os, "replace", fault(os.replace))
    elif what == "dirsync":
        monkeypatch.setattr(outputs, "_fsync_dir", fault(outputs._fsync_dir))
    else:
        monkeypatch.setattr(os, "link", fault(os.link))

    with pytest.raises((CommitError, OSError)) as raised:
        run_job(job(tmp_path, model_dir, "out"), fake_factory(), Shard(0, 1), progress=False)
    message = str(raised.value)
    assert words in message and os.strerror(code) in message, message
    if step != "stats":  # the stats file is the whole run's last write: what it says is the run
        assert "rerun the same command" in message
    committed = list((out / "data").rglob("part-*.parquet")) if out.exists() else []
    for part in committed:
        pq.read_table(part)  # whole
    assert not list(out.rglob("*.tmp")) if out.exists() else True
    if step in ("part bytes", "part fsync", "part rename"):
        assert committed, "the fault came after the first parts: they must be there"

    monkeypatch.undo()
    run_job(job(tmp_path, model_dir, "out"), fake_factory(), Shard(0, 1), progress=False)
    assert rows(out) == expected


@pytest.mark.parametrize("call", ["fsync", "replace"])
def test_a_progress_file_fault_warns_and_the_run_goes_on(tmp_path, model_dir, monkeypatch, capsys, call):
    run_job(job(tmp_path, model_dir, "ref"), fake_factory(), Shard(0, 1), progress=False)
    fault = Fault(errno.ENOSPC, 1, when=lambda *args: not committed_file(*args))
    monkeypatch.setattr(os, call, fault(getattr(os, call)))
    run_job(job(tmp_path, model_dir, "out"), fake_factory(), Shard(0, 1), progress=False)
    assert fault.calls >= 1 and rows(tmp_path / "out") == rows(tmp_path / "ref")
    assert "progress" in capsys.readouterr().err
