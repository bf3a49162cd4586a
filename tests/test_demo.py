"""The shipped demo: the committed pair reproduces the README's figures through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ROOT / "jobs/demo/expected.json"


@pytest.mark.skipif(not EXPECTED.exists(), reason="the demo pair has not been trained yet")
def test_demo_job_reproduces_the_readme_acceptance(tmp_path):
    expected = json.loads(EXPECTED.read_text())
    cli = [sys.executable, "-m", "dflash_batch.cli"]
    run = subprocess.run([*cli, "run", "jobs/demo.yaml", "--output-dir", str(tmp_path / "out"), "--no-progress"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "acc_len" in run.stdout  # the summary table
    report = subprocess.run([*cli, "report", str(tmp_path / "out"), "--json"], cwd=ROOT, capture_output=True,
                            text=True)
    result = json.loads(report.stdout)
    assert result["overall"]["requests"] == expected["requests"]
    assert abs(result["overall"]["acc_len"] - expected["acc_len"]) <= 0.05
    assert len(result["buckets"]) >= 2  # the long prompts use the second bucket
