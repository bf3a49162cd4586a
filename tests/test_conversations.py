"""Rows that are conversations (conversation.py, tools.py), through the real loader and engine
where the model's tokens matter: scripted later turns give each turn exactly the tokens a
single-turn row of its whole history gets (float64), each turn prefilling only its own; tool
calls run by name with JSON arguments, and a tool that raises, runs past its timeout, does not
exist or gets bad JSON tells the model so; a malformed followups column is an error row."""

from __future__ import annotations

import json
import textwrap
import time
from concurrent.futures import Future
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflash_batch.build import build_engine
from dflash_batch.engine.request import Completion, SpecCounters
from dflash_batch.job import JobError
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from dflash_batch.testing.tokenizer import make_tokenizer_dir
from dflash_batch.tokenizer import Tokenizer
from tests.engine_util import make_drafter, make_target
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

ONE = Shard(0, 1)
FOLLOWUPS = ["And times two?", {"role": "user", "content": "Thanks, and minus one?"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("talk")
    target = make_target(d / "target", vocab=320, peaked=False)  # holds the tokenizer's ids; varied tokens
    make_tokenizer_dir(target, vocab_size=256)
    make_drafter(d / "drafter", 1, vocab=320)
    return target, d / "drafter"


def job_doc(tmp_path: Path, pair, rows: list[dict], out: str = "out", **input_) -> dict:
    write_jsonl(tmp_path / f"{out}.jsonl", rows)
    doc = base_job(pair[0], [f"{out}.jsonl"], sampling={"max_new_tokens": 6}, output={"dir": out,
                                                                                       "include_token_ids": True})
    doc["input"] = {"paths": [f"{out}.jsonl"], "id_column": "id", "workers": 0, **input_}
    doc["model"].update(drafter=str(pair[1]), dtype="float64")
    doc["engine"].update(compile=False, max_num_seqs=3)
    return doc


def run(tmp_path: Path, doc: dict, name: str) -> dict[str, dict]:
    run_job(write_job(tmp_path, doc, f"{name}.yaml"), lambda j, tok: build_engine(j, tok), ONE, progress=False)
    return {r["row_id"]: r for r in read_out(tmp_path / doc["output"]["dir"])}


def opening(tok: Tokenizer, ended_on_eos: bool, user: str) -> list[int]:
    """What the tests' chat template puts between an assistant turn's tokens and the next
    turn's (written out from the template, not through conversation.py)."""
    text = ("" if ended_on_eos else "<|im_end|>") + f"\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode_batch([text], False)[0]


def test_scripted_turns_equal_single_turn_rows_of_their_whole_history(tmp_path, pair, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tok = Tokenizer(pair[0])
    chats = [[{"role": "user", "content": f"What is {i} plus 30?" + " Think." * i}] for i in range(5)]
    rows = [{"id": f"c{i}", "messages": m, "more": FOLLOWUPS} for i, m in enumerate(chats)]
    stop = {"sampling": {"max_new_tokens": 8, "stop_token_ids": [150]}}  # a token the target writes now and then
    talks = run(tmp_path, {**job_doc(tmp_path, pair, rows, "talk", messages_column="messages",
                                     followups_column="more"), **stop}, "talk")

    histories = {f"c{i}": tok.encode_batch([tok.render_chat(m, {})], False)[0] for i, m in enumerate(chats)}
    users = [f if isinstance(f, str) else f["content"] for f in FOLLOWUPS]
    expected: dict[str, list[list[int]]] = {k: [] for k in histories}
    for turn in range(3):  # each turn: single-turn rows of the whole history, as token ids
        single = run(tmp_path, {**job_doc(tmp_path, pair, [{"id": k, "ids": h} for k, h in histories.items()],
                                          f"turn{turn}", input_ids_column="ids"), **stop}, f"turn{turn}")
        for k, h in histories.items():
            tokens = single[k]["response_token_ids"]
            expected[k].append(tokens)
            if turn < 2:
                histories[k] = h + tokens + opening(tok, tokens[-1] == tok.eos_id, users[turn])
    for k, row in talks.items():
        assert row["status"] == "ok" and row["conversation_end"] == "no_followup"
        assert row["turn_token_ids"] == expected[k], k
        assert row["response_token_ids"] == expected[k][-1]
        assert row["completion_tokens"] == sum(map(len, expected[k]))
        # later turns prefill their opening and the anchor before it, not the history
        prompt = row["prompt_tokens"]
        assert row["turn_prompt_tokens"][0] == prompt
        assert row["turn_prompt_tokens"][1:] == [1 + len(opening(tok, t[-1] == tok.eos_id, u))
                                                 for t, u in zip(expected[k], users)]
        messages = json.loads(row["conversation"])
        assert [m["role"] for m in messages] == ["user", "assistant"] * 3
        assert [m["content"] for m in messages[2::2]] == users
        assert [m["content"] for m in messages[1::2]] == [tok.decode(t[:-1] if why == "stop" else t)  # less its stop token
                                                          for t, why in zip(expected[k], row["turn_finish_reasons"])]
        assert row["spec_rounds"] >= 3 and row["acc_len"] == pytest.approx(1 + row["spec_accepted"] / row["spec_rounds"])
    assert {r for row in talks.values() for r in row["turn_finish_reasons"]} == {"stop", "length"}


def test_max_turns_and_malformed_followups(tmp_path, pair, monkeypatch):
    monkeypatch.chdir(tmp_path)
    user = [{"role": "user", "content": "Hello"}]
    rows = [{"id": "ok", "messages": user, "more": FOLLOWUPS}, {"id": "none", "messages": user},
            {"id": "text", "messages": user, "more": "And then?"},
            {"id": "bad", "messages": user, "more": ["fine", {"content": "no role"}]},
            {"id": "num", "messages": user, "more": [3]}]
    doc = job_doc(tmp_path, pair, rows, messages_column="messages", followups_column="more")
    doc["conversation"] = {"max_turns": 2}
    out = run(tmp_path, doc, "job")
    assert out["ok"]["conversation_end"] == "max_turns" and len(out["ok"]["turn_token_ids"]) == 2
    assert out["none"]["conversation_end"] == "no_followup" and len(out["none"]["turn_token_ids"]) == 1
    for key, words in (("text", "must be a list of user turns"), ("bad", "item 1.role: missing"),
                       ("num", "item 0 is a int")):
        assert out[key]["status"] == "error" and out[key]["error_type"] == "bad_followups", key
        assert "'more'" in out[key]["error"] and words in out[key]["error"], out[key]["error"]


def test_a_simulator_that_fails_ends_its_conversation_as_an_error_row_that_keeps_its_turns(tmp_path, pair,
                                                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad_sim.py").write_text("def next_turn(messages):\n"
                                         "    if 'raise' in messages[0]['content']:\n"
                                         "        raise KeyError('no user')\n"
                                         "    return 42 if 'number' in messages[0]['content'] else None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"id": k, "messages": [{"role": "user", "content": k}], "more": ["Scripted first."]}
            for k in ("raise", "number", "fine")]
    doc = job_doc(tmp_path, pair, rows, messages_column="messages", followups_column="more")
    doc["conversation"] = {"followups": {"function": "bad_sim:next_turn"}}
    out = run(tmp_path, doc, "job")
    assert out["fine"]["status"] == "ok" and len(out["fine"]["turn_token_ids"]) == 2
    for key, words in (("raise", "KeyError: 'no user'"), ("number", "not a string or a message")):
        row = out[key]
        assert row["status"] == "error" and row["error_type"] == "conversation_error", row
        assert words in row["error"] and len(row["turn_token_ids"]) == 2  # the turns before it are kept
        assert [m["role"] for m in json.loads(row["conversation"])] == ["user", "assistant", "user", "assistant"]


TOOLS = """
import time

def add(a: int, b: int) -> int:
    '''Add two integers.'''
    return a + b

def boom() -> str:
    raise RuntimeError("the tool broke")

def slow() -> str:
    time.sleep(10)
    return "too late"

def _private():
    raise AssertionError("never called: not a tool")
"""


# A Hermes-style template (Qwen3's tool format): tools in a system turn, results as user turns.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ScriptedModel:
    """An engine whose assistant turns are written out (no model): it keeps Request.turns'
    contract as the real engine does (each turn's completion to `ended`, the opening appended to
    the history), so the conversation's host side runs as in a real job."""

    def __init__(self, tok: Tokenizer, replies: list[str]):
        self.tok, self.replies, self.vocab_size, self.prompts, self.waits = tok, replies, None, [], []

    def generate(self, requests, bucket):
        for req in requests:
            history = list(req.prompt_ids)
            for reply in self.replies:
                self.prompts.append(history)
                ids = self.tok.encode_batch([reply + "<|im_end|>"], False)[0]
                done = Completion(req.key, ids, self.tok.decode(ids[:-1]), "stop", str(ids[-1]), SpecCounters(8),
                                  0.0, 0.0, computed_tokens=len(history))
                started = time.monotonic()
                future: Future = req.turns.ended(done)
                opening = future.result()
                self.waits.append(time.monotonic() - started)
                if opening is None:
                    yield done
                    break
                history = history + ids + opening


def test_tool_calls_run_by_name_and_their_failures_reach_the_model(tmp_path, pair, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_tools.py").write_text(textwrap.dedent(TOOLS))
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = ['{"name": "add", "arguments": {"a": 2, "b": 3}}', '{"name": "boom", "arguments": {}}',
             *['{"name": "slow", "arguments": {}}'] * 3, '{"name": "_private", "arguments": {}}',
             '{"name": "add", "arguments": {"a": 2,', '{"name": "add", "arguments": "[1, 2]"}',
             '{"name": "__import__", "arguments": {"name": "os"}}']
    replies = ["Let me see." + "".join(f"<tool_call>{c}</tool_call>" for c in calls), "It is 5."]
    (tmp_path / "template.jinja").write_text(TOOL_TEMPLATE)
    tok = Tokenizer(pair[0], str(tmp_path / "template.jinja"))
    model = ScriptedModel(tok, replies)
    doc = job_doc(tmp_path, pair, [{"id": "t", "messages": [{"role": "user", "content": "2 + 3?"}]}],
                  messages_column="messages")
    doc["model"]["chat_template"] = str(tmp_path / "template.jinja")
    doc["conversation"] = {"tools": {"module": "my_tools", "timeout_s": 0.5}}  # format: the template's (hermes)
    doc["engine"]["max_model_len"] = 4096  # the tools' definitions make a long prompt
    run_job(write_job(tmp_path, doc), lambda j, t: model, ONE, progress=False)
    assert 0.5 <= model.waits[0] < 1.3, "the three slow calls did not time out together, 0.5 s after their start"
    (row,) = read_out(tmp_path / "out")
    assert row["status"] == "ok", row["error"]
    messages = json.loads(row["conversation"])
    assert [m["role"] for m in messages] == ["user", "assistant"] + ["tool"] * len(calls) + ["assistant"]
    assert messages[1]["content"] == "Let me see."
    assert [c["function"]["name"] for c in messages[1]["tool_calls"]] == ["add", "boom", "slow", "slow", "slow",
                                                                          "_private", "", "add", "__import__"]
    results = [m["content"] for m in messages[2:-1]]
    assert results[0] == "5"
    assert results[1] == "error: boom raised RuntimeError: the tool broke"
    assert results[2:5] == ["error: slow timed out after 0.5 s"] * 3
    assert results[5].startswith("error: no tool named '_private' (tools: add, boom, slow)")
    assert results[6].startswith("error: the tool call is not valid JSON")
    assert results[7] == "error: the arguments of add must be a JSON object"
    assert results[8].startswith("error: no tool named '__import__'")
    assert row["tool_calls"] == 9 and row["tool_errors"] == 8 and row["response"] == "It is 5."
    assert row["conversation_end"] == "no_followup"
    # the tools' definitions were in the first prompt; the results opened the second turn
    first, second = (tok.decode_special(p) for p in model.prompts)
    assert '{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": ' \
           '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ' \
           '["a", "b"]}}}' in first
    assert "boom" in first and "_private" not in first and "time" not in first.split("# Tools")[1].split("Call")[0]
    assert second == first + replies[0] + "<|im_end|>\n" + "".join(
        f"<|im_start|>user\n<tool_response>\n{r}\n</tool_response><|im_end|>\n" for r in results) + \
        "<|im_start|>assistant\n"

    # the exports carry the conversation; the report has its per-turn table
    from dflash_batch.io.export import export_dataset, export_openai_batch
    from dflash_batch.report import build_report, to_markdown

    export_dataset(tmp_path / "out", tmp_path / "hf", messages="conversation")
    (exported,) = pq.read_table(next((tmp_path / "hf" / "data").glob("*.parquet"))).to_pylist()
    assert [m["role"] for m in exported["messages"]] == [m["role"] for m in messages]
    assert exported["messages"][1]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert exported["messages"][2]["tool_call_id"] == "call_0_0" and exported["messages"][-1]["content"] == "It is 5."
    export_openai_batch(tmp_path / "out", tmp_path / "batch.jsonl")
    (line,) = [json.loads(x) for x in (tmp_path / "batch.jsonl").read_text().splitlines()]
    choice = line["response"]["body"]["choices"][0]
    assert choice["message"]["content"] == "It is 5." and choice["conversation"] == messages
    report = build_report(tmp_path / "out")
    assert [t["conversations"] for t in report["turns"].values()] == [1, 1]
    assert "## Conversations, by turn" in to_markdown(report) and "9 tool calls, 8 of them failed" in to_markdown(report)


def test_conversation_settings_are_refused_where_they_cannot_work(tmp_path, pair):
    base = job_doc(tmp_path, pair, [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}],
                   messages_column="messages", followups_column="more")
    for change, words in ((lambda d: d["sampling"].update(logprobs=2), "sampling.logprobs is not supported"),
                          (lambda d: d["model"].update(pipeline_parallel_size=2), "pipeline stages"),
                          (lambda d: d.update(conversation={"followups": {"function": "m:f"}},
                                              model={**d["model"], "tensor_parallel_size": 2}), "on one host"),
                          (lambda d: d["input"].update(messages_column=None, prompt_column="p"),
                           "followups_column needs messages_column")):
        doc = json.loads(json.dumps(base))
        change(doc)
        with pytest.raises(JobError) as e:
            write_job(tmp_path, doc)
        assert words in str(e.value), str(e.value)


SIMULATOR = """
import os, signal, pathlib

def next_turn(messages):
    '''The user's next message: two more, then done. From call $SIM_KILL on, the first second
    user turn kills the run (a conversation with a finished, journaled turn behind it).'''
    log = pathlib.Path(os.environ["SIM_LOG"])
    users = sum(m["role"] == "user" for m in messages)
    with open(log, "a") as f:
        f.write(f"{messages[0]['content']}|{users}\\n")
    if os.environ.get("SIM_KILL") and log.read_text().count("\\n") >= int(os.environ["SIM_KILL"]) and users == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return None if users >= 3 else f"Go on ({users})."
"""


@pytest.mark.parametrize("sampled", [False, True])
def test_a_killed_run_resumes_its_conversations_after_their_finished_turns(tmp_path, pair, monkeypatch, sampled):
    """SIGKILLed inside the user simulator (mid-conversation), then resumed: the rows equal an
    uninterrupted run's, finished turns were not made again (the journal's), and only the turn
    in flight at the kill called the simulator twice."""
    import os
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    (tmp_path / "user_sim.py").write_text(textwrap.dedent(SIMULATOR))
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}: " + "why? " * i}]}
            for i in range(8)]
    sampling = {"max_new_tokens": 8, "stop_token_ids": [150]}
    if sampled:
        sampling.update(temperature=1.0, top_p=0.9)

    def run_cli(out: str, kill: int | None) -> int:
        doc = job_doc(tmp_path, pair, rows, out, messages_column="messages")
        doc.update(conversation={"followups": {"function": "user_sim:next_turn"}}, sampling=sampling)
        doc["output"]["rows_per_part"] = 1
        write_job(tmp_path, doc, f"{out}.yaml")
        env = {**os.environ, "SIM_LOG": str(tmp_path / f"{out}.log"), "PYTHONPATH": str(tmp_path)}
        env.pop("SIM_KILL", None)
        if kill:
            env["SIM_KILL"] = str(kill)
        return subprocess.run([sys.executable, "-m", "dflash_batch.cli", "run", "--no-progress", f"{out}.yaml"],
                              env=env, capture_output=True, text=True).returncode

    assert run_cli("whole", None) == 0
    assert run_cli("killed", 12) == -9
    killer = (tmp_path / "killed.log").read_text().splitlines()[-1]  # the call in flight at the kill
    assert (tmp_path / "killed").rglob("turns.jsonl"), "no turn was journaled before the kill"
    partial = {r["row_id"] for r in read_out(tmp_path / "killed")}
    assert 0 < len(partial) < len(rows), "the kill should come mid-run"
    assert run_cli("killed", None) == 0

    volatile = {"ttft_s", "latency_s", "cached_tokens", "turn_prompt_tokens", "config_hash"}
    whole = {r["row_id"]: {k: v for k, v in r.items() if k not in volatile} for r in read_out(tmp_path / "whole")}
    resumed = {r["row_id"]: {k: v for k, v in r.items() if k not in volatile} for r in read_out(tmp_path / "killed")}
    assert resumed == whole
    assert all(len(json.loads(r["conversation"])) == 6 for r in whole.values())  # 3 user + 3 assistant turns
    calls = (tmp_path / "killed.log").read_text().splitlines()
    repeated = {c for c in calls if calls.count(c) > 1}
    assert repeated <= {killer}, f"simulator calls made again for finished turns: {repeated - {killer}}"
    # the conversation killed mid-way kept its first turn (the journal's) and prefilled its history
    # whole for its second: more than the opening the uninterrupted run prefilled, by the prompt at least
    row_id = "c" + killer.split(":")[0].split()[-1]
    row = {r["row_id"]: r for r in read_out(tmp_path / "killed")}[row_id]
    kept = {r["row_id"]: r for r in read_out(tmp_path / "whole")}[row_id]
    assert row["turn_prompt_tokens"][0] == kept["turn_prompt_tokens"][0]
    assert row["turn_prompt_tokens"][1] > kept["turn_prompt_tokens"][1] + row["prompt_tokens"]


def test_a_conversation_that_outgrows_its_bucket_goes_on_in_a_larger_one_then_ends_full(tmp_path, pair,
                                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Count {i}."}], "more": ["Go on."] * 8}
            for i in range(3)]
    moving = job_doc(tmp_path, pair, rows, "moving", messages_column="messages", followups_column="more")
    moving["buckets"] = [{"max_tokens": 96}, {"max_tokens": 256}]
    staying = job_doc(tmp_path, pair, rows, "staying", messages_column="messages", followups_column="more")
    staying["buckets"] = [{"max_tokens": 256}]
    moved, stayed = run(tmp_path, moving, "moving"), run(tmp_path, staying, "staying")
    for k, row in moved.items():
        assert row["conversation_end"] == stayed[k]["conversation_end"] == "context_full"
        assert row["turn_token_ids"] == stayed[k]["turn_token_ids"]  # prefilled whole or kept: the same tokens
        grew = [i for i, (a, b) in enumerate(zip(row["turn_prompt_tokens"], stayed[k]["turn_prompt_tokens"]))
                if a != b]
        assert len(grew) == 1 and row["turn_prompt_tokens"][grew[0]] > 96 - 6  # the move: its history, whole
        # its whole history: the earlier turns' prompt tokens (each later one counts its anchor, generated
        # before) and tokens, with its own opening (the other run's count, less that run's anchor)
        g = grew[0]
        history = sum(row["turn_prompt_tokens"][:g]) - (g - 1) + sum(row["turn_completion_tokens"][:g])
        assert row["turn_prompt_tokens"][g] == history + stayed[k]["turn_prompt_tokens"][g] - 1


def test_a_tool_module_that_does_not_import_stops_the_job_before_any_model_loads(tmp_path, pair, monkeypatch):
    monkeypatch.chdir(tmp_path)
    doc = job_doc(tmp_path, pair, [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}],
                  messages_column="messages")
    for conversation, words in (({"tools": {"module": "no_such_tools", "format": "hermes"}},
                                 "conversation.tools.module: cannot import 'no_such_tools'"),
                                ({"tools": {"module": "json"}}, "conversation.tools.format: the chat template"),
                                ({"followups": {"function": "json:no_such"}},
                                 "conversation.followups.function: 'json' has no function 'no_such'")):
        doc["conversation"] = conversation

        def no_model(job, tokenizer):
            raise AssertionError("the models loaded")

        with pytest.raises(JobError) as e:
            run_job(write_job(tmp_path, doc), no_model, ONE, progress=False)
        assert words in str(e.value), str(e.value)


@pytest.mark.slow
def test_scripted_conversations_under_tensor_parallel_2_equal_tp1(tmp_path, pair, monkeypatch):
    """Every rank makes each scripted turn at the same point (no thread), so the ranks' schedules
    and collectives match, and the rows are TP1's."""
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"What is {i} times 7?"}], "more": FOLLOWUPS}
            for i in range(4)]
    out = {}
    for tp in (1, 2):
        doc = job_doc(tmp_path, pair, rows, f"tp{tp}", messages_column="messages", followups_column="more")
        doc["model"]["tensor_parallel_size"] = tp
        write_job(tmp_path, doc, f"tp{tp}.yaml")
        done = subprocess.run([sys.executable, "-m", "dflash_batch.cli", "run", "--no-progress", f"tp{tp}.yaml"],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        volatile = {"ttft_s", "latency_s", "config_hash"}
        out[tp] = {r["row_id"]: {k: v for k, v in r.items() if k not in volatile} for r in read_out(tmp_path / f"tp{tp}")}
    assert out[1] == out[2] and all(len(r["turn_token_ids"]) == 3 for r in out[1].values())


def test_tool_calls_are_read_in_both_formats():
    from dflash_batch.tools import parse_calls, template_format

    kimi = ("I will look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.add:1'
            '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    before, calls = parse_calls(kimi, "kimi", 0)
    assert before == "I will look."
    assert [(c.id, c.name, c.arguments) for c in calls] == [("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                                                            ("functions.add:1", "add", '{"a": 1}')]
    hermes = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
    before, calls = parse_calls(hermes, "hermes", 3)
    assert before == "Sure.\n" and [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("call_3_0", "add", {"a": 1, "b": 2})]
    assert parse_calls("No tools here.", "hermes", 0) == ("No tools here.", [])
    assert template_format("{{ '<|tool_call_begin|>' }}") == "kimi" and template_format("<tool_call>") == "hermes"
    assert template_format("{{ messages }}") is None
