"""What the GPU check runs imports on the GPU machine, whose image has neither transformers nor
the dflash reference package (benchmarks/prepare_wheels.sh carries neither): its modules, and
every project module they import, at the top or inside a test."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("dflash", "transformers")
# What benchmarks/gpu_check.sh runs on the device: every Python file its stages name.
CHECK = sorted(set(re.findall(r"\b(?:tests|benchmarks)/\w+\.py", (ROOT / "benchmarks/gpu_check.sh").read_text())))
OURS = ("dflash_batch", "tests", "benchmarks")

PROBE = """
import importlib, importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f"{{name}} is not on the GPU machine")
sys.meta_path.insert(0, Absent())
for module in {modules!r}:
    importlib.import_module(module)
"""


def imported(path: Path) -> set[str]:
    """The project modules a file imports anywhere in it (lazy imports inside tests too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.split(".")[0] in OURS}


def test_the_gpu_check_imports_without_the_reference_packages():
    modules = sorted({p.removesuffix(".py").replace("/", ".") for p in CHECK}.union(*(imported(ROOT / p) for p in CHECK)))
    assert "tests.paged_layouts" in modules and "tests.test_kernels_moe" in modules  # a lazy import; a stage's file
    done = subprocess.run([sys.executable, "-c", PROBE.format(blocked=BLOCKED, modules=modules)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
