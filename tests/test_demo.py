"""The shipped demo: the committed pair reproduces the README's figures through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ROOT / "jobs/demo/expected.json"


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_pinned_draft_count_reports_acceptance_of_the_drafts_verified(tmp_path):
    """The demo's first 12 prompts with `speculation: {drafts: 2}`: each row's proposal acceptance
    is its accepted drafts over the drafts its rounds verified (2 a round; the last round's up to
    the sample's end), so a row that accepted every draft it was shown reads 1.0, and the report
    gives no α for positions 3..7, which no round tried (0 trials), instead of 0."""
    import yaml

    from tests.jobs_util import read_out
    doc = yaml.safe_load((ROOT / "jobs/demo.yaml").read_text())
    (tmp_path / "p.jsonl").write_text("".join((ROOT / "jobs/demo/prompts.jsonl").read_text().splitlines(True)[:12]))
    doc["input"]["paths"] = ["p.jsonl"]
    doc["model"] = {k: str(ROOT / "jobs" / v) if k in ("target", "drafter") else v for k, v in doc["model"].items()}
    doc["buckets"] = [{**b, "speculation": {"drafts": 2}} for b in doc["buckets"]]
    doc["output"]["dir"] = "out"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    cli = [sys.executable, "-m", "dflash_batch.cli"]
    run = subprocess.run([*cli, "run", str(tmp_path / "job.yaml"), "--no-progress"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = read_out(tmp_path / "out")
    for r in rows:
        hist, tried = r["spec_histogram"], r["spec_verified_histogram"]
        assert hist[3:] == tried[3:] == [0] * 5 and tried[2] >= r["spec_rounds"] - 1
        assert r["spec_drafts_verified"] == sum(n * c for n, c in enumerate(tried))
        assert r["proposal_acceptance"] == r["spec_accepted"] / r["spec_drafts_verified"]
    perfect = [r for r in rows if r["spec_histogram"][2] == r["spec_rounds"]]
    assert perfect and all(r["proposal_acceptance"] == 1.0 for r in perfect)
    report = json.loads(subprocess.run([*cli, "report", str(tmp_path / "out"), "--json"], cwd=ROOT,
                                       capture_output=True, text=True).stdout)["overall"]
    assert report["alpha"][2:] == [None] * 5 and report["trials"][2:] == [0] * 5
    assert report["trials"][:2] == [sum(r["spec_verified_histogram"][1] + r["spec_verified_histogram"][2]
                                        for r in rows)] + [sum(r["spec_verified_histogram"][2] for r in rows)]
    assert report["proposal_acceptance"] == pytest.approx(
        sum(r["spec_accepted"] for r in rows) / sum(r["spec_drafts_verified"] for r in rows))
