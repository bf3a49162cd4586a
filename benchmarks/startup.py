"""Start-up, paid once: time to first row and whole-process time of `dflash-batch run`, cold
(an empty compile cache), warm (the cache the cold run filled) and as the job runs by default,
side by side, for the demo job and a 24-row Qwen3 job (a tiny random Qwen3 + DFlash v1 pair
with a tokenizer, 128 new tokens a row, one bucket of 32).

Each run is a fresh `dflash-batch run` process writing a part per row; its first row's time is
when its first part appeared, counted from the process's launch. The outputs of every mode are
compared: they must be the same rows.

usage: python benchmarks/startup.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_batch.testing import checkpoints  # noqa: E402
from dflash_batch.testing.tokenizer import make_tokenizer_dir  # noqa: E402

SHAPE = dict(vocab=320, hidden=128, inter=256, heads=4, kv_heads=2, head_dim=32)  # the tokenizer's 261 ids fit


def qwen3_job(d: Path) -> Path:
    target = checkpoints.qwen3_checkpoint(d / "target", layers=4, **SHAPE)
    make_tokenizer_dir(target, vocab_size=256)
    checkpoints.dflash_checkpoint(d / "drafter", layers=2, **SHAPE)
    (d / "prompts.jsonl").write_text("".join(f'{{"id": "r{i}", "prompt": "Question {i}: what is {i} plus {2 * i}?"}}\n'
                                             for i in range(24)))
    doc = {"input": {"paths": ["prompts.jsonl"], "id_column": "id", "prompt_column": "prompt"},
           "model": {"target": "target", "drafter": "drafter", "dtype": "float32"},
           "engine": {"max_model_len": 256, "max_num_seqs": 32},
           "sampling": {"max_new_tokens": 128, "ignore_eos": True}, "output": {"dir": "out", "rows_per_part": 1}}
    (d / "qwen3.yaml").write_text(yaml.safe_dump(doc))
    return d / "qwen3.yaml"


def demo_job(d: Path) -> Path:
    doc = yaml.safe_load((ROOT / "jobs/demo.yaml").read_text())
    doc["input"]["paths"] = [str(ROOT / "jobs/demo/prompts.jsonl")]
    doc["model"].update(target=str(ROOT / "jobs/demo/models/target"), drafter=str(ROOT / "jobs/demo/models/drafter"))
    doc["output"] = {**doc["output"], "dir": "out", "rows_per_part": 1}
    (d / "demo.yaml").write_text(yaml.safe_dump(doc))
    return d / "demo.yaml"


def run(job: Path, out: Path, cache: Path, compile: bool | None, eager: bool = False) -> tuple[float, float, list]:
    """(seconds to the first row, seconds in all, the rows) of one `dflash-batch run` process."""
    doc = yaml.safe_load(job.read_text())
    doc["engine"]["cache_dir"] = str(cache)
    if compile is not None:
        doc["engine"]["compile"] = compile
    variant = job.with_name(f"{out.name}.yaml")
    variant.write_text(yaml.safe_dump(doc))
    command = [sys.executable, "-m", "dflash_batch.cli", "run", str(variant), "--output-dir", str(out), "--no-progress",
               *(["--eager"] if eager else [])]
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's code, whatever is installed
    proc = subprocess.Popen(command, cwd=job.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and any((out / "data").glob("shard-*/part-*.parquet")):
            first = time.perf_counter() - t0
        time.sleep(0.02)
    total = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{variant} failed:\n{proc.stderr.read()[-3000:]}")
    columns = ["row_id", "response", "completion_tokens"]
    rows = sorted(tuple(r.values()) for f in sorted((out / "data").rglob("part-*.parquet"))
                  for r in pq.read_table(f, columns=columns).to_pylist())
    return first or total, total, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1, help="runs of each mode (the table shows the fastest)")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="dflash-startup-"))
    # (job, whether its round can compile here: Kimi-K3's MXFP4 experts are grouped on the host on
    # the CPU, so its round runs uncompiled whatever the job says)
    jobs = {"demo (Kimi-K3 pair, 72 rows)": (demo_job(d), False), "Qwen3 + DFlash, 24 rows": (qwen3_job(d), True)}
    print(f"{'job':<30} {'mode':<40} {'first row s':>11} {'whole s':>8}")
    for name, (job, compiles) in jobs.items():
        results = {}
        modes = [("default, empty cache (cold)", "cold", dict(compile=None)),
                 ("default, the cache it filled (warm)", "cold", dict(compile=None)),
                 ("--eager", "eager", dict(compile=None, eager=True))]
        if compiles:
            modes += [("compile: true, empty cache (cold)", "compiled", dict(compile=True)),
                      ("compile: true, the cache it filled (warm)", "compiled", dict(compile=True))]
        for rep in range(args.repeats):
            for i, (mode, cache, kw) in enumerate(modes):
                out = d / f"out-{job.stem}-{rep}-{i}"
                got = run(job, out, d / f"cache-{job.stem}-{cache}-{rep}", **kw)
                best = results.get(mode)
                results[mode] = got if best is None else min(best, got, key=lambda r: r[0])
                shutil.rmtree(out)
        rows = {mode: r[2] for mode, r in results.items()}
        same = all(v == next(iter(rows.values())) for v in rows.values())
        for mode, (first, total, _) in results.items():
            print(f"{name:<30} {mode:<40} {first:>11.1f} {total:>8.1f}")
        print(f"{name:<30} outputs identical in every mode: {same}")
    shutil.rmtree(d)


if __name__ == "__main__":
    main()
