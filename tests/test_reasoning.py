"""output.split_reasoning: a thinking model's output split into `reasoning` and `response` at its
think delimiters, special tokens that decoding skips, so the split is made on token ids.

The engine is a script (each prompt's output written out as text with its delimiters, encoded
by the tokenizer, ended as the engine ends it: a stop token, a stop string, or the budget), so
each case of the policy in dflash_batch/reasoning.py is checked against the text it was made
from: closed, closed after a template that opens the thinking, never closed, no thinking at
all, a stop string and a stop token after the answer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest

from dflash_batch.engine.request import Completion, Request
from dflash_batch.job import JobError
from dflash_batch.plan.buckets import Bucket
from dflash_batch.plan.shards import Shard
from dflash_batch.tokenizer import Tokenizer
from dflash_batch.runner import run_job
from dflash_batch.testing.tokenizer import CHAT_TEMPLATE, make_tokenizer_dir
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

THINK = ("<think>", "</think>")
# prompt -> what the scripted model writes ("^" marks the end of the budget: the rest is cut)
SCRIPT = {
    "closed": "<think>3 and 5 make 8.</think>The answer is 8.<|im_end|>",
    "opened by the template": "3 and 5 make 8.</think>\n\nThe answer is 8.<|im_end|>",
    "never closed": "<think>3 and 5 make^, and then",
    "no thinking": "The answer is 8.<|im_end|>",
    "stop string": "<think>adding</think>The answer is 8. STOP and more",
    "late start": "Hmm.<think>adding</think>8<|im_end|>",
}
WANT = {  # (reasoning, response, finish_reason)
    "closed": ("3 and 5 make 8.", "The answer is 8.", "stop"),
    "opened by the template": ("3 and 5 make 8.", "\n\nThe answer is 8.", "stop"),
    "never closed": ("3 and 5 make", None, "length"),
    "no thinking": (None, "The answer is 8.", "stop"),
    "stop string": ("adding", "The answer is 8. ", "stop"),
    "late start": ("Hmm.adding", "8", "stop"),
}


class ScriptedEngine:
    """Writes SCRIPT[prompt] for each request, stopping as the real engine does."""

    vocab_size = None

    def __init__(self, tok: Tokenizer):
        self.tok = tok

    def _complete(self, req: Request) -> Completion:
        text = self.tok.decode(req.prompt_ids)
        case = max((c for c in SCRIPT if c in text), key=len)  # "closed" is in "never closed"
        written, _, _ = SCRIPT[case].partition("^")
        ids = self.tok.encode_batch([written], add_special_tokens=False)[0]
        finish, reason = ("length", None) if "^" in SCRIPT[case] else (None, None)
        for k, t in enumerate(ids):
            if t in req.params.stop_token_ids:
                ids, finish, reason = ids[:k + 1], "stop", str(t)
                break
        out = self.tok.decode(ids[:-1] if finish == "stop" else ids)
        for s in req.params.stop:
            if (i := out.find(s)) >= 0:
                out, finish, reason = out[:i], "stop", s
        return Completion(req.key, ids, out, finish or "length", reason, None, 0.0, 0.0)

    def generate(self, requests: Iterable[Request], bucket: Bucket) -> Iterator[Completion]:
        for req in requests:
            yield self._complete(req)


@pytest.fixture
def model(tmp_path):
    d = make_tokenizer_dir(tmp_path / "model", extra_special=THINK)
    (d / "config.json").write_text('{"architectures": ["FakeForTests"], "eos_token_id": %d}'
                                   % Tokenizer(d).token_to_id("<|im_end|>"))
    return d


def run_cases(tmp_path, model, **output) -> dict[str, dict]:
    # A template that opens the thinking for the model on one of the prompts (a real template
    # does it for every prompt when thinking is on).
    (tmp_path / "think.jinja").write_text(CHAT_TEMPLATE.replace(
        "{% if enable_thinking is defined",
        "{% if messages[-1]['content'] == 'opened by the template' %}<think>{% endif %}"
        "{% if enable_thinking is defined"))
    write_jsonl(tmp_path / "p.jsonl", [{"id": c, "messages": [{"role": "user", "content": c}]} for c in SCRIPT])
    doc = base_job(model, ["p.jsonl"], sampling={"max_new_tokens": 64, "stop": ["STOP"]},
                   output={"split_reasoning": True, **output})
    doc["input"] = {"paths": ["p.jsonl"], "messages_column": "messages", "id_column": "id"}
    doc["model"]["chat_template"] = "think.jinja"
    run_job(write_job(tmp_path, doc), lambda job, tok: ScriptedEngine(tok), Shard(0, 1), progress=False)
    return {r["row_id"]: r for r in read_out(tmp_path / "out")}


def test_each_case_of_the_policy(tmp_path, model):
    rows = run_cases(tmp_path, model)
    for case, (reasoning, response, finish) in WANT.items():
        r = rows[case]
        assert (r["reasoning"], r["response"], r["finish_reason"]) == (reasoning, response, finish), case


def test_nothing_is_lost_and_without_the_split_the_delimiters_vanish(tmp_path, model):
    (tmp_path / "split").mkdir()
    (tmp_path / "plain").mkdir()
    split = run_cases(tmp_path / "split", model)
    plain = run_cases(tmp_path / "plain", model, split_reasoning=False)
    assert "reasoning" not in next(iter(plain.values()))
    assert plain["closed"]["response"] == "3 and 5 make 8.The answer is 8."  # why the split is on ids
    for case, row in split.items():
        assert (row["reasoning"] or "") + (row["response"] or "") == plain[case]["response"], case


def test_named_delimiters(tmp_path, model):
    rows = run_cases(tmp_path, model, reasoning_delimiters=list(THINK))
    assert {c: (r["reasoning"], r["response"]) for c, r in rows.items()} == {c: w[:2] for c, w in WANT.items()}


@pytest.mark.parametrize("output, words", [
    ({"reasoning_delimiters": ["<think>", "</thought>"]},
     "output.reasoning_delimiters: ['</thought>'] is not a single token of the tokenizer of"),
    ({"reasoning_delimiters": ["<think>"]}, "reasoning_delimiters"),
])
def test_bad_delimiters_stop_before_any_work(tmp_path, model, output, words):
    with pytest.raises(JobError, match=words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        run_cases(tmp_path, model, **output)
    assert not list(tmp_path.rglob("part-*.parquet"))


def test_a_tokenizer_without_think_tokens_is_refused(tmp_path, model_dir):
    with pytest.raises(JobError, match="output.split_reasoning: the tokenizer of .* has none of the think "
                                       "delimiters <think>/</think>, ◁think▷/◁/think▷"):
        run_cases(tmp_path, model_dir)
    assert not list(tmp_path.rglob("part-*.parquet"))


def test_delimiters_without_the_split_are_refused(tmp_path, model):
    doc = base_job(model, ["p.jsonl"], output={"reasoning_delimiters": list(THINK)})
    with pytest.raises(JobError, match="reasoning_delimiters is only used with split_reasoning: true"):
        write_job(tmp_path, doc)
