"""What a run of one shard has done, while it runs and when it ends.

A run's rows reach a Parquet part only when the part fills (or `output.flush_seconds` pass), so
the parts alone make a running shard look not started. The process that holds the shard's
writer lock therefore keeps OUT_DIR/progress/shard-NNNNN.json, written atomically when it takes
the lock, when its rows begin, after each part it commits, at most every WRITE_EVERY_S seconds
while rows finish, and once when it ends:

    state            loading | running | finished | stopped (a signal) | failed (an error)
    pid, host        the process
    started, updated unix times
    rows_done        rows finished by this run (committed, or in the part being filled)
    rows_committed   rows of this run in committed parts
    errors           error rows of this run, by error_type
    slurm            {job_id, array_job_id, array_task_id, script} under Slurm, else null;
                     `script` is the sbatch script as jobs/slurm/array.sbatch reports it

`status` calls a shard whose record says loading or running, and whose lock a process holds,
running; stalled once its last update is older than STALL_S (alive, holding the lock, finishing
no row). A record that says running while no process holds the lock is a run that ended without
a word (SIGKILL, the OOM killer, a lost node): the shard is incomplete.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import orjson

from dflash_batch.io.ledger import array_spec
from dflash_batch.io.outputs import CommitError, atomic_write_bytes

WRITE_EVERY_S = 5.0  # the file: fresh enough for `status`, rare enough to cost nothing
LOG_EVERY_S = 60.0  # without progress bars (a Slurm log), a line at most this often
STALL_S = 600.0  # no update for this long, the lock held: stalled
EXAMPLES = 3  # error rows shown per error_type
LIVE = ("loading", "running")


def progress_path(out_dir: Path, index: int) -> Path:
    return out_dir / "progress" / f"shard-{index:05d}.json"


def slurm_of(environ: Mapping[str, str]) -> dict | None:
    """Where this process runs under Slurm (a job id is set), what `status` needs to resubmit it."""
    if not environ.get("SLURM_JOB_ID"):
        return None
    return {"job_id": environ["SLURM_JOB_ID"], "array_job_id": environ.get("SLURM_ARRAY_JOB_ID"),
            "array_task_id": environ.get("SLURM_ARRAY_TASK_ID"),
            "script": environ.get("DFLASH_SBATCH_SCRIPT") or None}


class Progress:
    """This run's tally (rows done, error rows by type with the first few examples) on every
    rank; on the rank that writes, the progress file (`path`) and, without progress bars
    (`log`), a line on stderr at most every LOG_EVERY_S seconds."""

    def __init__(self, path: Path | None, log: bool, slurm: dict | None = None):
        self.path, self.log, self.slurm = path, log, slurm
        self.done = self.committed = self.saved_committed = 0
        self.errors: Counter[str] = Counter()
        self.examples: dict[str, list[tuple[str, str]]] = {}
        self.started = time.time()
        self.first_row = self.written = self.logged = time.monotonic()
        self.state = "loading"
        self._save()

    def start(self) -> None:
        """The model is loaded: rows begin (rows/s is counted from here)."""
        self.first_row = self.logged = time.monotonic()
        self.state = "running"
        self._save()

    def row(self, row: dict, committed: int) -> None:
        """A row was handed to the part writer; `committed`: this run's rows in committed parts."""
        self.done, self.committed = self.done + 1, committed
        if row["status"] == "error":
            kind = row.get("error_type") or "unknown"
            self.errors[kind] += 1
            shown = self.examples.setdefault(kind, [])
            if len(shown) < EXAMPLES and all(rid != str(row["row_id"]) for rid, _ in shown):  # not a row's samples
                shown.append((str(row["row_id"]), str(row.get("error") or "")))
        now = time.monotonic()
        part = committed != self.saved_committed  # a part was committed: the file agrees with the parts again
        if part or now - self.written >= WRITE_EVERY_S:
            self._save()
        if self.log and self.path is not None and now - self.logged >= LOG_EVERY_S:
            self.logged = now
            print(f"{self.path.stem}: {self.done} rows done this run, {self.committed} committed, "
                  f"{self.done / max(now - self.first_row, 1e-9):.2f} rows/s", file=sys.stderr, flush=True)

    def end(self, state: str, committed: int) -> None:
        self.state, self.committed = state, committed
        self._save()

    def too_many_errors(self, max_fraction: float) -> bool:
        """More error rows than `max_fraction` of the rows done, or every row (at least one) failed."""
        failed = sum(self.errors.values())
        return failed > max_fraction * self.done or (self.done > 0 and failed == self.done)

    def error_summary(self) -> list[str]:
        """One line per error_type, most frequent first, with the first few (row id: message)."""
        lines = []
        for kind, n in self.errors.most_common():
            shown = "; ".join(f"{rid}: {msg[:200]}" for rid, msg in self.examples[kind])
            lines.append(f"  {kind}: {n}, e.g. {shown}")
        return lines

    def _save(self) -> None:
        self.written, self.saved_committed = time.monotonic(), self.committed
        if self.path is None:
            return
        record = {"state": self.state, "pid": os.getpid(), "host": socket.gethostname(), "started": self.started,
                  "updated": time.time(), "rows_done": self.done, "rows_committed": self.committed,
                  "errors": dict(self.errors), "slurm": self.slurm}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.path, orjson.dumps(record, option=orjson.OPT_INDENT_2))
        except (OSError, CommitError) as e:  # a sign of life must never be what stops the run
            print(f"warning: {self.path}: {e}", file=sys.stderr)


def read_progress(out_dir: Path, index: int) -> dict | None:
    path = progress_path(out_dir, index)
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


def lock_held(lock_file: Path) -> bool | None:
    """Whether a process holds this POSIX lock (None: cannot tell on this OS). It asks (F_GETLK)
    rather than trying the lock: a `status` holding it for a moment would refuse a run starting
    at that moment. A lock this process holds itself is not seen."""
    if not lock_file.exists():
        return False
    if not sys.platform.startswith("linux"):
        return None
    layout = "hhqqi"  # Linux struct flock: l_type, l_whence, l_start, l_len, l_pid
    fd = os.open(lock_file, os.O_RDONLY)
    try:
        got = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(layout, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    finally:
        os.close(fd)
    return struct.unpack(layout, got)[0] != fcntl.F_UNLCK


def live_state(record: dict | None, held: bool | None, now: float) -> str | None:
    """running or stalled for a shard a process is working on; None when none is."""
    if record is None or record.get("state") not in LIVE or held is False:
        return None
    return "stalled" if now - record["updated"] > STALL_S else "running"


def ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min" if seconds < 7200 else f"{seconds // 3600} h"


def describe_live(index: int, state: str, record: dict, committed: int, expected: int | None, now: float) -> str:
    """A line for a shard a process is working on. `committed`: the shard's rows in committed parts
    (every run's); its run's rows finished but not yet in a part are added."""
    rows = f"{committed + record['rows_done'] - record['rows_committed']}"
    rows += f" of {expected} rows" if expected is not None else " rows"
    who, age = f"pid {record['pid']} on {record['host']}", ago(now - record["updated"])
    if state == "stalled":
        return (f"shard {index}: stalled: {rows}, no update for {age} while {who} holds its lock: read its log; "
                "stop it (SIGTERM commits its finished rows), then resume it")
    what = "loading the model" if record["state"] == "loading" else rows
    return f"shard {index}: running: {what}, last update {age} ago ({who})"


def resume_lines(todo: list[int], num_shards: int, job_file: str, out_dir: Path, records: list[dict | None],
                 most: int = 8) -> list[str]:
    """The commands that finish these shards, as the latest run (by its progress record) ran: an
    sbatch line with the script it ran under Slurm, else `dflash-batch run`."""
    latest = max((r for r in records if r), key=lambda r: r["updated"], default=None)
    slurm = latest.get("slurm") if latest else None
    target = f"{job_file} --output-dir {out_dir.resolve()}"
    if slurm:
        script = slurm.get("script") or "SBATCH_SCRIPT"  # a script other than jobs/slurm/array.sbatch
        return [f"sbatch --array={array_spec(todo)} --export=ALL,DFLASH_SHARDS={num_shards} {script} {target}"]
    if num_shards == 1:
        return [f"dflash-batch run {target}"]
    lines = [f"dflash-batch run {target} --shard {i}/{num_shards}" for i in todo[:most]]
    if len(todo) > most:
        lines.append(f"... and the same for shard(s) {array_spec(todo[most:])}")
    return lines
