"""Shared fixtures: a tiny trained BPE tokenizer with a chat template, in HF layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on the CPU through Triton's interpreter; the switch is read when a kernel
# is defined, so it must be set before any test imports dflash_batch.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dflash_batch.testing.tokenizer import make_tokenizer_dir

# The tiny models here gain nothing from intra-op threads, and on a 2-core machine that is
# also running other processes a second thread makes every small op wait for it: one thread,
# unless OMP_NUM_THREADS asks otherwise (CI runs the numerics tests with 2 as well: results must
# hold whatever the reduction order). The commands tests start inherit it: a CLI run left to pick
# a thread per core spin-waits for the one the other worker holds (the demo: 10 s alone, 96 s
# beside a busy worker with two threads, 28 s with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture()
def model_dir(tmp_path, tokenizer_dir) -> Path:
    """A 'target' directory with the tokenizer files and a config.json naming EOS."""
    d = tmp_path / "model"
    d.mkdir()
    for f in tokenizer_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    eos = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]["<|im_end|>"]
    (d / "config.json").write_text(json.dumps({"architectures": ["FakeForTests"], "eos_token_id": eos}))
    return d


def pytest_runtest_logreport(report) -> None:
    """The GPU check's numbers ($DFLASH_TEST_REPORT, set by benchmarks/gpu_check.sh): one JSON line
    per test as it ends (its call, or a setup or teardown that did not pass), so a stage cut off
    by its limit still shows which tests passed."""
    path = os.environ.get("DFLASH_TEST_REPORT")
    if path and (report.when == "call" or report.outcome != "passed"):
        with open(path, "a") as f:
            f.write(json.dumps(dict(test=report.nodeid, when=report.when, outcome=report.outcome,
                                    seconds=round(report.duration, 2))) + "\n")
