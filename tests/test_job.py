"""Job file validation: schema drift, and bad job files rejected with messages that say where."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from dflash_batch.cli import SCHEMA_DIR
from dflash_batch.job import JobError, job_json_schema, load_job, parse_job
from dflash_batch.testing.tokenizer import make_tokenizer_dir

GOOD = {
    "input": {"paths": ["prompts.jsonl"], "prompt_column": "prompt"},
    "model": {"target": "models/target"},
    "output": {"dir": "out"},
}


def with_(path: str, value, base=GOOD) -> dict:
    doc = json.loads(json.dumps(base))
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    if value is ...:
        node.pop(last)
    else:
        node[last] = value
    return doc


def test_checked_in_schemas_match_the_code(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dflash_batch.cli", "schema", "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads((SCHEMA_DIR / "job.schema.json").read_text()) == job_json_schema()


def test_schema_check_fails_on_drift(tmp_path):
    (tmp_path / "job.schema.json").write_text("{}")
    out = subprocess.run([sys.executable, "-m", "dflash_batch.cli", "schema", "--check", "--dir",
                          str(tmp_path)], capture_output=True, text=True)
    assert out.returncode != 0 and "out of date" in out.stderr


def test_good_job_resolves_paths_against_its_file(tmp_path):
    (tmp_path / "j.yaml").write_text(yaml.safe_dump(GOOD))
    job = load_job(tmp_path / "j.yaml")
    assert job.input.paths == [str(tmp_path / "prompts.jsonl")]
    assert job.model.target == str(tmp_path / "models/target")
    assert job.output.dir == str(tmp_path / "out")
    assert job.model.drafter is None and job.sampling.temperature == 0.0


BAD = [
    # (what is wrong, the document, text the message must contain)
    ("unknown top-level key", with_("outputs", {"dir": "x"}), "outputs: unknown key"),
    ("typo in a nested key", with_("sampling.temprature", 0.7), "sampling.temprature: unknown key"),
    ("missing section", with_("model", ...), "model: Field required"),
    ("no prompt column", with_("input.prompt_column", ...), "set exactly one of prompt_column"),
    ("two prompt columns", with_("input.messages_column", "m"), "set exactly one of prompt_column"),
    ("empty paths", with_("input.paths", []), "input.paths"),
    ("bad dtype", with_("model.dtype", "fp8"), "model.dtype"),
    ("negative temperature", with_("sampling.temperature", -1), "sampling.temperature"),
    ("top_p out of range", with_("sampling.top_p", 1.5), "sampling.top_p"),
    ("wrong type", with_("sampling.max_new_tokens", "many"), "sampling.max_new_tokens"),
    ("buckets not ascending", with_("buckets", [{"max_tokens": 4096}, {"max_tokens": 1024}]),
     "strictly ascending"),
    ("bucket beyond max_model_len", with_("buckets", [{"max_tokens": 65536}]), "exceeds engine.max_model_len"),
    ("bucket beyond 128k", with_("engine.max_model_len", 262144), "engine.max_model_len"),
    ("bad overflow policy", with_("overflow", "drop"), "overflow"),
    ("explicit shard without count", with_("sharding", {"mode": "explicit", "index": 1}),
     "needs both index and count"),
    ("explicit shard index out of range", with_("sharding", {"mode": "explicit", "index": 4, "count": 4}),
     "must be < count"),
    ("unknown sampling override field", with_("input.sampling_columns", {"temp": "t"}),
     "unknown sampling field"),
    ("empty stop string", with_("sampling.stop", [""]), "stop strings must be non-empty"),
    ("bad version", with_("version", 2), "version"),
    ("negative workers", with_("input.workers", -1), "input.workers"),
    ("tools without messages", with_("input.tools_column", "tools"), "tools_column is only used with messages_column"),
    ("a head too short to share", with_("engine.shared_head_tokens", 32), "a head shorter than 64 tokens"),
    ("head length without sharing", with_("engine", {"share_prompts": False, "shared_head_tokens": 4096}),
     "shared_head_tokens is set but share_prompts is false"),
    ("headroom without a GPU", with_("engine.gpu_memory_headroom", 0.03),
     "gpu_memory_headroom is set but gpu_memory is not"),
    ("headroom of the whole GPU", with_("engine", {"gpu_memory": "h200", "gpu_memory_headroom": 1.0}),
     "engine.gpu_memory_headroom: Input should be less than 1"),
    ("negative headroom", with_("engine", {"gpu_memory": "h200", "gpu_memory_headroom": -0.03}),
     "engine.gpu_memory_headroom: Input should be greater than or equal to 0"),
]


@pytest.mark.parametrize("what,doc,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_job_files_name_the_field(what, doc, needle):
    with pytest.raises(JobError) as e:
        parse_job(doc, "jobs/x.yaml")
    msg = str(e.value)
    assert msg.startswith("jobs/x.yaml: invalid job file")
    assert needle in msg, msg


def test_not_a_mapping_and_bad_yaml(tmp_path):
    (tmp_path / "a.yaml").write_text("- just\n- a list\n")
    with pytest.raises(JobError, match="must be a YAML mapping"):
        load_job(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("input: [unclosed\n")
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(tmp_path / "b.yaml")
    with pytest.raises(JobError, match="cannot read job file"):
        load_job(tmp_path / "missing.yaml")


def test_config_hash_ignores_tuning_but_not_sampling():
    base = parse_job(GOOD)
    assert parse_job(with_("engine.max_num_seqs", 7)).output_hash() == base.output_hash()
    assert parse_job(with_("output.dir", "elsewhere")).output_hash() == base.output_hash()
    assert parse_job(with_("input.workers", 5)).output_hash() == base.output_hash()
    on_h200 = parse_job(with_("engine.gpu_memory", "h200"))
    headroom = parse_job(with_("engine", {"gpu_memory": "h200", "gpu_memory_headroom": 0.03}))
    assert headroom.output_hash() == on_h200.output_hash()
    assert parse_job(with_("sampling.temperature", 0.5)).output_hash() != base.output_hash()
    assert parse_job(with_("model.drafter", "d")).output_hash() != base.output_hash()


@pytest.mark.slow
def test_validate_command(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "models" / "target").mkdir(parents=True)
    (tmp_path / "models" / "target" / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    good = with_("input.paths", ["p.jsonl"])
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(good))
    cli = [sys.executable, "-m", "dflash_batch.cli", "validate"]
    no_tokenizer = subprocess.run([*cli, str(tmp_path / "good.yaml")], capture_output=True, text=True)
    assert no_tokenizer.returncode == 2 and "no tokenizer.json or tiktoken.model" in no_tokenizer.stderr
    make_tokenizer_dir(tmp_path / "models" / "target")
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(good))
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(with_("sampling.top_k", -5, good)))
    (tmp_path / "nofile.yaml").write_text(yaml.safe_dump(GOOD))
    ok = subprocess.run([*cli, str(tmp_path / "good.yaml")], capture_output=True, text=True)
    assert ok.returncode == 0 and "ok" in ok.stdout
    assert "engine: device=" in ok.stdout  # what this host would run, without running it
    (tmp_path / "graphs.yaml").write_text(yaml.safe_dump(with_("engine.cudagraph_capture_sizes", [1, 2], good)))
    refused = subprocess.run([*cli, str(tmp_path / "graphs.yaml")], capture_output=True, text=True)
    assert refused.returncode == 2 and "cudagraph_capture_sizes is set but CUDA graphs are off" in refused.stderr
    bad = subprocess.run([*cli, str(tmp_path / "bad.yaml")], capture_output=True, text=True)
    assert bad.returncode == 2 and "sampling.top_k" in bad.stderr
    missing = subprocess.run([*cli, str(tmp_path / "nofile.yaml")], capture_output=True, text=True)
    assert missing.returncode == 2 and "prompts.jsonl" in missing.stderr and "does not exist" in missing.stderr


@pytest.mark.slow
def test_production_job_files_validate():
    for name in ("kimi-k3-dflash2.yaml", "kimi-k3-dflash2-128k.yaml"):
        out = subprocess.run([sys.executable, "-m", "dflash_batch.cli", "validate", "--no-inputs",
                              str(SCHEMA_DIR.parent / "jobs" / name)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    job = load_job(SCHEMA_DIR.parent / "jobs" / "kimi-k3-dflash2-128k.yaml")
    assert job.model.tensor_parallel_size == 8 and job.resolved_buckets()[-1].max_tokens == 131072


def test_the_manuals_job_example_is_a_valid_job():
    text = (SCHEMA_DIR.parent / "docs" / "job-file.md").read_text()
    example = text.split("```yaml")[1].split("```")[0]
    job = parse_job(yaml.safe_load(example), "docs/job-file.md", SCHEMA_DIR.parent)
    assert job.output.split_reasoning and job.input.sampling_columns["n"] == "samples"
