"""benchmarks/gpu_check.sh's plan: the first list fits its 420 s, and its pytest stages, each with
its own -k as the device runs it, select every test of tests/test_gpu.py (pytest itself collects
them here: the tests skip without CUDA but are collected), so none is left unrun on the device.
And the premise of tests/test_gpu.py's greedy comparisons, on the CPU: the reference runs it
compares with keep most steps clear of near ties, so those comparisons test something."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_batch.engine.engine import Engine
from tests import test_gpu

ROOT = Path(__file__).resolve().parents[1]


def collected(args: list[str]) -> set[str]:
    """The node ids pytest collects with these arguments (its own -k and -m matching)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode in (0, 5), done.stdout + done.stderr
    return {line for line in done.stdout.splitlines() if "::" in line}


def pytest_args(command: str) -> list[str]:
    """A stage's pytest arguments: after `-m pytest`, without pytest-timeout's --timeout and -q
    (collected() asks for the node ids one -q lists)."""
    words = shlex.split(command)
    args = [w for w in words[words.index("pytest") + 1:] if w != "-q"]
    if "--timeout" in args:
        i = args.index("--timeout")
        del args[i:i + 2]
    return args


@pytest.mark.slow
def test_the_first_list_fits_and_selects_every_gpu_test():
    plan = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--plan"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PLAN_COUNTS": "0"})
    assert plan.returncode == 0, plan.stdout + plan.stderr
    total, budget = map(int, re.search(r"== first list: (\d+) s of (\d+)", plan.stdout).groups())
    assert budget == 420 and total <= budget
    stages = re.findall(r"== selects (\w+) \((first|then)\): (.*)", plan.stdout)
    first = [pytest_args(cmd) for _, when, cmd in stages if when == "first" and "tests/test_gpu.py" in cmd]
    assert len(first) >= 3 and all(args[-2] == "-k" and args[:-2] == first[0][:-2] for args in first), first
    # The stages differ only in -k, so one collection with their expressions or-ed is their union.
    selected = collected([*first[0][:-2], "-k", " or ".join(f"({args[-1]})" for args in first)])
    every = collected(["-m", "gpu", "tests/test_gpu.py"])
    assert len(every) >= 20
    assert not every - selected, f"no stage of the first list selects {sorted(every - selected)}"


def cleared(runs: dict, margin: float) -> float:
    """The share of steps compared_to_near_ties compares (each run against itself)."""
    return test_gpu.compared_to_near_ties({k: test_gpu.outcome(c) for k, c in runs.items()}, runs, margin) / \
        test_gpu.steps(runs)


def test_the_kimi_pair_leaves_most_steps_to_compare_with_the_cpu(tmp_path):
    runs = test_gpu.completions(Engine(*test_gpu.load(test_gpu.kimi_pair(tmp_path), "cpu")), 9, logprobs=2)
    assert cleared(runs, test_gpu.TF32_MARGIN) >= test_gpu.MOSTLY


def test_the_qwen3_pair_leaves_most_bfloat16_steps_to_compare(tmp_path):
    engine = Engine(*test_gpu.load(test_gpu.qwen_pair(tmp_path), "cpu", torch.bfloat16), dtype=torch.bfloat16)
    assert cleared(test_gpu.completions(engine, 7, logprobs=2), test_gpu.BF16_MARGIN) >= test_gpu.MOSTLY
    assert cleared(test_gpu.completions(engine, 9, speculation=False, logprobs=2), test_gpu.BF16_MARGIN) >= test_gpu.MOSTLY


def test_a_stage_is_judged_by_its_numbers_not_its_exit_code(tmp_path):
    """gpu_check_verdict.py on what stages write: pytest's per-test lines (here the conftest hook's,
    from a real run of tests/test_gpu.py without CUDA: all skipped) and kimi_gpu_check's criteria."""
    from benchmarks.gpu_check_verdict import verdict

    report = tmp_path / "torch_qwen.json"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py",
                    "-k", "torch_backend"], cwd=ROOT, env={**os.environ, "DFLASH_TEST_REPORT": str(report)}, check=True)
    assert verdict("torch_qwen", 0, report)[0] == "SKIPPED"
    passed = '{"test": "t::a", "when": "call", "outcome": "passed", "seconds": 1}'
    failed = '{"test": "t::b", "when": "call", "outcome": "failed", "seconds": 1}'
    torn = '{"test": "t::a", "when": "teardown", "outcome": "failed", "seconds": 0}'
    for lines, rc, want in [([passed], 0, "pass"), ([passed, failed], 0, "FAIL"), ([passed, torn], 0, "FAIL"),
                            ([passed], 124, "TIMEOUT"), ([passed], 1, "FAIL")]:
        report.write_text("\n".join(lines) + "\n")
        assert verdict("torch_kimi", rc, report)[0] == want, (lines, rc)
    met = {"pass": True, "value": 1}
    everything = {"logits vs CPU": met, "graph == eager": met, "spec greedy == target-only": met}
    for criteria, rc, want in [(everything, 0, "pass"), ({**everything, "graph == eager": {"pass": False}}, 0, "FAIL"),
                               ({"logits vs CPU": met}, 0, "FAIL"), ({"logits vs CPU": met}, 124, "TIMEOUT")]:
        report.write_text(json.dumps({"criteria": criteria}) + "\n")
        assert verdict("kimi_flashinfer", rc, report)[0] == want, (criteria, rc)


def test_greedy_runs_are_compared_up_to_the_first_near_tie():
    """compared_to_near_ties: tokens after a step whose reference margin is under the margin may
    differ (a rounding can flip a near tie); before it, or in the accepted drafts of a sequence
    without one, a difference fails."""
    from types import SimpleNamespace as C

    def run(tokens, margins, rounds=None):
        return C(token_ids=tokens, spec=C(per_round=rounds) if rounds else None,
                 logprobs=C(top=[[-1.0, -1.0 - m] for m in margins]))

    want = {"a": run([1, 2, 3, 4], [1.0, 0.01, 1.0, 1.0]), "b": run([5, 6], [1.0, 1.0], [1, 0])}
    assert test_gpu.compared_to_near_ties({"a": ([1, 9, 9, 9], None), "b": ([5, 6], [1, 0])}, want, 0.1) == 3
    for got in ({"a": ([7, 2, 3, 4], None), "b": ([5, 6], [1, 0])}, {"a": ([1, 2, 3, 4], None), "b": ([5, 6], [0, 1])}):
        with pytest.raises(AssertionError):
            test_gpu.compared_to_near_ties(got, want, 0.1)
