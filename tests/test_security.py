"""Inputs are data: nothing in a job file, an input row or a checkpoint runs code.

Each case plants a payload that would create a marker file if it ran, and checks both that the
input is refused (or becomes an error row) with a clear message and that the marker never
appears: YAML tags that construct Python objects, a pickled checkpoint (only safetensors load),
a checkpoint that brings its own modeling code (no remote code: unknown architectures are
refused), and a chat template that reaches for Python internals (jinja2's sandbox, as
transformers renders templates)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_batch.job import JobError, load_job
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from dflash_batch.testing.tokenizer import make_tokenizer_dir
from tests.engine_util import make_target
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

CLI = [sys.executable, "-m", "dflash_batch.cli"]


class Payload:
    """Unpickling this runs `touch marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (__import__("os").system, (f"touch {self.marker}",))


@pytest.mark.parametrize("tag", ["!!python/object/apply:os.system", "!!python/object/new:os.system"])
def test_yaml_tags_that_build_python_objects_are_refused(tmp_path, model_dir, tag):
    marker = tmp_path / "ran"
    job = base_job(model_dir, ["p.jsonl"])
    (tmp_path / "job.yaml").write_text(
        f"{json.dumps(job)[:-1]}, \"extra\": {tag} [\"touch {marker}\"]}}")
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(tmp_path / "job.yaml")
    assert not marker.exists()


def checkpoint_run(tmp_path: Path, target: Path) -> subprocess.CompletedProcess:
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    write_job(tmp_path, base_job(target, ["p.jsonl"]))
    return subprocess.run([*CLI, "run", str(tmp_path / "job.yaml"), "--no-progress"], capture_output=True,
                          text=True, timeout=120)


def test_a_pickled_checkpoint_is_never_unpickled(tmp_path):
    marker = tmp_path / "ran"
    target = make_target(tmp_path / "target", vocab=320)
    make_tokenizer_dir(target, vocab_size=256)
    (target / "model.safetensors").unlink()
    (target / "pytorch_model.bin").write_bytes(pickle.dumps({"model": Payload(marker)}))
    out = checkpoint_run(tmp_path, target)
    assert out.returncode == 2 and "no model.safetensors or model.safetensors.index.json" in out.stderr, out.stderr
    assert not marker.exists()
    assert not list(tmp_path.rglob("part-*.parquet"))


def test_a_checkpoint_with_its_own_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    target = make_target(tmp_path / "target", vocab=320)
    make_tokenizer_dir(target, vocab_size=256)
    config = json.loads((target / "config.json").read_text())
    config.update(architectures=["EvilForCausalLM"], auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (target / "config.json").write_text(json.dumps(config))
    (target / "modeling_evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    out = checkpoint_run(tmp_path, target)
    assert out.returncode == 2 and "unsupported architecture 'EvilForCausalLM'" in out.stderr, out.stderr
    assert not marker.exists()


ESCAPES = [
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for m in messages %}{{ m.__class__.__init__.__globals__ }}{% endfor %}",
    "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_a_chat_template_cannot_reach_python(tmp_path, model_dir, template):
    marker = tmp_path / "ran"
    (tmp_path / "evil.jinja").write_text(template.replace("MARKER", str(marker)))
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}])
    doc = base_job(model_dir, ["p.jsonl"])
    doc["input"] = {"paths": ["p.jsonl"], "messages_column": "messages", "id_column": "id"}
    doc["model"]["chat_template"] = "evil.jinja"
    run_job(write_job(tmp_path, doc), fake_factory(), Shard(0, 1), progress=False)
    [row] = read_out(tmp_path / "out")
    assert row["status"] == "error" and row["error_type"] == "chat_template_error", row
    assert row["error"].startswith("SecurityError: access to attribute"), row["error"]
    assert not marker.exists()
