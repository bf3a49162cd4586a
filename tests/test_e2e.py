"""`dflash-batch run` end to end on a tiny Qwen3 target + DFlash2 drafter with a real tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_batch.testing.tokenizer import make_tokenizer_dir
from tests.engine_util import make_drafter, make_target
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "dflash_batch.cli"]
VOCAB = 320  # the tiny tokenizer has 261 ids (256 bytes + 5 special): the model holds them all


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("pair")
    target = make_target(d / "target", vocab=VOCAB, peaked=True, active=8)
    make_tokenizer_dir(target, vocab_size=256)
    make_drafter(d / "drafter", 2, vocab=VOCAB, sliding=True, window=16)
    return target, d / "drafter"


def _job(tmp_path: Path, pair, out: str, passthrough: tuple[str, ...] = ("group",), **sections) -> Path:
    target, drafter = pair
    rows = [{"id": f"r{i}", "prompt": "What is 12 plus 30? " * (1 + i % 7), "group": "ab"[i % 2]}
            for i in range(10)]
    rows.append({"id": "empty", "prompt": ""})
    write_jsonl(tmp_path / "p.jsonl", rows)
    doc = base_job(target, ["p.jsonl"], sampling={"n": 2, "max_new_tokens": 24},
                   input={"passthrough_columns": list(passthrough)}, output={"dir": out, "rows_per_part": 4},
                   buckets=[{"max_tokens": 64}, {"max_tokens": 256}], **sections)
    doc["model"]["drafter"] = str(drafter)
    doc["engine"].update(max_num_seqs=3, compile=False)  # the compiled round: test_static_round.py
    write_job(tmp_path, doc, f"{out}.yaml")
    return tmp_path / f"{out}.yaml"


def _run(job_file: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([*CLI, "run", str(job_file), "--no-progress"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


@pytest.mark.slow
def test_run_writes_rows_whose_counters_add_up(tmp_path, pair):
    out = _run(_job(tmp_path, pair, "out"))
    assert "taps: layers=(1, 2)" in out.stderr
    rows = read_out(tmp_path / "out")
    assert len(rows) == 22 and len({(r["row_id"], r["sample_index"]) for r in rows}) == 22
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 20 and {r["error_type"] for r in rows if r["status"] == "error"} == {"empty_prompt"}
    for r in ok:
        hist = r["spec_histogram"]
        assert len(hist) == r["spec_block_size"] == 8
        assert sum(hist) == r["spec_rounds"]
        assert sum(k * c for k, c in enumerate(hist)) == r["spec_accepted"]
        assert r["acc_len"] == pytest.approx(1 + r["spec_accepted"] / r["spec_rounds"])
        # one token from the prefill, then accepted drafts + 1 bonus per round
        assert r["completion_tokens"] == 1 + r["spec_rounds"] + r["spec_accepted"]
        assert r["group"] in "ab" and r["finish_reason"] in ("stop", "length")
    assert sum(r["spec_accepted"] for r in ok) > 0
    stats = json.loads((tmp_path / "out" / "stats" / "shard-00000.json").read_text())["buckets"]
    assert sum(b["rows"] for b in stats.values()) == 22
    assert "acc_len" in out.stdout  # the summary table


@pytest.mark.slow
def test_load_dataset_reads_an_output_directory_as_is(tmp_path, pair):
    """Hugging Face `datasets` loads every committed row through the directory's dataset card,
    and none of its stats or run files."""
    datasets = pytest.importorskip("datasets")
    _run(_job(tmp_path, pair, "out"))
    loaded = datasets.load_dataset(str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"))
    assert list(loaded) == ["train"]
    rows = read_out(tmp_path / "out")
    assert sorted((r["row_id"], r["sample_index"]) for r in loaded["train"]) == sorted(
        (r["row_id"], r["sample_index"]) for r in rows)
    assert loaded["train"].column_names == list(rows[0])


@pytest.mark.slow
def test_export_writes_a_dataset_that_reloads_with_its_card(tmp_path, pair):
    """`export` with an SFT messages column (the prompt passed through): split files by the
    Hub's convention, every row once, the card's summary, and each row's messages."""
    datasets = pytest.importorskip("datasets")
    job = _job(tmp_path, pair, "out", passthrough=("group", "prompt"))
    _run(job)
    dest = tmp_path / "hub"
    out = subprocess.run([*CLI, "export", str(tmp_path / "out"), str(dest), "--rows-per-file", "8",
                          "--messages", "prompt"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (dest / "data").iterdir()) == [f"train-0000{i}-of-00003.parquet" for i in range(3)]
    card = (dest / "README.md").read_text()
    rows = read_out(tmp_path / "out")
    assert f"{len(rows)} rows: 20 ok, 2 error" in card and "acceptance length" in card
    assert str(tmp_path) not in card and "prompt tokens" in card  # no local path; ranges from the rows
    loaded = datasets.load_dataset(str(dest), cache_dir=str(tmp_path / "cache"))["train"]
    assert len(loaded) == len(rows) == 22
    by_key = {(r["row_id"], r["sample_index"]): r for r in rows}
    for r in loaded:
        want = by_key[(r["row_id"], r["sample_index"])]
        assert r["messages"] == [{"role": "user", "content": want["prompt"], "reasoning_content": None},
                                 {"role": "assistant", "content": want["response"], "reasoning_content": None}]
    again = subprocess.run([*CLI, "export", str(tmp_path / "out"), str(dest)], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
    assert again.returncode != 0 and "is not empty" in again.stderr


@pytest.mark.slow
def test_tensor_parallel_2_run_equals_tp1(tmp_path, pair):
    _run(_job(tmp_path, pair, "tp1"))
    _run(_job(tmp_path, pair, "tp2", model={"tensor_parallel_size": 2}))
    volatile = {"ttft_s", "latency_s", "config_hash"}

    def rows(out):
        return sorted(({k: v for k, v in r.items() if k not in volatile} for r in read_out(tmp_path / out)),
                      key=lambda r: (r["row_id"], r["sample_index"]))

    assert rows("tp1") == rows("tp2")


@pytest.mark.slow
@pytest.mark.parametrize("stop, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_sigterm_stops_every_tp_rank_and_resume_completes(tmp_path, pair, stop, code):
    """Slurm signals the launcher only (and `kill -INT` does): it must pass the signal on, the
    ranks must agree where to stop, and a rerun must finish the job without duplicates."""
    import signal
    import time

    target, drafter = pair
    rows = [{"id": f"r{i}", "prompt": "What is 12 plus 30? " * (1 + i % 5)} for i in range(60)]
    write_jsonl(tmp_path / "p.jsonl", rows)
    doc = base_job(target, ["p.jsonl"], sampling={"max_new_tokens": 24}, output={"dir": "out", "rows_per_part": 1},
                   model={"tensor_parallel_size": 2})
    doc["model"]["drafter"] = str(drafter)
    doc["engine"]["max_num_seqs"] = 2
    write_job(tmp_path, doc)
    proc = subprocess.Popen([*CLI, "run", str(tmp_path / "job.yaml"), "--no-progress"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not read_out(tmp_path / "out") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(getattr(signal, stop))
    assert proc.wait(timeout=120) == code, proc.stderr.read().decode()[-2000:]
    done = len(read_out(tmp_path / "out"))
    assert 0 < done < 60
    _run(tmp_path / "job.yaml")
    keys = [(r["row_id"], r["sample_index"]) for r in read_out(tmp_path / "out")]
    assert len(keys) == len(set(keys)) == 60
