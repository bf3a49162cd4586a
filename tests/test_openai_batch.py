"""OpenAI Batch API files: request lines run as the same rows our own columns give (the body's
fields mapped onto ours), a field we do not have is an error row naming it, and the exported
output lines parse with the `openai` package's response types (else against the documented
shape): choices, usage, logprobs, errors."""

from __future__ import annotations

import sys

import orjson
import pytest
import torch

from dflash_batch.engine.engine import Engine
from dflash_batch.io.export import export_openai_batch
from dflash_batch.io.openai_batch import RequestError, request_fields
from dflash_batch.job import JobError
from dflash_batch.plan.shards import Shard
from dflash_batch.tokenizer import Tokenizer
from dflash_batch.runner import run_job
from dflash_batch.testing.tokenizer import make_tokenizer_dir
from tests.engine_util import load_pair, make_drafter, make_target
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

VOCAB = 400
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
          "additionalProperties": False}
# (custom_id, body fields past the prompt, the same as our sampling fields)
CASES = [
    ("greedy", {"max_tokens": 12, "temperature": 0}, {"max_new_tokens": 12, "temperature": 0}),
    ("sampled", {"max_completion_tokens": 10, "temperature": 0.9, "top_p": 0.8, "seed": 7, "n": 2},
     {"max_new_tokens": 10, "temperature": 0.9, "top_p": 0.8, "seed": 7, "n": 2}),
    ("penalised", {"max_tokens": 14, "frequency_penalty": 1.5, "presence_penalty": 0.5, "stop": "a",
                   "logit_bias": {"60": 4.0}},
     {"max_new_tokens": 14, "frequency_penalty": 1.5, "presence_penalty": 0.5, "stop": ["a"],
      "logit_bias": {"60": 4.0}}),
    ("logprobs", {"max_tokens": 8, "logprobs": True, "top_logprobs": 3, "top_k": 5, "min_p": 0.05},
     {"max_new_tokens": 8, "logprobs": 3, "top_k": 5, "min_p": 0.05}),
]
PROMPTS = ["The quick brown fox", "def main():", "import os and sys", "x = 1 + 2"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("openai")
    target = make_target(d / "target", vocab=VOCAB, peaked=False)
    make_tokenizer_dir(target, vocab_size=VOCAB)
    make_drafter(d / "drafter", 2, vocab=VOCAB)
    engine = Engine(*load_pair(target, d / "drafter", torch.float64), decode=Tokenizer(target).decode)
    return target, engine


def _request(custom_id: str, url: str, prompt, body: dict) -> dict:
    key = "messages" if url == CHAT else "prompt"
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "kimi", key: prompt, **body}}


def _run(tmp_path, target, engine, name: str, rows: list[dict], sampling: dict | None = None, **input_section) -> dict:
    write_jsonl(tmp_path / f"{name}.jsonl", rows)
    if input_section.get("format") == "openai_batch":  # the lines give the id and the prompt
        input_section |= {"prompt_column": None, "id_column": None}
    doc = base_job(target, [f"{name}.jsonl"], input={"workers": 0, **input_section}, sampling=sampling or {},
                   model={"dtype": "float64"}, engine={"compile": False},
                   output={"dir": name, "include_token_ids": True})
    run_job(write_job(tmp_path, doc, f"{name}.yaml"), lambda j, t: engine, Shard(0, 1), progress=False)
    return {(r["row_id"], r["sample_index"]): r for r in read_out(tmp_path / name)}


GENERATED = ["status", "response", "finish_reason", "stop_reason", "prompt_tokens", "completion_tokens",
             "response_token_ids", "seed", "spec_rounds", "spec_accepted", "logprobs", "top_logprob_ids",
             "top_logprobs", "error_type"]


def test_requests_run_as_our_own_columns_and_export_parses(tmp_path, pair):
    target, engine = pair
    requests, chat_rows, text_rows = [], [], []
    for i, (name, body, ours) in enumerate(CASES):
        messages = [{"role": "user", "content": PROMPTS[i]}]
        text_body = {k: v for k, v in body.items() if k != "top_logprobs"}
        if "top_logprobs" in body:  # completions: logprobs is the K
            text_body["logprobs"] = body["top_logprobs"]
        requests += [_request(f"chat-{name}", CHAT, messages, body),
                     _request(f"text-{name}", COMPLETIONS, PROMPTS[i], text_body)]
        chat_rows.append({"id": f"chat-{name}", "messages": messages, "s": ours})
        text_rows.append({"id": f"text-{name}", "prompt": PROMPTS[i], "s": ours})
    got = _run(tmp_path, target, engine, "openai", requests, format="openai_batch")

    columns = {f: f"s_{f}" for f in {f for _, _, ours in CASES for f in ours}}
    def ours(rows: list[dict]) -> list[dict]:
        return [{**{k: v for k, v in r.items() if k != "s"}, **{columns[f]: v for f, v in r["s"].items()}}
                for r in rows]
    # A body without a temperature samples at OpenAI's default, 1 (ours is 0).
    t1 = {"temperature": 1.0}
    want = _run(tmp_path, target, engine, "chat", ours(chat_rows), t1, prompt_column=None,
                messages_column="messages", sampling_columns=columns)
    want |= _run(tmp_path, target, engine, "text", ours(text_rows), t1, sampling_columns=columns)
    assert set(got) == set(want) and len(got) == 10
    for key, row in got.items():
        assert row["status"] == "ok", (row["row_id"], row["error"])
        assert {c: row.get(c) for c in GENERATED} == {c: want[key].get(c) for c in GENERATED}, key
        assert row["url"] == (CHAT if key[0].startswith("chat") else COMPLETIONS) and row["model"] == "kimi"
    assert got[("chat-sampled", 0)]["response"] != got[("chat-sampled", 1)]["response"]
    assert all(r["spec_rounds"] for r in got.values())  # speculative decoding ran

    assert export_openai_batch(tmp_path / "openai", tmp_path / "out.jsonl") == 8
    lines = {x["custom_id"]: x for x in map(orjson.loads, (tmp_path / "out.jsonl").read_bytes().splitlines())}
    assert set(lines) == {r["custom_id"] for r in requests}
    tok = Tokenizer(target)
    for custom_id, line in lines.items():
        check_line_shape(line)
        body = line["response"]["body"]
        samples = [got[(custom_id, i)] for i in range(len(body["choices"]))]
        assert len(body["choices"]) == (2 if "sampled" in custom_id else 1)
        prompt, completion = samples[0]["prompt_tokens"], sum(s["completion_tokens"] for s in samples)
        assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion,
                                 "prompt_tokens_details": {"cached_tokens": samples[0]["cached_tokens"]}}
        for choice, s in zip(body["choices"], samples):
            text = choice["message"]["content"] if custom_id.startswith("chat") else choice["text"]
            assert text == s["response"] and choice["finish_reason"] == s["finish_reason"]
        if "logprobs" in custom_id:
            lp = body["choices"][0]["logprobs"]
            s = samples[0]
            if custom_id.startswith("chat"):
                assert [e["logprob"] for e in lp["content"]] == s["logprobs"]
                assert [e["token"] for e in lp["content"]] == [tok.decode([t]) for t in s["response_token_ids"]]
                assert all(len(e["top_logprobs"]) == 3 for e in lp["content"])
                assert b"".join(bytes(e["bytes"]) for e in lp["content"]).decode(errors="replace") == s["response"]
            else:
                assert lp["token_logprobs"] == s["logprobs"] and len(lp["top_logprobs"][0]) <= 3
        else:
            assert body["choices"][0]["logprobs"] is None
    openai = pytest.importorskip("openai")
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    for custom_id, line in lines.items():
        kind = ChatCompletion if custom_id.startswith("chat") else Completion
        parsed = kind.model_validate(line["response"]["body"])
        assert parsed.usage.completion_tokens == line["response"]["body"]["usage"]["completion_tokens"]
    assert openai.__version__


def check_line_shape(line: dict) -> None:
    """The batch output line as OpenAI documents it (the package has no type for the line)."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("batch_req_") and isinstance(line["custom_id"], str)
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"} and isinstance(response["status_code"], int)
    if response["status_code"] == 200:
        assert response["body"]["object"] in ("chat.completion", "text_completion")
    else:
        assert set(response["body"]["error"]) == {"message", "type", "param", "code"}


BAD = [
    ({"custom_id": "u", "method": "POST", "url": CHAT, "body": {"messages": [{"role": "user", "content": "hi"}],
                                                              "tool_choice": "auto"}}, "body.tool_choice"),
    ({"custom_id": "t", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "hi", "temperature": -1}},
     "body.temperature"),
    ({"custom_id": "p", "method": "POST", "url": COMPLETIONS, "body": {"prompt": ["a", "b"]}}, "one prompt per"),
    ({"custom_id": "m", "method": "POST", "url": CHAT, "body": {"prompt": "hi"}}, "body.messages is missing"),
    ({"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}}, "url must be"),
    ({"method": "POST", "url": CHAT, "body": {"messages": []}}, "custom_id must be"),
    ({"custom_id": "x", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "hi", "max_tokens": 1,
                                                                       "max_completion_tokens": 2}},
     "sets max_new_tokens a second time"),
]


def test_a_field_we_do_not_have_is_an_error_row_naming_it(tmp_path, pair):
    target, engine = pair
    fine = _request("fine", COMPLETIONS, "hello there", {"max_tokens": 4})
    got = _run(tmp_path, target, engine, "bad", [line for line, _ in BAD] + [fine], format="openai_batch")
    assert got[("fine", 0)]["status"] == "ok"
    errors = {r["row_id"]: r for r in got.values() if r["status"] == "error"}
    assert len(errors) == len(BAD)
    no_id = next(i for i in errors if i not in {line.get("custom_id") for line, _ in BAD})  # a hash of the line
    for line, message in BAD:
        row = errors[line.get("custom_id", no_id)]
        assert message in row["error"], (message, row["error"])
        assert row["error_type"] in ("bad_request", "bad_sampling_override")
    assert export_openai_batch(tmp_path / "bad", tmp_path / "bad-out.jsonl") == len(BAD) + 1
    for line in map(orjson.loads, (tmp_path / "bad-out.jsonl").read_bytes().splitlines()):
        check_line_shape(line)
        assert line["response"]["status_code"] == (200 if line["custom_id"] == "fine" else 400)


def test_openai_batch_owns_the_id_prompt_and_sampling_columns(tmp_path, pair):
    write_jsonl(tmp_path / "p.jsonl", [])
    with pytest.raises(JobError, match="remove \\['prompt_column', 'id_column'\\]"):
        write_job(tmp_path, base_job(pair[0], ["p.jsonl"], input={"format": "openai_batch"}))


def test_response_format_without_xgrammar_is_an_error_row(tmp_path, pair, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    target, engine = pair
    rows = [_request("json", CHAT, [{"role": "user", "content": "hi"}],
                     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}),
            _request("plain", CHAT, [{"role": "user", "content": "hi"}], {"max_tokens": 3})]
    got = _run(tmp_path, target, engine, "nogrammar", rows, format="openai_batch")
    assert got[("json", 0)]["error_type"] == "bad_grammar" and "needs xgrammar" in got[("json", 0)]["error"]
    assert got[("plain", 0)]["status"] == "ok"


def test_response_format_holds_the_output_to_the_schema(tmp_path, pair):
    pytest.importorskip("xgrammar")
    target, engine = pair
    rows = [_request("json", CHAT, [{"role": "user", "content": "hi"}],
                     {"max_tokens": 40, "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": SCHEMA}}})]
    got = _run(tmp_path, target, engine, "grammar", rows, format="openai_batch")
    row = got[("json", 0)]
    assert row["finish_reason"] == "stop", row
    assert set(orjson.loads(row["response"])) == {"a"}


def test_request_fields_follow_openai_where_our_names_differ():
    chat = request_fields(_request("d", CHAT, [{"role": "developer", "content": "be brief"},
                                                {"role": "user", "content": "hi"}], {"logprobs": False}))
    assert [m["role"] for m in chat["messages"]] == ["system", "user"] and chat["sampling"] == {}
    text = request_fields(_request("c", COMPLETIONS, "hi", {"logprobs": False, "best_of": 2, "n": 2}))
    assert text["sampling"] == {"n": 2}
    with pytest.raises(RequestError, match="number of top logprobs"):
        request_fields(_request("c", COMPLETIONS, "hi", {"logprobs": True}))
    with pytest.raises(RequestError, match="best_of equal to n"):
        request_fields(_request("c", COMPLETIONS, "hi", {"best_of": 3}))
