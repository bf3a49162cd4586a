"""Installing the package beside the ecosystem's: a host's own torch is kept (the GPU image's CUDA
torch 2.11, stood in for by its metadata: pip decides from it alone, and would replace it for a
pin to another release; needs the package registry, CI has it), and Hugging Face's `kernels`
package keeps its import name (this repository's kernels/ is dflash_batch.kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_pip_install_beside_a_cuda_torch_2_11_would_not_touch_it(tmp_path):
    venv.create(tmp_path / "env", with_pip=True)
    python = tmp_path / "env" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    info = Path(site) / "torch-2.11.0+cu128.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu128\n")
    (info / "RECORD").write_text("")
    (info / "INSTALLER").write_text("pip\n")
    report = tmp_path / "report.json"
    out = subprocess.run([python, "-m", "pip", "install", "-q", "--dry-run", "--report", str(report), str(ROOT)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode and "Could not find a version" in out.stderr + out.stdout:
        pytest.skip(f"no package registry here: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    installs = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert "dflash-batch" in installs and "torch" not in installs, installs


def test_hugging_faces_kernels_keeps_its_name_beside_this_package(tmp_path):
    """From the repository root (where a top-level kernels/ would shadow it first), `import kernels`
    is an installed package of that name (Hugging Face's, stood in for here), and this package's
    kernels are dflash_batch.kernels in the same process."""
    hf = tmp_path / "site" / "kernels"
    hf.mkdir(parents=True)
    (hf / "__init__.py").write_text("WHOSE = 'hugging face'\n")
    code = ("import kernels, dflash_batch.kernels.ops as ops, dflash_batch.kernels.sample as sample; "
            "print(kernels.WHOSE, ops.__name__, sample.top1.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["hugging", "face", "dflash_batch.kernels.ops", "top1"]
