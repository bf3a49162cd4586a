"""`dflash-batch report`: the model card's tables, pooled as ratios of sums across shards."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from dflash_batch.io.export import export_dataset, export_openai_batch
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

CLI = [sys.executable, "-m", "dflash_batch.cli", "report"]


@pytest.fixture()
def out_dir(tmp_path, model_dir):
    rows = [{"id": f"r{i}", "input_ids": [11] * (1 + i * 9), "dataset": ["gsm", "math", "aime"][i % 3],
             "mx": 3 + i % 17} for i in range(30)]
    rows.append({"id": "bad", "input_ids": [], "dataset": "gsm"})
    write_jsonl(tmp_path / "p.jsonl", rows)
    doc = base_job(model_dir, ["p.jsonl"], buckets=[{"max_tokens": 64}, {"max_tokens": 256}],
                   sampling={"n": 2})
    doc["input"] = {"paths": ["p.jsonl"], "input_ids_column": "input_ids", "id_column": "id",
                    "passthrough_columns": ["dataset"], "sampling_columns": {"max_new_tokens": "mx"}}
    job = write_job(tmp_path, doc)
    for i in range(2):  # two Slurm shards into one directory
        run_job(job, fake_factory(), Shard(i, 2), progress=False)
    return tmp_path / "out"


def test_report_tables_are_ratios_of_sums(out_dir):
    out = subprocess.run([*CLI, str(out_dir), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    rows = read_out(out_dir)
    assert report["group_by"] == "dataset"
    for name, g in report["groups"].items():
        mine = [r for r in rows if r["dataset"] == name and r["status"] == "ok"]
        rounds = sum(r["spec_rounds"] for r in mine)
        accepted = sum(r["spec_accepted"] for r in mine)
        assert g["acc_len"] == pytest.approx(1 + accepted / rounds)
        # the fake engine's rounds verify fewer drafts than the block at times (a draft schedule)
        verified = sum(r["spec_drafts_verified"] for r in mine)
        assert verified < 7 * rounds
        assert g["proposal_acceptance"] == pytest.approx(accepted / verified)
        assert g["requests"] == len(mine) and g["prompts"] == len({r["row_id"] for r in rows if r["dataset"] == name})
        assert g["truncated"] == sum(r["finish_reason"] == "length" for r in mine)
        assert g["errors"] == sum(r["dataset"] == name and r["status"] == "error" for r in rows)
    assert report["groups"]["gsm"]["errors"] >= 2  # the empty row, both samples
    overall = report["overall"]
    hist = [sum(r["spec_histogram"][n] for r in rows if r["status"] == "ok") for n in range(8)]
    tried = [sum(r["spec_verified_histogram"][n] for r in rows if r["status"] == "ok") for n in range(8)]
    assert overall["histogram"] == hist and overall["verified_histogram"] == tried
    # a row's record is whole: a round each, verified drafts summed
    assert all(sum(r["spec_verified_histogram"]) == r["spec_rounds"] and r["spec_drafts_verified"] ==
               sum(n * c for n, c in enumerate(r["spec_verified_histogram"])) for r in rows if r["status"] == "ok")
    assert overall["trials"] == [sum(tried[k:]) for k in range(1, 8)]
    assert overall["alpha"] == pytest.approx([sum(hist[k:]) / sum(tried[k:]) for k in range(1, 8)])
    assert set(report["buckets"]) == {"0-64", "64-256", "-"}  # "-": rows that failed before bucketing
    assert (out_dir / "report.png").stat().st_size > 1000


def test_report_markdown_and_errors(out_dir, tmp_path):
    out = subprocess.run([*CLI, str(out_dir), "--plot", str(tmp_path / "p.png")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "| dataset | acc_len | proposal acceptance | prompts | requests | truncated | mean out tok |" in out.stdout
    assert "| aime |" in out.stdout and "α_7" in out.stdout and (tmp_path / "p.png").exists()
    bad = subprocess.run([*CLI, str(out_dir), "--group-by", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no column 'nope'" in bad.stderr


def test_rows_without_a_sample_0_are_rows(out_dir):
    """A retry's run may hold only later samples (no prompt counted): its tables, not "No rows"."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from dflash_batch.io.ledger import part_files
    for f in part_files(out_dir):
        t = pq.read_table(f)
        pq.write_table(t.filter(pc.and_(pc.equal(t["sample_index"], 1), pc.equal(t["status"], "ok"))), f)
    out = subprocess.run([*CLI, str(out_dir)], capture_output=True, text=True)
    assert out.returncode == 0 and "| all |" in out.stdout and "No rows" not in out.stdout, out.stdout


def test_report_of_a_run_without_rows_agrees_with_status(tmp_path, model_dir):
    """Two shards, only shard 0 run, no part committed. Inputs that hold no rows (input.allow_empty):
    `status` calls both shards complete (shard 1 holds none), and `report` agrees: "No rows", exit
    0. Inputs whose rows all fall in shard 1: `status` calls it not started, and `report` refuses,
    naming it."""
    from dflash_batch.plan.shards import shard_of

    def status(out_dir) -> str:
        done = subprocess.run([sys.executable, "-m", "dflash_batch.cli", "status", str(out_dir)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    (tmp_path / "empty.jsonl").write_bytes(b"")
    empty = write_job(tmp_path, base_job(model_dir, ["empty.jsonl"], input={"allow_empty": True},
                                         output={"dir": "empty"}))
    run_job(empty, fake_factory(), Shard(0, 2), progress=False)
    assert "2 shard(s), 2 complete" in status(tmp_path / "empty")
    report = subprocess.run([*CLI, str(tmp_path / "empty")], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    assert report.stdout == "No rows: every shard of the run finished, and its inputs held no rows.\n"
    as_json = subprocess.run([*CLI, str(tmp_path / "empty"), "--json"], capture_output=True, text=True)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["overall"]["prompts"] == 0, as_json.stderr
    assert not (tmp_path / "empty" / "report.png").exists()

    ids = [i for i in map(str, range(40)) if shard_of(i, 2) == 1][:3]
    write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": "hi"} for i in ids])
    run_job(write_job(tmp_path, base_job(model_dir, ["p.jsonl"])), fake_factory(), Shard(0, 2), progress=False)
    assert "2 shard(s), 1 complete" in status(tmp_path / "out")
    refused = subprocess.run([*CLI, str(tmp_path / "out")], capture_output=True, text=True)
    assert refused.returncode == 2 and "no committed part files yet, and shard(s) 1 of 2 not complete" in \
        refused.stderr, refused.stderr


@pytest.mark.parametrize("match, response, answer, right", [
    ("exact", " 42 ", "42", True), ("exact", "The answer is 42.", "42", False),
    ("contains", "The answer is 42.", "42", True), ("contains", "The answer is 4.", "42", False),
    ("last-number", "12 + 30 = 42. The answer is 42.", "42", True),
    ("last-number", "12 + 30 = 42. The answer is 43.", "42", False),
    ("last-number", "It costs $1,250.00 in total", "1250", True),
    ("last-number", "no number here", "7", False), ("last-number", "-3 is it", "-3", True),
])
def test_answer_matching(match, response, answer, right):
    from dflash_batch.report import is_right

    assert is_right(response, answer, match) is right


def test_report_scores_an_answer_column(out_dir):
    """The test engine's responses are its token ids as text; score them against an answer
    column made from one row's own response (so exactly the rows that share it are right)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = read_out(out_dir)
    target = next(r["response"] for r in rows if r["status"] == "ok")
    for part in sorted(out_dir.rglob("part-*.parquet")):
        t = pq.read_table(part)
        pq.write_table(t.append_column("expected", pa.array([target] * t.num_rows)), part)
    out = subprocess.run([*CLI, str(out_dir), "--json", "--answer-column", "expected", "--match", "exact"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    want = sum(r["status"] == "ok" and r["response"].strip() == target.strip() for r in rows)
    answered = sum(r["status"] == "ok" for r in rows)  # error rows (the bad row's) give no answer to score
    assert report["overall"]["right"] == want >= 1 and report["overall"]["scored"] == answered < len(rows)
    md = subprocess.run([*CLI, str(out_dir), "--answer-column", "expected", "--match", "exact"],
                        capture_output=True, text=True).stdout
    assert f"| {want}/{answered} |" in md


def test_parts_written_before_the_drafts_verified_were_recorded(out_dir, tmp_path):
    """Output schema v1 parts (no spec_drafts_verified, no spec_verified_histogram) are reported as
    they were written, every round verifying the whole block, and the report and the export card
    say so."""
    import pyarrow.parquet as pq

    from dflash_batch.io.ledger import part_files
    cli = [sys.executable, "-m", "dflash_batch.cli", "export", str(out_dir)]
    rows = [r for r in read_out(out_dir) if r["status"] == "ok"]
    verified = sum(r["spec_drafts_verified"] for r in rows)
    assert subprocess.run([*cli, str(tmp_path / "v2")], capture_output=True).returncode == 0
    card = (tmp_path / "v2" / "README.md").read_text()
    share = sum(r["spec_accepted"] for r in rows) / verified
    assert f"proposal acceptance (accepted / drafts verified, pooled) {share:.3f}.\n" in card
    for f in part_files(out_dir):
        pq.write_table(pq.read_table(f).drop_columns(["spec_drafts_verified", "spec_verified_histogram"]), f)
    out = subprocess.run([*CLI, str(out_dir), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    overall = json.loads(out.stdout)["overall"]
    rounds, accepted = sum(r["spec_rounds"] for r in rows), sum(r["spec_accepted"] for r in rows)
    assert overall["proposal_acceptance"] == pytest.approx(accepted / (7 * rounds))
    assert overall["trials"] == [rounds] * 7
    text = subprocess.run([*CLI, str(out_dir)], capture_output=True, text=True).stdout
    assert "assume every round verified the whole block" in text
    export = subprocess.run([*cli, str(tmp_path / "hf")], capture_output=True, text=True)
    assert export.returncode == 0, export.stderr
    card = (tmp_path / "hf" / "README.md").read_text()
    assert f"proposal acceptance (accepted / drafts verified, pooled) {accepted / (7 * rounds):.3f}" in card
    assert "count every round as verifying the whole block" in card


def test_export_refuses_an_unfinished_run_unless_partial(tmp_path, model_dir):
    """A run stopped part way (preempted) is not exported as a dataset unless asked; asked, the
    card says it holds only the rows committed so far. The same for OpenAI Batch output lines."""
    from dflash_batch.runner import Preempted
    from tests.fake_engine import FakeEngine

    def stops_after_5(job, tokenizer):
        engine = FakeEngine(tokenizer)
        inner = engine.generate

        def generate(requests, bucket):
            for i, c in enumerate(inner(requests, bucket)):
                if i == 5:
                    raise Preempted()
                yield c

        engine.generate = generate
        return engine

    write_jsonl(tmp_path / "p.jsonl", [{"id": f"r{i}", "prompt": f"row {i}"} for i in range(12)])
    job = write_job(tmp_path, base_job(model_dir, ["p.jsonl"]))
    with pytest.raises(Preempted):
        run_job(job, stops_after_5, Shard(0, 1), progress=False)
    cli = [sys.executable, "-m", "dflash_batch.cli", "export", str(tmp_path / "out")]
    for args in ([str(tmp_path / "hf")], [str(tmp_path / "batch.jsonl"), "--format", "openai_batch"]):
        refused = subprocess.run([*cli, *args], capture_output=True, text=True)
        assert refused.returncode == 2, refused.stderr
        assert "not finished" in refused.stderr and "shard(s) 0 of 1" in refused.stderr and "--partial" in refused.stderr
        assert subprocess.run([*cli, *args, "--partial"], capture_output=True).returncode == 0
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "**Partial**: exported before the run finished" in card and "5 rows: 5 ok" in card


def test_cached_tokens_count_once_a_request_in_every_table_and_export(tmp_path, model_dir, capsys):
    """Samples of one prompt fork its prefill (cached_tokens: their whole prompt) and some rows
    take a head another row computed: the run's end table, `status`, the OpenAI export's usage
    and the dataset card all count prompt and cached tokens once a request (its sample 0), as
    OpenAI does, so they give one cached share; the card names the target by its architecture."""
    import dataclasses

    from click.testing import CliRunner

    from dflash_batch.cli import _run_shard, main
    from tests.fake_engine import FakeEngine

    head = {f"r{i}": 5 * (i % 2) for i in range(6)}  # the tokens sample 0 of each row takes from a head

    class Sharing(FakeEngine):
        def generate(self, requests, bucket):
            prompts = {r.key: len(r.prompt_ids) for r in requests}
            for c in super().generate(requests, bucket):
                row, sample = c.key
                yield dataclasses.replace(c, cached_tokens=prompts[c.key] if sample else head[row])

    write_jsonl(tmp_path / "p.jsonl", [{"id": row, "prompt": "word " * (3 + 4 * i)} for i, row in enumerate(head)])
    job = write_job(tmp_path, base_job(model_dir, ["p.jsonl"], sampling={"n": 3}))
    _run_shard(job, Shard(0, 1), False, str(tmp_path / "job.yaml"), lambda j, tok: Sharing(tok))
    table = capsys.readouterr().out
    rows = read_out(tmp_path / "out")
    prompt = sum(r["prompt_tokens"] for r in rows if r["sample_index"] == 0)
    share = f"{sum(head.values()) / prompt:.0%}"
    assert len(rows) == 18 and share != f"{sum(r['cached_tokens'] for r in rows) / (3 * prompt):.0%}"
    assert re.search(rf"0-256 +18 +18 +0 +{prompt} +{share} ", table), table
    status = CliRunner().invoke(main, ["status", str(tmp_path / "out")]).output
    assert re.search(rf"0-256 +18 +0 +{prompt} +{share}\n", status), status
    for shown in (table, status):
        assert "each request's prompt counted once (its sample 0)" in shown

    export_openai_batch(tmp_path / "out", tmp_path / "batch.jsonl")
    usage = [json.loads(line)["response"]["body"]["usage"] for line in (tmp_path / "batch.jsonl").open()]
    assert sum(u["prompt_tokens"] for u in usage) == prompt
    assert sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage) == sum(head.values())
    export_dataset(tmp_path / "out", tmp_path / "hf")
    card = (tmp_path / "hf" / "README.md").read_text()
    assert (f"- prompt tokens, each request's once (its sample 0): {prompt}; of them cached, taken from a head "
            f"another request computed (engine.share_prompts): {sum(head.values())} ({share})\n") in card
    assert "- target: `model` (FakeForTests)\n- drafter: none (target-only decoding)\n" in card


def test_the_card_names_a_model_without_where_it_lies(tmp_path):
    """A Hub cache snapshot by ORG/NAME, else the directory's name; the architecture from its
    config.json, while the checkpoint is there to read."""
    from dflash_batch.io.card import model_name

    snapshot = tmp_path / "hub" / "models--moonshotai--Kimi-K3" / "snapshots" / "0a1b2c"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["KimiK3ForConditionalGeneration"]}))
    assert model_name(str(snapshot)) == "`moonshotai/Kimi-K3` (KimiK3ForConditionalGeneration)"
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({"model_type": "dflash"}))
    assert model_name(str(tmp_path / "drafter")) == "`drafter` (dflash)"
    assert model_name(str(tmp_path / "gone" / "Kimi-K3")) == "`Kimi-K3`"


def test_parts_written_before_cached_tokens_read_as_null(out_dir):
    """Output schema v2 parts (no cached_tokens) and v1 parts (nor the drafts verified) read with
    cached_tokens null, so the shard stats, `status` and the exported card sum nothing for them."""
    import pyarrow.parquet as pq

    from dflash_batch.io.ledger import STAT_COLUMNS, count_committed, part_files, read_part
    files = part_files(out_dir)
    for dropped, old in ((["cached_tokens"], False), (["spec_drafts_verified", "spec_verified_histogram"], True)):
        for f in files:
            t = pq.read_table(f)
            pq.write_table(t.drop_columns([c for c in dropped if c in t.column_names]), f)
        t, was_old = read_part(files[0], STAT_COLUMNS + ["row_id"])
        assert was_old == old and t.column_names == STAT_COLUMNS + ["row_id"]
        assert t["cached_tokens"].null_count == len(t) and t["spec_drafts_verified"].null_count < len(t)
    _, by_bucket, _ = count_committed(out_dir)
    assert all(by_bucket[k] == 0 for k in by_bucket if k[1] == "cached_tokens")
    export_dataset(out_dir, out_dir.parent / "hf")  # the card says the share counts none for them
    assert "0 (0%) (rows written before outputs recorded cached tokens count none)\n" in \
        (out_dir.parent / "hf" / "README.md").read_text()
