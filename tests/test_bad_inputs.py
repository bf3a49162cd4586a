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
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from dflash_batch.build import build_engine
from dflash_batch.cli import main
from dflash_batch.job import JobError
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import check_job, run_job
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


def test_a_line_that_does_not_decode_is_an_error_row_naming_its_file_and_line(tmp_path, model_dir):
    """Not UTF-8 or not JSON: the row id cannot be read, so the line becomes an error row keyed by
    (file, line), in words (orjson would say "surrogates not allowed"), and the run goes on."""
    write_jsonl(tmp_path / "prompts.jsonl", [{"id": "a", "prompt": "one"}, b'{"id": "b", "prompt": "caf\xff"}', b"",
                                             b'{"id": "c", "prompt": ', {"id": "d", "prompt": "two"}])
    run_job(write_job(tmp_path, base_job(model_dir, ["prompts.jsonl"])), fake_factory(), Shard(0, 1), progress=False)
    out = read_out(tmp_path / "out")
    assert sorted(r["row_id"] for r in out if r["status"] == "ok") == ["a", "d"]
    assert sorted((r["error_type"], r["error"]) for r in out if r["status"] == "error") == [
        ("bad_input_line", "prompts.jsonl: line 2 is not valid UTF-8 (byte 0xff at position 26)"),
        ("bad_input_line", "prompts.jsonl: line 4 is not valid JSON (unexpected end of data at position 23)")]


CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
USER = {"role": "user", "content": "add 1 and 2"}
# (what, the chat, its error): each message field a template reads, wrong
BAD_CHATS = [
    ("no content", [{"role": "user"}], "messages[0].content: missing"),
    ("null content", [{"role": "system", "content": "s"}, {"role": "user", "content": None}],
     "messages[1].content: null"),
    ("no role", [{"content": "hi"}], "messages[0].role: missing"),
    ("unknown role", [{"role": "bot", "content": "hi"}],
     "messages[0].role: 'bot' is not one of ['system', 'developer', 'user', 'assistant', 'tool']"),
    ("not an object", ["hi"], "messages[0]: a message must be an object {role, content}, got str"),
    ("content a number", [{"role": "user", "content": 3}],
     "messages[0].content: must be a string or a list of text parts, got int"),
    ("an image part", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0]: only text parts {type: text, text} are read, got 'image_url'"),
    ("a text part without text", [{"role": "user", "content": [{"type": "text", "text": 1}]}],
     "messages[0].content[0].text: must be a string"),
    ("an assistant turn of nothing", [USER, {"role": "assistant"}], "messages[1].content: missing"),
    ("tool calls from the user", [{**USER, "tool_calls": [CALL]}],
     "messages[0].tool_calls: only an assistant message calls tools, this one is 'user'"),
    ("tool calls not a list", [USER, {"role": "assistant", "tool_calls": CALL}],
     "messages[1].tool_calls: must be a non-empty list of {type: function, function: {name, arguments}}"),
    ("a tool call not an object", [USER, {"role": "assistant", "tool_calls": ["add"]}],
     "messages[1].tool_calls[0]: must be an object {type: function, function: {name, arguments}}"),
    ("a tool call of another type", [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "retrieval"}]}],
     "messages[1].tool_calls[0].type: must be 'function', got 'retrieval'"),
    ("a tool call id not a string", [USER, {"role": "assistant", "tool_calls": [{**CALL, "id": 7}]}],
     "messages[1].tool_calls[0].id: must be a string"),
    ("a tool call without its function", [USER, {"role": "assistant", "tool_calls": [{"type": "function"}]}],
     "messages[1].tool_calls[0].function: missing"),
    ("a tool call without a name", [USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "", "arguments": "{}"}}]}], "messages[1].tool_calls[0].function.name: must be a "
                                                         "non-empty string"),
    ("a tool call without arguments", [USER, {"role": "assistant", "tool_calls": [{"function": {"name": "add"}}]}],
     "messages[1].tool_calls[0].function.arguments: must be a JSON string or an object"),
    ("a tool call whose arguments are not JSON", [USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "add", "arguments": "{a: 1"}}]}], "messages[1].tool_calls[0].function.arguments: "
                                                                "not JSON: '{a: 1'"),
    ("a tool call whose arguments encode no object", [USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "add", "arguments": "[1, 2]"}}]}], "messages[1].tool_calls[0].function.arguments: "
                                                                 "must encode an object, got list"),
]
GOOD_CHATS = [
    [USER],
    [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "3"}, USER],
    [USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add",
                                                                                   "arguments": {"a": 1}}}]}],
]


def test_a_malformed_chat_message_is_an_error_row_naming_the_message_and_field(tmp_path, model_dir):
    chats = [*(c for _, c, _ in BAD_CHATS), *GOOD_CHATS]
    write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "messages": c} for i, c in enumerate(chats)])
    doc = base_job(model_dir, ["p.jsonl"], input={"prompt_column": None, "messages_column": "messages"})
    run_job(write_job(tmp_path, doc), fake_factory(), Shard(0, 1), progress=False)
    out = {int(r["row_id"]): r for r in read_out(tmp_path / "out")}
    for i, (what, _, error) in enumerate(BAD_CHATS):
        assert (out[i]["error_type"], out[i]["error"]) == ("bad_message", error), what
    assert [out[i]["status"] for i in range(len(BAD_CHATS), len(chats))] == ["ok"] * len(GOOD_CHATS)


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
     "/d is not a checkpoint: no config.json"),
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


def never_loaded(job, tokenizer):
    raise AssertionError("a model was loaded before the job was refused")


# (what, the job's input section, the column one input lacks)
COLUMNS = [
    ("id column", {"id_column": "key"}, "key"),
    ("prompt column", {"prompt_column": "text"}, "text"),
    ("messages column", {"prompt_column": None, "messages_column": "msgs"}, "msgs"),
    ("input_ids column", {"prompt_column": None, "input_ids_column": "ids"}, "ids"),
    ("sampling column", {"sampling_columns": {"max_new_tokens": "budget"}}, "budget"),
    ("tools column", {"prompt_column": None, "messages_column": "msgs", "tools_column": "tools"}, "tools"),
    ("passthrough column", {"passthrough_columns": ["dataset"]}, "dataset"),
]
FULL_ROW = {"id": "a", "key": "k", "prompt": "hi", "text": "hi", "msgs": [{"role": "user", "content": "hi"}],
            "ids": [5, 6], "budget": 4, "tools": [{"type": "function", "function": {"name": "f"}}], "dataset": "d"}


def write_rows(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        write_jsonl(path, rows)
    return path


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
@pytest.mark.parametrize("what, spec, missing", COLUMNS, ids=[c[0] for c in COLUMNS])
def test_an_input_without_a_column_the_job_names_stops_before_any_model_loads(tmp_path, model_dir, ext, what,
                                                                               spec, missing):
    write_rows(tmp_path / f"a.{ext}", [FULL_ROW])
    lacking = write_rows(tmp_path / f"b.{ext}", [{k: v for k, v in FULL_ROW.items() if k != missing}])
    doc = base_job(model_dir, [f"a.{ext}", f"b.{ext}"], input=spec)
    with pytest.raises(JobError) as e:
        run_job(write_job(tmp_path, doc), never_loaded, Shard(0, 1), progress=False)
    has = "the file has" if ext == "parquet" else "its first 1 non-empty line(s) have"
    assert str(e.value) == (f"{lacking}: column(s) [{missing!r}] not found; {has} "
                            f"{[k for k in FULL_ROW if k != missing]}")
    doc["input"]["paths"] = [f"a.{ext}"]  # the file that has it passes
    check_job(write_job(tmp_path, doc))


def test_a_parquet_tools_column_reaches_the_template(tmp_path, model_dir):
    (tmp_path / "tools.jinja").write_text("{{ tools | tojson }} {% for m in messages %}{{ m['content'] }}{% endfor %}")
    write_rows(tmp_path / "a.parquet", [FULL_ROW])
    doc = base_job(model_dir, ["a.parquet"], input=COLUMNS[5][1], output={"include_prompt": True})
    doc["model"]["chat_template"] = "tools.jinja"
    run_job(write_job(tmp_path, doc), fake_factory(), Shard(0, 1), progress=False)
    [row] = read_out(tmp_path / "out")
    assert row["rendered_prompt"] == '[{"type": "function", "function": {"name": "f"}}] hi'


@pytest.mark.parametrize("ext, blank, why", [("jsonl", b"", "an empty file"),
                                             ("jsonl", b"\n  \n\t\n", "only blank lines"),  # no rows, not empty
                                             ("parquet", None, "a Parquet file of 0 rows")])
def test_an_empty_input_stops_before_any_model_loads_unless_allowed(tmp_path, model_dir, ext, blank, why):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "a.jsonl", [{"id": "a", "prompt": "hi"}])
    if ext == "jsonl":
        (tmp_path / "empty.jsonl").write_bytes(blank)
    else:
        pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}),
                       tmp_path / "empty.parquet")
    doc = base_job(model_dir, ["a.jsonl", f"empty.{ext}"])
    job = write_job(tmp_path, doc)
    with pytest.raises(JobError) as e:
        run_job(job, never_loaded, Shard(0, 1), progress=False)
    assert str(e.value) == (f"{tmp_path / f'empty.{ext}'}: no rows ({why}); set input.allow_empty: true "
                            "if that is expected")
    doc["input"]["allow_empty"] = True
    allowed = write_job(tmp_path, doc)
    assert allowed.output_hash() == job.output_hash()  # it adds no row: runs started without it resume
    run_job(allowed, fake_factory(), Shard(0, 1), progress=False)
    assert [r["status"] for r in read_out(tmp_path / "out")] == ["ok"]


# (what, the model section's broken path: fn(pair, tmp) -> (field, path), the message after the path)
MODEL_PATHS = [
    ("target mistyped", lambda p, t: ("target", t / "typo"), "does not exist"),
    ("drafter mistyped", lambda p, t: ("drafter", t / "typo"), "does not exist"),
    ("tokenizer mistyped", lambda p, t: ("tokenizer", t / "typo"), "does not exist"),
    ("chat template mistyped", lambda p, t: ("chat_template", t / "typo.jinja"), "does not exist"),
    ("target a file", lambda p, t: ("target", p[0] / "config.json"), "is not a directory"),
    ("target without config.json", lambda p, t: ("target", edited(p[0], t / "c", files={"config.json": None})),
     "is not a checkpoint: no config.json"),
]


@pytest.mark.parametrize("what, breaks, words", MODEL_PATHS, ids=[m[0] for m in MODEL_PATHS])
def test_a_bad_model_path_is_named_by_its_field_before_anything_else(tmp_path, pair, what, breaks, words):
    field, path = breaks(pair, tmp_path)
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "text": "no prompt column"}])  # checked after the paths
    doc = base_job(pair[0], ["p.jsonl"], model={"drafter": str(pair[1]), field: str(path)})
    with pytest.raises(JobError) as e:
        run_job(write_job(tmp_path, doc), never_loaded, Shard(0, 1), progress=False)
    assert str(e.value) == f"model.{field}: {path} {words}"


def test_validate_and_run_refuse_a_missing_column_before_reading_a_checkpoint(tmp_path, model_dir):
    """Through the command line: exit 2 with the file and the column. The target's architecture
    is one no engine builds, so a run that loaded it first would fail otherwise."""
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}])
    doc = base_job(model_dir, ["p.jsonl"], input={"prompt_column": None, "messages_column": "msgs"})
    write_job(tmp_path, doc)
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump({**doc, "model": {"target": "modle"}}))
    threads = torch.get_num_threads()
    try:
        for command in (["validate"], ["run", "--no-progress"]):
            result = CliRunner().invoke(main, [*command, str(tmp_path / "job.yaml")])
            assert result.exit_code == 2, result.output
            assert (f"error: {tmp_path / 'p.jsonl'}: column(s) ['msgs'] not found; its first 1 non-empty line(s) "
                    "have ['id', 'messages']") in result.output
            result = CliRunner().invoke(main, [*command, str(tmp_path / "typo.yaml")])
            assert result.exit_code == 2 and f"error: model.target: {tmp_path / 'modle'} does not exist" in \
                result.output, result.output
    finally:
        torch.set_num_threads(threads)  # run sets the threads this process computes with
    assert not (tmp_path / "out").exists()


CHAT = [{"role": "user", "content": "hi"}]
# (what, the job's input section, the file (a JSONL file when the name says so), what validate says of it)
KINDS = [
    ("chat messages as JSON text", {"prompt_column": None, "messages_column": "msgs"},
     ("a.parquet", {"msgs": [json.dumps(CHAT)] * 2}),
     """column 'msgs' holds string values (e.g. '[{"role": "user", "content": "hi"}]'), not lists of {role, """
     "content} messages, so every row would be an error row: JSON text? Decode each value (json.loads)"),
    ("chat messages as lists of text", {"prompt_column": None, "messages_column": "msgs"},
     ("a.parquet", {"msgs": [["hi"], ["there"]]}), "column 'msgs' holds list<element: string> values (e.g. ['hi'])"),
    ("prompt as a list", {}, ("a.parquet", {"prompt": [["hi"], ["there"]]}),
     "column 'prompt' holds list<element: string> values (e.g. ['hi']), not strings, so every row would be an error row"),
    ("prompt all null", {}, ("a.parquet", {"prompt": pa.nulls(2)}), "column 'prompt' holds null values, not strings"),
    ("token ids as JSON text", {"prompt_column": None, "input_ids_column": "ids"},
     ("a.parquet", {"ids": ["[5, 6]", "[7]"]}), "column 'ids' holds string values (e.g. '[5, 6]'), not lists of "
     "token ids, so every row would be an error row: JSON text?"),
    ("tools as JSON text", {"prompt_column": None, "messages_column": "msgs", "tools_column": "tools"},
     ("a.parquet", {"msgs": [CHAT] * 2, "tools": ['[{"type": "function"}]'] * 2}),
     "column 'tools' holds string values (e.g. '[{\"type\": \"function\"}]'), not lists of tool objects"),
    ("chat messages as JSON text, JSONL", {"prompt_column": None, "messages_column": "msgs"},
     ("a.jsonl", {"msgs": [json.dumps(CHAT), None, json.dumps(CHAT)]}),
     """column 'msgs' holds str values in each of its first 3 non-empty line(s) that sets it (e.g. '[{"role": """
     """"user", "content": "hi"}]'), not lists of {role, content} messages, so each of those rows would be an """
     "error row: JSON text?"),
]


def write_columns(path: Path, columns: dict) -> Path:
    if path.suffix == ".parquet":
        rows = len(next(iter(columns.values())))
        pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], **columns}), path)
    else:
        write_jsonl(path, [{"id": f"r{i}", **dict(zip(columns, values))} for i, values in enumerate(zip(*columns.values()))])
    return path


@pytest.mark.parametrize("what, spec, file, words", KINDS, ids=[k[0] for k in KINDS])
def test_validate_and_run_refuse_a_prompt_column_of_another_kind(tmp_path, model_dir, what, spec, file, words):
    """Every row of such a file would be an error row: `validate` and `run` exit 2 naming the file,
    the column and what it holds, before any model loads."""
    path = write_columns(tmp_path / file[0], file[1])
    doc = base_job(model_dir, [file[0]], input=spec)
    write_job(tmp_path, doc)
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "job.yaml")])
    assert result.exit_code == 2 and f"error: {path}: {words}" in result.output, result.output
    with pytest.raises(JobError) as e:
        run_job(write_job(tmp_path, doc), never_loaded, Shard(0, 1), progress=False)
    assert f"{path}: {words}" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_prompt_columns_of_the_kinds_read_pass(tmp_path, model_dir):
    """Pandas' categorical text (dictionary-encoded), chat messages as lists of structs, and a
    tools column that is null throughout (no tools) run as they are."""
    prompts = pa.array(["hi", "there"]).dictionary_encode()
    write_columns(tmp_path / "a.parquet", {"prompt": prompts})
    check_job(write_job(tmp_path, base_job(model_dir, ["a.parquet"])))
    write_columns(tmp_path / "b.parquet", {"msgs": [CHAT] * 2, "tools": pa.nulls(2)})
    check_job(write_job(tmp_path, base_job(model_dir, ["b.parquet"], input={
        "prompt_column": None, "messages_column": "msgs", "tools_column": "tools"})))


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
    if not any(isinstance(v := _parsed(ln), dict) and "prompt" in v for ln in lines):
        with pytest.raises(JobError, match=r"(column\(s\) \['prompt'\] not found|is a JSON object)"):
            run_job(write_job(d, doc), never_loaded, Shard(0, 1), progress=False)
        return  # no line has the prompt column: refused as a whole
    prompts = [v["prompt"] for ln in lines if isinstance(v := _parsed(ln), dict) and v.get("prompt") is not None]
    if prompts and not any(isinstance(p, str) for p in prompts):
        with pytest.raises(JobError, match=r"column 'prompt' holds .* values in each of its first"):
            run_job(write_job(d, doc), never_loaded, Shard(0, 1), progress=False)
        return  # no line's prompt is text: refused as a whole
    run_job(write_job(d, doc), fake_factory(), Shard(0, 1), progress=False)
    out = read_out(d / "out")
    kept = [ln for ln in lines if ln.strip()]
    assert len(out) == len(kept), "every non-blank line gives one row"
    good = sum(1 for ln in kept if _is_good(ln))
    assert sum(r["status"] == "ok" for r in out) == good


def _parsed(line: bytes):
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return None


def _is_good(line: bytes) -> bool:
    value = _parsed(line)
    return isinstance(value, dict) and isinstance(value.get("prompt"), str) and bool(value["prompt"].strip())


@pytest.mark.parametrize("where", ["read_only", "under_a_file"])
def test_an_output_directory_that_cannot_be_written_is_refused_before_any_model_loads(tmp_path, model_dir, where):
    """`validate` (with and without inputs) and `run` exit 2 with one line naming output.dir; the
    model is never read. A read-only mount (sysfs: no file can be made there, root included)
    or a path under a file."""
    if where == "read_only":
        if not Path("/sys").is_dir():
            pytest.skip("no read-only sysfs mount here")
        out = Path("/sys/dflash-batch-test/out")
    else:
        (tmp_path / "a_file").write_text("x")
        out = tmp_path / "a_file" / "out"
    write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    write_job(tmp_path, base_job(model_dir, ["p.jsonl"], output={"dir": str(out)}))
    for command in (["validate"], ["validate", "--no-inputs"], ["run", "--no-progress"]):
        result = CliRunner().invoke(main, [*command, str(tmp_path / "job.yaml")])
        assert result.exit_code == 2, result.output
        (line,) = [x for x in result.output.splitlines() if x.strip()]
        assert line.startswith(f"error: output.dir: {out} ")
        assert "not writable" in line or "is not a directory" in line
    with pytest.raises(JobError, match="output.dir"):
        run_job(write_job(tmp_path, base_job(model_dir, ["p.jsonl"], output={"dir": str(out)})), never_loaded,
                Shard(0, 1), progress=False)
