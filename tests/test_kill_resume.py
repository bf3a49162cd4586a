"""Resume with the real engine: a generated job run by `dflash-batch run`, SIGKILLed 20 times at
random moments (just after a commit, mid-decode, mid-start-up) and resumed each time, ends with
exactly the rows of an uninterrupted run: every row once, the same tokens and counters.

The model runs in float64 (model.dtype: float64): a resumed run decodes a row in another batch
than the uninterrupted run did, and in float32 a logit near-tie could then resolve the other way
(rounding, not a resume defect); in float64 the rows must be equal to the bit."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from dflash_batch.testing.tokenizer import make_tokenizer_dir
from tests.engine_util import make_drafter, make_target
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "dflash_batch.cli", "run", "--no-progress"]
# Timings, and the prompt tokens a row took from a shared head or a fork: which row of a head
# computes it depends on which rows a run admitted together (a resumed run, the rows left).
VOLATILE = {"ttft_s", "latency_s", "cached_tokens"}
ROWS, KILLS = 150, 20

pytestmark = pytest.mark.slow


def comparable(rows: list[dict]) -> dict:
    keys = Counter((r["row_id"], r["sample_index"]) for r in rows)
    assert max(keys.values(), default=1) == 1, f"duplicate rows: {[k for k, n in keys.items() if n > 1]}"
    return {(r["row_id"], r["sample_index"]): {k: v for k, v in r.items() if k not in VOLATILE} for r in rows}


def job(tmp_path: Path, out: str) -> Path:
    d = tmp_path / "models"
    if not d.exists():
        target = make_target(d / "target", vocab=320, active=8)  # holds the tokenizer's 261 ids
        make_tokenizer_dir(target, vocab_size=256)
        make_drafter(d / "drafter", 1, vocab=320)
    rows = [{"id": f"r{i}", "prompt": "What is 12 plus 30? " * (1 + i % 6)} for i in range(ROWS)]
    rows[9] = {"id": "r9", "prompt": ""}  # an error row survives resumes too
    write_jsonl(tmp_path / "p.jsonl", rows)
    doc = base_job(d / "target", ["p.jsonl"], sampling={"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9},
                   input={"workers": 0}, output={"dir": out, "rows_per_part": 1})
    doc["model"].update(drafter=str(d / "drafter"), dtype="float64")
    doc["engine"].update(max_num_seqs=3, compile=False)
    write_job(tmp_path, doc, f"{out}.yaml")
    return tmp_path / f"{out}.yaml"


def committed_parts(out: Path) -> int:
    """How many parts are committed (cheap: no file is read, so the poll keeps up with the run)."""
    return len(list(out.rglob("part-*.parquet")))


def test_twenty_sigkills_then_resume_equal_an_uninterrupted_run(tmp_path):
    reference = job(tmp_path, "ref")
    done = subprocess.run([*CLI, str(reference)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    expected = comparable(read_out(tmp_path / "ref"))
    assert len(expected) == ROWS

    killed = job(tmp_path, "killed")
    rng = random.Random(20261201)
    kills, progress = 0, []
    while kills < KILLS:
        proc = subprocess.Popen([*CLI, str(killed)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        before = committed_parts(tmp_path / "killed")
        if kills % 4 == 3:
            time.sleep(rng.uniform(0.0, 2.0))  # now and then during start-up
        else:  # else after it commits something new, at a random moment
            deadline = time.monotonic() + 60
            while committed_parts(tmp_path / "killed") == before and proc.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.1))
        if proc.poll() is not None:  # it finished first: the job is too small for the kills
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        progress.append(len(read_out(tmp_path / "killed")))
    assert kills == KILLS, f"the job finished after {kills} kills: {progress}"
    assert progress == sorted(progress) and progress[-1] < ROWS
    final = subprocess.run([*CLI, str(killed)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    got = comparable(read_out(tmp_path / "killed"))
    assert got.keys() == expected.keys()
    differ = [k for k in expected if {c: v for c, v in got[k].items() if c != "config_hash"}
              != {c: v for c, v in expected[k].items() if c != "config_hash"}]
    assert not differ, f"{len(differ)} rows differ from the uninterrupted run, e.g. {differ[:3]}"
    assert not list((tmp_path / "killed").rglob("*.tmp"))


def test_sigterm_mid_decode_stops_at_once_and_loses_nothing(tmp_path):
    """SIGTERM lands inside the real engine (a round, a prefill, several sequences in flight): the
    run exits 143 at once rather than after the engine's failure handling treats the stop as a
    failing request, and after five such stops the rows are the uninterrupted run's, with no
    error row but the input's own."""
    reference = job(tmp_path, "ref")
    assert subprocess.run([*CLI, str(reference)], cwd=ROOT, capture_output=True, timeout=300).returncode == 0
    expected = comparable(read_out(tmp_path / "ref"))
    stopped = job(tmp_path, "stopped")
    rng = random.Random(7)
    for _ in range(5):
        proc = subprocess.Popen([*CLI, str(stopped)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        before, deadline = committed_parts(tmp_path / "stopped"), time.monotonic() + 60
        while committed_parts(tmp_path / "stopped") == before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.1))
        assert proc.poll() is None, "the job finished before it could be stopped"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, proc.stderr.read()
        assert time.monotonic() - sent < 5, "the stop waited for the engine"
    errors = [r for r in read_out(tmp_path / "stopped") if r["status"] != "ok"]
    assert [r["row_id"] for r in errors] == ["r9"], [(r["row_id"], r["error_type"]) for r in errors]
    assert subprocess.run([*CLI, str(stopped)], cwd=ROOT, capture_output=True, timeout=300).returncode == 0
    got = comparable(read_out(tmp_path / "stopped"))
    assert {k: {c: v for c, v in r.items() if c != "config_hash"} for k, r in got.items()} == \
        {k: {c: v for c, v in r.items() if c != "config_hash"} for k, r in expected.items()}
