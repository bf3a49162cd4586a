"""make-needle + report: prompts at the asked lengths (in the tokenizer's tokens) holding every
needle and a question about one of them, the same file from the same seed; a run's report puts
retrieval (the expected value in the response) beside acceptance per bucket, counted right."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
from click.testing import CliRunner

from dflash_batch.cli import main
from dflash_batch.plan.shards import Shard
from dflash_batch.tokenizer import Tokenizer
from dflash_batch.report import build_report, to_markdown
from dflash_batch.runner import run_job
from tests.fake_engine import FakeEngine
from tests.jobs_util import base_job, write_job

README = Path(__file__).resolve().parent.parent / "README.md"


def make(tmp_path, model_dir, name: str, seed: int = 0) -> list[dict]:
    out = tmp_path / name
    result = CliRunner().invoke(main, ["make-needle", str(README), "--tokenizer", str(model_dir), "--lengths",
                                       "400,900", "--count", "6", "--keys", "3", "--seed", str(seed), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


def test_prompts_hold_their_needles_at_the_asked_lengths(tmp_path, model_dir):
    rows = make(tmp_path, model_dir, "a.jsonl")
    assert len(rows) == 12 and rows == make(tmp_path, model_dir, "b.jsonl")  # the seed decides
    assert rows != make(tmp_path, model_dir, "c.jsonl", seed=1)
    tok = Tokenizer(model_dir)
    for row in rows:
        text = row["messages"][0]["content"]
        asked = re.search(r"magic number for (\w+) mentioned", text).group(1)
        assert re.search(rf"for {asked} is: {row['needle_answer']}\.", text)
        assert len(re.findall(r"One of the special magic numbers for \w+ is: \d{7}\.", text)) == 3
        tokens = len(tok.encode_batch([tok.render_chat(row["messages"], {})], False)[0])
        assert 0.9 * row["needle_length"] <= tokens <= row["needle_length"], (tokens, row["needle_length"])


def test_make_needle_creates_its_output_directory(tmp_path, model_dir):
    out = tmp_path / "fresh" / "out" / "needles.jsonl"  # as jobs/demo-needle.yaml writes it in a fresh clone
    result = CliRunner().invoke(main, ["make-needle", str(README), "--tokenizer", str(model_dir), "--lengths", "400",
                                       "--count", "1", "--keys", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert len(out.read_bytes().splitlines()) == 1


class Retriever(FakeEngine):
    """Answers the needle question right when the value is odd, else says something else."""

    def _complete(self, req):
        c = super()._complete(req)
        text = self.tok.decode(req.prompt_ids)
        key = re.search(r"magic number for (\w+) mentioned", text).group(1)
        value = re.search(rf"for {key} is: (\d+)", text).group(1)
        c.text = f"It is {value}." if int(value) % 2 else "I do not know."
        return c


def test_report_puts_retrieval_beside_acceptance(tmp_path, model_dir):
    rows = make(tmp_path, model_dir, "needles.jsonl")
    doc = base_job(model_dir, ["needles.jsonl"], input={"prompt_column": None, "messages_column": "messages",
                                                        "passthrough_columns": ["needle_answer", "needle_length"]},
                   engine={"max_model_len": 1024}, buckets=[{"max_tokens": 512}, {"max_tokens": 1024}])
    run_job(write_job(tmp_path, doc), lambda job, tok: Retriever(tok), Shard(0, 1), progress=False)
    report = build_report(tmp_path / "out")
    assert report["answer"] == "needle_answer"
    right = {length: sum(int(r["needle_answer"]) % 2 for r in rows if r["needle_length"] == length)
             for length in (400, 900)}
    assert [b["right"] for b in report["buckets"].values()] == [right[400], right[900]]
    assert [b["scored"] for b in report["buckets"].values()] == [6, 6]
    table = to_markdown(report).split("## Long context")[1]
    assert f"| {right[400]}/6 |" in table and f"| {right[900]}/6 |" in table
