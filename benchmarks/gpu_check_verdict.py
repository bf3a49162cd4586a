"""One GPU-check stage's verdict, read from the numbers it wrote (benchmarks/gpu_check.sh runs it
after each stage), printed as one JSON line:

- a pytest stage wrote OUT/STAGE.json, one line per test as it ended (tests/conftest.py,
  $DFLASH_TEST_REPORT): pass when every test it ran passed and at least one ran; SKIPPED when
  all were skipped (no flashinfer, one GPU for TP2); FAIL naming the failed tests;
- a script stage wrote OUT/STAGE.json as {"criteria": {name: {"pass": bool, ...}}, ...}, rewritten
  as each section ended: pass when every criterion it must meet is there and met;
- a stage that writes no numbers (install, preflight, the checkpoints) or a table of figures
  without criteria (the Qwen3 tables) passes on its exit code.

A timeout is TIMEOUT whatever was written (the numbers say how far it got); the Triton kernels the
stage found missing from the carried cache are counted from OUT/triton_misses.txt.

python benchmarks/gpu_check_verdict.py STAGE RC SECONDS LIMIT CRITERION OUT MISSES_BEFORE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REQUIRED = {"kimi_flashinfer": ("logits vs CPU", "graph == eager", "spec greedy == target-only"),
            "kimi_torch": ("logits vs CPU", "graph == eager", "spec greedy == target-only")}
RANK = {"passed": 0, "skipped": 1, "failed": 2}  # a test's setup, call and teardown: the worst counts


def from_criteria(stage: str, rc: int, criteria: dict) -> tuple[str, dict]:
    unmet = [k for k, v in criteria.items() if not v["pass"]]
    absent = [k for k in REQUIRED.get(stage, ()) if k not in criteria]
    shown = {"criteria": {k: v.get("value") for k, v in criteria.items()}, "unmet": unmet, "not reached": absent}
    if rc == 124:
        return "TIMEOUT", shown
    return ("FAIL" if unmet or absent or rc else "pass"), shown


def from_tests(rc: int, lines: list[dict]) -> tuple[str, dict]:
    outcomes: dict[str, str] = {}
    for t in lines:
        if RANK[t["outcome"]] >= RANK[outcomes.get(t["test"], "passed")]:
            outcomes[t["test"]] = t["outcome"]
    failed = sorted(t for t, o in outcomes.items() if o == "failed")
    counts = {o: sum(v == o for v in outcomes.values()) for o in RANK}
    shown = {"tests": counts, "failed": failed}
    if rc == 124:
        return "TIMEOUT", shown
    if failed or rc:
        return "FAIL", shown
    return ("pass" if counts["passed"] else "SKIPPED"), shown


def verdict(stage: str, rc: int, numbers: Path) -> tuple[str, dict]:
    """(verdict, what it rests on)."""
    text = numbers.read_text().strip() if numbers.exists() else ""
    if not text:
        return ("TIMEOUT" if rc == 124 else "FAIL" if rc else "pass"), {"evidence": "exit code"}
    try:
        whole = json.loads(text)
    except ValueError:  # JSON lines
        whole = None
    if isinstance(whole, dict) and "criteria" in whole:
        return from_criteria(stage, rc, whole["criteria"])
    if isinstance(whole, dict):  # a table of figures, no criterion of its own
        return ("TIMEOUT" if rc == 124 else "FAIL" if rc else "pass"), {"evidence": "exit code (a table)"}
    return from_tests(rc, [json.loads(line) for line in text.splitlines()])


def main() -> None:
    stage, rc, seconds, limit, criterion, out, before = sys.argv[1:8]
    v, shown = verdict(stage, int(rc), Path(out, f"{stage}.json"))
    misses = Path(out, "triton_misses.txt")
    missed = misses.read_text().splitlines()[int(before):] if misses.exists() else []
    print(json.dumps(dict(stage=stage, verdict=v, rc=int(rc), seconds=int(seconds), limit=int(limit), **shown,
                          triton_misses=len(missed), criterion=criterion)))


if __name__ == "__main__":
    main()
