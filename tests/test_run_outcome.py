"""No silent failures: a run that failed says so when it ends (exit 3 and a summary by
error_type), Ctrl-C commits finished rows like SIGTERM does (exit 130), and `status` sees a live
run (its progress file) and prints the command that resumes it the way it ran.

The runs go through the code `dflash-batch run` runs (tests/run_fake_job.py) with the fake engine,
in a child process wherever a signal or another process's lock is involved."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from dflash_batch.cli import main
from dflash_batch.io import progress as progress_module
from dflash_batch.io.ledger import lock_path
from dflash_batch.io.progress import Progress, live_state, progress_path
from dflash_batch.job import load_job
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
HINT = "finished rows are committed; rerun the same command to resume"


def _job(tmp_path: Path, model_dir: Path, rows: list[dict] | None = None, **output) -> Path:
    rows = rows if rows is not None else [{"id": f"r{i}", "prompt": f"prompt number {i}"} for i in range(40)]
    write_jsonl(tmp_path / "p.jsonl", rows)
    doc = base_job(model_dir, ["p.jsonl"], sampling={"n": 2, "max_new_tokens": 8},
                   output={"dir": "out", "rows_per_part": 1000, **output})
    write_job(tmp_path, doc)
    return tmp_path / "job.yaml"


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_run_left_behind():
    """A test that fails while a run goes on must not leave it running (the CPUs are shared)."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(job_file: Path, delay: float, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.run_fake_job", str(job_file), str(delay), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _started.append(proc)
    return proc


def _wait(until, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _logged(log: Path) -> set[tuple[str, int]]:
    """Rows the fake engine saw the runner take."""
    lines = log.read_text().split() if log.exists() else []
    return {(lines[i], int(lines[i + 1])) for i in range(0, len(lines), 2)}


def _keys(out: Path) -> set[tuple[str, int]]:
    rows = read_out(out)
    keys = {(r["row_id"], r["sample_index"]) for r in rows}
    assert len(keys) == len(rows), "a row committed twice"
    return keys


# -- 1. a failed run says so ---------------------------------------------------------------------

def test_a_run_whose_every_row_fails_exits_3_with_a_summary_after_committing_them(tmp_path, model_dir):
    rows = [{"id": f"r{i}", "prompt": None} for i in range(6)] + [{"id": "blank", "prompt": ""}]
    proc = _start(_job(tmp_path, model_dir, rows, max_error_fraction=1.0), 0.0)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert len(_keys(tmp_path / "out")) == 14  # committed first: 7 rows x 2 samples
    lines = err.splitlines()
    kinds = [ln.split(":")[0].strip() for ln in lines if ln.startswith("  ")]
    assert kinds == ["missing_prompt", "empty_prompt"], err  # most frequent first
    missing = next(ln for ln in lines if ln.startswith("  missing_prompt"))
    assert missing == ("  missing_prompt: 12, e.g. r0: column 'prompt' is missing or null; r1: column 'prompt' is "
                       "missing or null; r2: column 'prompt' is missing or null"), missing  # the first three rows
    assert "failed: 14 of the 14 rows this run are error rows" in err, err


def test_the_error_fraction_is_the_job_s_and_only_more_than_it_fails(tmp_path, model_dir, monkeypatch):
    """3 of 10 rows fail: over a max_error_fraction of 0.2, exit 3; at 0.3, not more than it: 0."""
    import dflash_batch.build

    monkeypatch.setattr(dflash_batch.build, "build_engine", fake_factory())
    monkeypatch.setattr("dflash_batch.cli._set_threads", lambda ranks: None)  # this process's torch threads stay
    rows = [{"id": f"r{i}", "prompt": None if i < 3 else f"p {i}"} for i in range(10)]
    codes = {}
    for fraction in (0.2, 0.3):
        job_file = _job(tmp_path, model_dir, rows, max_error_fraction=fraction, dir=f"out{fraction}")
        result = CliRunner().invoke(main, ["run", str(job_file), "--no-progress"])
        codes[fraction] = result.exit_code
        assert "missing_prompt: 6, e.g. r0" in result.output, result.output  # printed either way
    assert codes == {0.2: 3, 0.3: 0}


def test_too_many_errors():
    def tally(done: int, failed: int) -> Progress:
        t = Progress(None, log=False)
        for i in range(done):
            t.row({"row_id": str(i), "status": "error" if i < failed else "ok", "error_type": "x", "error": ""}, 0)
        return t

    assert not tally(4, 2).too_many_errors(0.5) and tally(4, 3).too_many_errors(0.5)
    assert tally(1, 1).too_many_errors(1.0) and not tally(2, 1).too_many_errors(1.0)  # all failed: always
    assert not tally(0, 0).too_many_errors(0.0) and tally(10, 1).too_many_errors(0.0)


# -- 2. Ctrl-C is SIGTERM ------------------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_commits_finished_rows_exits_130_and_a_resume_recomputes_none(tmp_path, model_dir):
    job_file = _job(tmp_path, model_dir)
    first, again = tmp_path / "first.log", tmp_path / "again.log"
    proc = _start(job_file, 0.2, "--log", str(first))
    _wait(lambda: len(_logged(first)) >= 3, "rows to finish")
    assert not read_out(tmp_path / "out")  # none committed yet: a part holds 1000 rows
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert f"interrupted: {HINT}" in err and "Aborted" not in err, err
    committed = _keys(tmp_path / "out")
    assert _logged(first) <= committed, "a finished row was thrown away"
    resumed = _start(job_file, 0.0, "--log", str(again))
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    assert not _logged(again) & committed, "the resume computed committed rows again"
    assert len(_keys(tmp_path / "out")) == 80


def test_a_second_ctrl_c_cannot_cut_the_commit(tmp_path, model_dir):
    """The commit on the way out takes 2 s here; a second SIGINT lands inside it."""
    job_file = _job(tmp_path, model_dir)
    log = tmp_path / "rows.log"
    proc = _start(job_file, 0.1, "--log", str(log), "--slow-flush", "2")
    _wait(lambda: len(_logged(log)) >= 3, "rows to finish")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.7)
    assert proc.poll() is None, "the commit ended before the second signal"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and HINT in err, err
    assert _logged(log) <= _keys(tmp_path / "out") and len(_logged(log)) >= 3


@pytest.mark.parametrize("second", [False, True])
def test_ctrl_c_while_the_model_loads(tmp_path, model_dir, second):
    """The first Ctrl-C while the model loads (4 s here) waits for the load, as SIGTERM does, and
    the run stops before its first row; a second stops it at once. Nothing is finished either way."""
    job_file, log = _job(tmp_path, model_dir), tmp_path / "rows.log"
    proc = _start(job_file, 0.0, "--load-s", "4", "--log", str(log))
    record = progress_path(tmp_path / "out", 0)
    _wait(lambda: record.exists(), "the model to start loading")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None
    sent = time.monotonic()
    if second:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    assert proc.returncode == 130 and HINT in err, err
    assert took < 2 if second else took > 2, took
    assert not log.exists() and not read_out(tmp_path / "out")
    assert orjson.loads(record.read_bytes())["state"] == "stopped"


# `dflash-batch run` itself, held while it checks the inputs (before the run takes the signals):
# Slurm's requeue may land there, seconds into a task on a busy node.
_HELD = ("import sys, time\n"
         "import dflash_batch.runner as runner\n"
         "def held(job):\n"
         "    print('checking', file=sys.stderr, flush=True)\n"
         "    time.sleep(60)\n"
         "runner.check_job = held\n"
         "from dflash_batch.cli import main\n"
         "main(['run', sys.argv[1], '--no-progress'])\n")


@pytest.mark.parametrize("signum, code, word", [(signal.SIGTERM, 143, "terminated"),
                                                (signal.SIGINT, 130, "interrupted")])
def test_a_signal_before_the_run_takes_it_stops_with_its_exit_code(tmp_path, model_dir, signum, code, word):
    proc = subprocess.Popen([sys.executable, "-c", _HELD, str(_job(tmp_path, model_dir))], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _started.append(proc)
    assert proc.stderr.readline().strip() == "checking"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, (proc.returncode, err)
    assert f"{word} before the first row: {HINT}" in err and "Traceback" not in err, err


def test_ctrl_c_before_the_run_takes_the_signal_exits_130_too(tmp_path, model_dir, monkeypatch):
    """While the inputs are checked, Ctrl-C is Python's KeyboardInterrupt: no row is finished yet."""
    import dflash_batch.runner

    def interrupted(job):
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash_batch.runner, "open_tokenizer", interrupted)
    monkeypatch.setattr("dflash_batch.cli._set_threads", lambda ranks: None)
    result = CliRunner().invoke(main, ["run", str(_job(tmp_path, model_dir)), "--no-progress"])
    assert result.exit_code == 130 and f"interrupted: {HINT}" in result.output, result.output


# -- 3. status sees a live run ---------------------------------------------------------------------

def _status(out: Path) -> tuple[dict[str, list[str]], str]:
    text = CliRunner().invoke(main, ["status", str(out)]).output
    table = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.strip()[:1].isdigit()}
    return table, text


@pytest.mark.slow
def test_status_sees_a_running_shard_and_a_killed_one(tmp_path, model_dir):
    job_file = _job(tmp_path, model_dir)
    out = tmp_path / "out"
    proc = _start(job_file, 0.1)
    # the file is written at most every 5 s: wait for one that counts rows
    _wait(lambda: (orjson.loads(progress_path(out, 0).read_bytes()).get("rows_done", 0)
                   if progress_path(out, 0).exists() else 0) > 0, "a progress record with rows")
    table, text = _status(out)
    assert not read_out(out) and table["0"][-1] == "running", text
    line = next(ln for ln in text.splitlines() if ln.startswith("shard 0: running: "))
    done = int(line.split()[3])
    assert 0 < done < 80 and " of 80 rows, last update " in line and f"(pid {proc.pid} on " in line, line
    assert "to finish them" not in text  # a running shard is not resubmitted
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    table, text = _status(out)  # it died without a word: its lock is free, its record says running
    assert table["0"][-1] == "incomplete" and "shard 0: running" not in text, text
    assert f"dflash-batch run {job_file.resolve()} --output-dir {out.resolve()}" in text and "sbatch" not in text, text


def test_status_calls_a_shard_stalled_when_its_holder_finishes_no_row(tmp_path, model_dir):
    job = load_job(_job(tmp_path, model_dir))
    out = tmp_path / "out"
    run_job(job, fake_factory(), Shard(0, 2), progress=False)
    record = progress_path(out, 1)
    lock = lock_path(out, 1)
    lock.parent.mkdir(parents=True)
    record.parent.mkdir(exist_ok=True)
    record.write_bytes(orjson.dumps({"state": "running", "pid": 4242, "host": "node7", "updated": time.time() - 700,
                                     "rows_done": 3, "rows_committed": 0, "slurm": None}))
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.lockf(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        table, text = _status(out)
    finally:
        holder.kill()
        holder.wait()
    assert table["0"][-1] == "complete" and table["1"][-1] == "stalled", text
    assert "shard 1: stalled: 3 of " in text and "no update for 11 min while pid 4242 on node7 holds its lock" in text
    assert "to finish them" not in text


def test_status_says_a_shard_is_loading_its_model(tmp_path, model_dir):
    job_file = _job(tmp_path, model_dir)
    run_job(load_job(job_file), fake_factory(), Shard(1, 2), progress=False)  # run.json, as another task writes it
    _start(job_file, 0.0, "--load-s", "60", "--shard", "0/2")
    _wait(lambda: progress_path(tmp_path / "out", 0).exists(), "the model to start loading")
    table, text = _status(tmp_path / "out")
    assert table["0"][-1] == "running" and "shard 0: running: loading the model, last update " in text, text


def test_the_progress_file_agrees_with_the_parts_after_each_part(tmp_path, model_dir):
    """`status` adds the rows a run finished but has not committed to the parts' rows: the file's
    count of committed rows must move with each part, not seconds later."""
    out, seen = tmp_path / "out", []

    def check(_row: dict) -> None:  # called as row k is handed on: the file counts rows up to k - 1
        record = orjson.loads(progress_path(out, 0).read_bytes())
        seen.append((record["rows_done"], record["rows_committed"], len(read_out(out))))

    run_job(load_job(_job(tmp_path, model_dir, rows_per_part=4)), fake_factory(), Shard(0, 1), progress=False,
            on_row=check)
    assert [k for k in range(1, len(seen)) if seen[k][1] != seen[k - 1][2]] == [], seen
    assert seen[-1][1:] == (76, 80), seen[-1]


def test_live_state():
    now = 10_000.0
    running = {"state": "running", "updated": now - 30}
    assert live_state(running, True, now) == "running"
    assert live_state({**running, "updated": now - 601}, True, now) == "stalled"
    assert live_state(running, False, now) is None  # its process is gone
    assert live_state(running, None, now) == "running"  # cannot tell on this OS: by its age
    assert live_state({**running, "state": "loading"}, True, now) == "running"
    assert live_state({**running, "state": "stopped"}, True, now) is None


@pytest.mark.parametrize("slurm", [True, False])
def test_the_resume_line_follows_how_the_run_ran(tmp_path, model_dir, monkeypatch, slurm):
    """Under Slurm: the sbatch line with the script the run recorded; elsewhere: plain runs."""
    from dflash_batch.runner import Preempted

    for var in ("SLURM_JOB_ID", "DFLASH_SBATCH_SCRIPT"):
        monkeypatch.delenv(var, raising=False)
    if slurm:
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        monkeypatch.setenv("DFLASH_SBATCH_SCRIPT", "/cluster/me/array.sbatch")
    job_file = _job(tmp_path, model_dir)
    job = load_job(job_file)
    run_job(job, fake_factory(), Shard(0, 4), progress=False, job_file=str(job_file))

    def preempted(job, tokenizer):
        engine = fake_factory()(job, tokenizer)

        def generate(requests, bucket):
            raise Preempted()
            yield

        engine.generate = generate
        return engine

    with pytest.raises(Preempted):
        run_job(job, preempted, Shard(1, 4), progress=False, job_file=str(job_file))
    table, text = _status(tmp_path / "out")
    assert table["1"][-1] == "incomplete" and table["2"][-2:] == ["not", "started"], text
    target = f"{job_file.resolve()} --output-dir {(tmp_path / 'out').resolve()}"
    if slurm:
        assert f"  sbatch --array=1-3 --export=ALL,DFLASH_SHARDS=4 /cluster/me/array.sbatch {target}\n" in text, text
    else:
        assert "sbatch" not in text, text
        assert all(f"  dflash-batch run {target} --shard {i}/4\n" in text for i in (1, 2, 3)), text


def test_without_progress_bars_a_log_line_says_the_run_is_alive(tmp_path, model_dir, monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    job = load_job(_job(tmp_path, model_dir, rows_per_part=4))
    run_job(job, fake_factory(), Shard(0, 1), progress=False)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("shard-00000: ")]
    assert lines[0].startswith("shard-00000: 1 rows done this run, 0 committed, ") and lines[0].endswith(" rows/s")
    assert lines[-1].startswith("shard-00000: 80 rows done this run, 80 committed, ")
    run_job(load_job(_job(tmp_path, model_dir, dir="bars")), fake_factory(), Shard(0, 1), progress=True)
    assert "rows done this run" not in capsys.readouterr().err  # the bars say it


def test_the_slurm_template_reports_its_own_path(tmp_path):
    """Slurm runs a copy of the script; the template asks scontrol for the submitted one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dflash-batch").write_text('#!/bin/bash\necho "script=$DFLASH_SBATCH_SCRIPT"\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$3" = 123 ] || exit 1\n'
                                      'printf "JobId=123 JobName=x\\n   Command=/sub/jobs/array.sbatch job.yaml\\n'
                                      '   WorkDir=/sub\\n"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "123", "SLURM_ARRAY_TASK_ID": "0"}
    out = subprocess.run(["bash", str(ROOT / "jobs/slurm/array.sbatch"), "job.yaml"], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "script=/sub/jobs/array.sbatch"
