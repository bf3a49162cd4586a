"""The bad-input corpus: what a user can get wrong, each case with the message or error row it
gets. Job files are in tests/test_job.py (24 cases, each naming the field or the problem); here
are input rows (each an error row naming its problem, the rest of the input unharmed), inputs
and checkpoints (each stopping the run before any work with a message that says what to fix),
and a property test: random bytes and random JSON lines never crash the readers and never lose
a good row."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from dflash_batch.build import build_engine
from dflash_batch.job import JobError
from dflash_batch.plan.shards import Shard
from dflash_batch.plan.tokenize import Tokenizer
from dflash_batch.runner import run_job
from dflash_batch.testing.tokenizer import make_tokenizer_dir
from tests.engine_util import make_drafter, make_target
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

# -- input rows: error rows --------------------------------------------------------------------
# (what, the JSONL line, error_type, words in the message)
ROWS = [
    ("not JSON", b"{'prompt': 'single quotes'}", "bad_input_line", "is not valid JSON"),
    ("truncated JSON", b'{"id": "t", "prompt": "half', "bad_input_line", "is not valid JSON"),
    ("JSON array", b'["a", "b"]', "bad_input_line", "is JSON list, not an object"),
    ("JSON string", b'"just text"', "bad_input_line", "is JSON str, not an object"),
    ("missing prompt", {"id": "m"}, "missing_prompt", "column 'prompt' is missing or null"),
    ("null prompt", {"id": "n", "prompt": None}, "missing_prompt", "missing or null"),
    ("prompt is a number", {"id": "num", "prompt": 42}, "bad_prompt_type", "must be a string, got int"),
    ("prompt is a list", {"id": "lst", "prompt": ["a"]}, "bad_prompt_type", "must be a string, got list"),
    ("empty prompt", {"id": "e", "prompt": "   "}, "empty_prompt", "is empty"),
    ("id is a list", {"id": [1], "prompt": "hi"}, "bad_row_id", "id column 'id' is [1]"),
    ("id is empty", {"id": "", "prompt": "hi"}, "bad_row_id", "id column 'id' is ''"),
    ("override not a number", {"id": "o1", "prompt": "hi", "budget": "lots"}, "bad_sampling_override",
     "budget: Input should be a valid integer"),
    ("override out of range", {"id": "o2", "prompt": "hi", "temp": -2}, "bad_sampling_override",
     "temp: Input should be greater than or equal to 0"),
    ("budget leaves no room", {"id": "o3", "prompt": "hi", "budget": 100000}, "max_new_tokens_too_large",
     "leaves no room for a prompt"),
    ("prompt too long", {"id": "long", "prompt": "word " * 400}, "prompt_too_long",
     "exceeds 256 (set overflow: truncate_left/truncate_right"),
]


def test_bad_rows_become_error_rows_and_the_good_ones_run(tmp_path, model_dir):
    lines = [r if isinstance(r, bytes) else orjson.dumps(r) for _, r, _, _ in ROWS]
    good = [{"id": f"good{i}", "prompt": f"a fine prompt {i}"} for i in range(3)]
    write_jsonl(tmp_path / "p.jsonl", [good[0], *lines[:8], good[1], *lines[8:], good[2]])
    doc = base_job(model_dir, ["p.jsonl"], input={"sampling_columns": {"max_new_tokens": "budget",
                                                                        "temperature": "temp"}, "workers": 0})
    run_job(write_job(tmp_path, doc), fake_factory(), Shard(0, 1), progress=False)
    out = read_out(tmp_path / "out")
    assert len(out) == len(ROWS) + 3, "a line was lost or doubled"
    assert {r["row_id"] for r in out if r["status"] == "ok"} == {g["id"] for g in good}
    errors = [r for r in out if r["status"] == "error"]
    by_line = sorted(errors, key=lambda r: r["error"])
    for what, _, kind, words in ROWS:
        match = [r for r in by_line if r["error_type"] == kind and words in r["error"]]
        assert match, f"{what}: no error row {kind!r} saying {words!r}; got {[(r['error_type'], r['error']) for r in errors]}"


def test_rows_the_model_cannot_take_become_error_rows(tmp_path, model_dir):
    """Token ids outside the target's vocabulary, and a chat that the template renders to nothing."""
    write_jsonl(tmp_path / "ids.jsonl", [{"id": "big", "ids": [5, 400]}, {"id": "fine", "ids": [5, 6]},
                                         {"id": "bias", "ids": [5], "lb": {"7": 1.0, "301": -2.0}},
                                         {"id": "bad bias", "ids": [5], "lb": {"7": 500}}])
    doc = base_job(model_dir, ["ids.jsonl"], input={"prompt_column": None, "input_ids_column": "ids",
                                                    "sampling_columns": {"logit_bias": "lb"}})

    def engine_with_vocab(job, tok):
        engine = fake_factory()(job, tok)
        engine.vocab_size = 300
        return engine

    run_job(write_job(tmp_path, doc), engine_with_vocab, Shard(0, 1), progress=False)
    out = {r["row_id"]: r for r in read_out(tmp_path / "out")}
    assert out["fine"]["status"] == "ok"
    assert (out["big"]["error_type"], out["big"]["error"]) == (
        "token_out_of_range", "prompt token id 400 is outside the model's vocabulary of 300")
    assert (out["bias"]["error_type"], out["bias"]["error"]) == (
        "token_out_of_range", "logit_bias token id 301 is outside the model's vocabulary of 300")
    assert out["bad bias"]["error_type"] == "bad_sampling_override" and "[-100, 100]" in out["bad bias"]["error"]

    (tmp_path / "silent.jinja").write_text("{% for m in messages %}{% endfor %}")
    write_jsonl(tmp_path / "chat.jsonl", [{"id": "c", "messages": [{"role": "user", "content": "hi"}]}])
    doc = base_job(model_dir, ["chat.jsonl"], input={"prompt_column": None, "messages_column": "messages"},
                   output={"dir": "out2"})
    doc["model"]["chat_template"] = "silent.jinja"
    run_job(write_job(tmp_path, doc, "chat.yaml"), fake_factory(), Shard(0, 1), progress=False)
    [row] = read_out(tmp_path / "out2")
    assert (row["error_type"], row["error"]) == ("empty_prompt", "the prompt has no tokens after templating "
                                                                 "and tokenising")


# -- inputs and checkpoints: the run stops before any work, saying what to fix -------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    target = make_target(d / "target", vocab=320)  # the tokenizer (261 ids) fits in it
    make_tokenizer_dir(target, vocab_size=256)
    make_drafter(d / "drafter", 2, vocab=320)
    return target, d / "drafter"


def edited(src: Path, dst: Path, tensors=None, config=None, raw=None, files=None) -> Path:
    """A copy of a checkpoint with its tensors, config, raw safetensors bytes or files changed
    (files: name -> new text, or None to delete)."""
    shutil.copytree(src, dst)
    for name, text in (files or {}).items():
        (dst / name).unlink() if text is None else (dst / name).write_text(text)
    if tensors:
        t = load_file(dst / "model.safetensors")
        tensors(t)
        save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    if config:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    if raw:
        (dst / "model.safetensors").write_bytes(raw((dst / "model.safetensors").read_bytes()))
    return dst


def lying_header(data: bytes) -> bytes:
    """A header that claims the first tensor ends far past the data."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 10**7
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n:]


def big_tokenizer(d: Path) -> Path:
    d.mkdir()
    make_tokenizer_dir(d, vocab_size=400)
    return d


# (what, how to break it: fn(pair, tmp) -> job overrides, words in the message)
SETUPS = [
    ("truncated safetensors", lambda p, t: {"target": edited(p[0], t / "c", raw=lambda b: b[:-100])},
     "truncated: "),
    ("header lies about sizes", lambda p, t: {"target": edited(p[0], t / "c", raw=lying_header)}, "truncated: "),
    ("not a safetensors file", lambda p, t: {"target": edited(p[0], t / "c", raw=lambda b: b"\x10" + b"junk" * 9)},
     "no valid safetensors header"),
    ("missing tensor", lambda p, t: {"target": edited(p[0], t / "c", tensors=lambda w: w.pop("model.norm.weight"))},
     "missing: model.norm.weight"),
    ("mis-shaped tensor", lambda p, t: {"target": edited(
        p[0], t / "c", tensors=lambda w: w.update({"lm_head.weight": torch.zeros(320, 8)}))},
     "shape mismatch: lm_head.weight"),
    ("unexpected tensor", lambda p, t: {"target": edited(
        p[0], t / "c", tensors=lambda w: w.update({"model.extra.weight": torch.zeros(2)}))},
     "unexpected: model.extra.weight"),
    ("unknown architecture", lambda p, t: {"target": edited(
        p[0], t / "c", config=lambda c: c.update(architectures=["LlamaForCausalLM"]))},
     "unsupported architecture 'LlamaForCausalLM'"),
    ("invalid config.json", lambda p, t: {"target": edited(p[0], t / "c", files={"config.json": "{oops"})},
     "invalid JSON in"),
    ("no config.json", lambda p, t: {"drafter": edited(p[1], t / "d", files={"config.json": None})},
     "no config.json in checkpoint directory"),
    ("no weights", lambda p, t: {"target": edited(p[0], t / "c", files={"model.safetensors": None})},
     "no model.safetensors or model.safetensors.index.json"),
    ("tokenizer bigger than the vocabulary", lambda p, t: {"tokenizer": big_tokenizer(t / "tok")},
     "tokens but model.target"),
    ("drafter taps out of range", lambda p, t: {"drafter": edited(
        p[1], t / "d", config=lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]))},
     "target_layer_ids [1, 9] are not unique ids in [0, 4)"),
    ("drafter mask id outside the vocabulary", lambda p, t: {"drafter": edited(
        p[1], t / "d", config=lambda c: c["dflash_config"].update(mask_token_id=320))},
     "mask_token_id 320 is outside the vocabulary"),
    ("drafter of another width", lambda p, t: {"drafter": edited(
        p[1], t / "d", config=lambda c: c.update(hidden_size=32))}, "shape mismatch"),
    ("drafter without a mask token", lambda p, t: {"drafter": edited(
        p[1], t / "d", config=lambda c: c["dflash_config"].pop("mask_token_id"))}, "no dflash_config.mask_token_id"),
]


@pytest.mark.parametrize("what, breaks, words", SETUPS, ids=[s[0] for s in SETUPS])
def test_a_bad_checkpoint_stops_before_any_work(tmp_path, pair, what, breaks, words):
    model = {"target": str(pair[0]), "drafter": str(pair[1])}
    model.update({k: str(v) for k, v in breaks(pair, tmp_path).items()})
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hello"}])
    doc = base_job(Path(model["target"]), ["p.jsonl"], model=model, engine={"compile": False})
    job = write_job(tmp_path, doc)
    with pytest.raises(JobError) as e:
        run_job(job, lambda j, tok: build_engine(j, tok), Shard(0, 1), progress=False)
    assert words in str(e.value), str(e.value)
    assert not read_out(tmp_path / "out"), "rows were written"
    assert not (tmp_path / "out" / "run.json").exists(), "the bad checkpoint tied the directory to it"


def test_after_a_mistyped_checkpoint_the_corrected_job_runs_in_the_same_directory(tmp_path, pair):
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hello"}])
    doc = base_job(pair[0], ["p.jsonl"], model={"drafter": str(tmp_path / "typo")}, engine={"compile": False})
    with pytest.raises(JobError):
        run_job(write_job(tmp_path, doc), lambda j, tok: build_engine(j, tok), Shard(0, 1), progress=False)
    doc["model"]["drafter"] = str(pair[1])
    run_job(write_job(tmp_path, doc), lambda j, tok: build_engine(j, tok), Shard(0, 1), progress=False)
    assert [r["status"] for r in read_out(tmp_path / "out")] == ["ok"]


INPUTS = [
    ("input file missing", lambda t: {"paths": ["nowhere.jsonl"]}, "nowhere.jsonl' does not exist"),
    ("glob matches nothing", lambda t: {"paths": ["data/*.jsonl"]}, "matches no file"),
    ("unknown file extension", lambda t: {"paths": [str(t / "p.txt")]}, "cannot tell the format"),
    ("parquet without the column", lambda t: {"paths": [str(t / "p.parquet")]}, "column(s) ['id', 'prompt'] not found; the file has ['text']"),
    ("passthrough names an output column", lambda t: {"passthrough_columns": ["response"]},
     "collides with an output column"),
    ("chat messages without a template", lambda t: {"prompt_column": None, "messages_column": "messages"},
     "no chat template"),
]


@pytest.mark.parametrize("what, spec, words", INPUTS, ids=[s[0] for s in INPUTS])
def test_a_bad_input_stops_before_any_work(tmp_path, model_dir, what, spec, words):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}])
    (tmp_path / "p.txt").write_text("hello\n")
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "p.parquet")
    tokenizer_config = model_dir / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    config.pop("chat_template", None)
    tokenizer_config.write_text(json.dumps(config))
    doc = base_job(model_dir, ["p.jsonl"], input={"workers": 0, **spec(tmp_path)})
    with pytest.raises(JobError) as e:
        run_job(write_job(tmp_path, doc), fake_factory(), Shard(0, 1), progress=False)
    assert words in str(e.value), str(e.value)


# -- property: random bytes and random JSON lines --------------------------------------------
line = st.one_of(
    st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b and b.strip()),
    st.recursive(st.none() | st.booleans() | st.integers(-2**62, 2**62) | st.text(string.printable, max_size=8),
                 lambda x: st.lists(x, max_size=3) | st.dictionaries(st.text(string.ascii_letters, max_size=6), x,
                                                                      max_size=3), max_leaves=6)
    .map(lambda v: orjson.dumps(v)),
    st.text(string.ascii_letters + " ", min_size=1, max_size=20).map(lambda p: orjson.dumps({"prompt": p})),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(line, min_size=1, max_size=12))
def test_random_lines_never_crash_and_no_good_row_is_lost(tmp_path_factory, model_dir, lines):
    d = tmp_path_factory.mktemp("random")
    write_jsonl(d / "p.jsonl", lines)
    doc = base_job(model_dir, ["p.jsonl"], input={"workers": 0, "id_column": None})
    run_job(write_job(d, doc), fake_factory(), Shard(0, 1), progress=False)
    out = read_out(d / "out")
    kept = [ln for ln in lines if ln.strip()]
    assert len(out) == len(kept), "every non-blank line gives one row"
    good = sum(1 for ln in kept if _is_good(ln))
    assert sum(r["status"] == "ok" for r in out) == good


def _is_good(line: bytes) -> bool:
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return isinstance(value, dict) and isinstance(value.get("prompt"), str) and bool(value["prompt"].strip())
