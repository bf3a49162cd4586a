"""The model card's tables from an output directory (all shards): acceptance per group and per
length bucket, per-position acceptance and the accepted-length histogram.

Every ratio is pooled as a ratio of sums over rows: acc_len = 1 + sum(accepted) / sum(rounds),
proposal acceptance = sum(accepted) / sum((B-1) * rounds), alpha_k = #(rounds with >= k accepted) /
#rounds. A per-row mean of acc_len would weight short answers like long ones.

With an expected-answer column the tables also score the responses: `exact` (the stripped
response is the answer), `contains` (the answer appears in it) or `last-number` (its last number
equals the answer's, as GSM8K-style graders read a final answer).
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq

from dflash_batch.io.ledger import part_files

COLUMNS = ["row_id", "status", "finish_reason", "completion_tokens", "bucket", "spec_block_size",
           "spec_rounds", "spec_accepted", "spec_histogram"]


MATCHES = ("exact", "contains", "last-number")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def is_right(response: str | None, answer, match: str) -> bool:
    """Whether a response gives the expected answer (see the module doc for `match`)."""
    if response is None or answer is None:
        return False
    answer = str(answer).strip()
    if match == "exact":
        return response.strip() == answer
    if match == "contains":
        return answer in response
    numbers = _NUMBER.findall(response)
    try:
        return bool(numbers) and float(numbers[-1].replace(",", "")) == float(answer.replace(",", ""))
    except ValueError:
        return False


def read_rows(out_dir: Path, group_by: str | None, answer: str | None = None) -> tuple[list[dict], str | None]:
    """Committed rows of every shard; group_by defaults to a `dataset` column when there is one."""
    files = part_files(out_dir)
    if not files:
        raise FileNotFoundError(f"{out_dir}: no committed part files")
    names = pq.read_schema(files[0]).names
    if group_by is None and "dataset" in names:
        group_by = "dataset"
    for col, what in ((group_by, "group by"), (answer, "score against")):
        if col is not None and col not in names:
            raise KeyError(f"{out_dir}: no column {col!r} to {what} in the output (columns: {names})")
    cols = COLUMNS + ([group_by] if group_by else []) + (["response", answer] if answer else [])
    cols = list(dict.fromkeys(cols))
    rows = [r for f in files for r in pq.read_table(f, columns=cols).to_pylist()]
    return rows, group_by


def summarize(rows: list[dict], answer: str | None = None, match: str = "last-number") -> dict:
    """One table line: acceptance pooled over `rows` (and, with an answer column, how many
    responses give the expected answer)."""
    ok = [r for r in rows if r["status"] == "ok"]
    spec = [r for r in ok if r["spec_rounds"]]
    rounds = sum(r["spec_rounds"] for r in spec)
    accepted = sum(r["spec_accepted"] for r in spec)
    drafted = sum((r["spec_block_size"] - 1) * r["spec_rounds"] for r in spec)
    width = max((len(r["spec_histogram"]) for r in spec), default=0)
    hist = [sum(r["spec_histogram"][n] for r in spec if n < len(r["spec_histogram"])) for n in range(width)]
    return {
        "acc_len": 1 + accepted / rounds if rounds else None,
        "proposal_acceptance": accepted / drafted if drafted else None,
        "prompts": len({r["row_id"] for r in rows}),
        "requests": len(ok),
        "errors": len(rows) - len(ok),
        "truncated": sum(r["finish_reason"] == "length" for r in ok),
        "mean_out_tokens": sum(r["completion_tokens"] for r in ok) / len(ok) if ok else None,
        "rounds": rounds,
        "accepted": accepted,
        "histogram": hist,  # rounds with n = 0..B-1 accepted drafts
        "alpha": [sum(hist[k:]) / rounds for k in range(1, width)] if rounds else [],
        "right": sum(is_right(r["response"], r[answer], match) for r in ok) if answer else None,
        "scored": sum(r[answer] is not None for r in rows) if answer else None,
    }


def build_report(out_dir: Path, group_by: str | None = None, answer: str | None = None,
                 match: str = "last-number") -> dict:
    rows, group_by = read_rows(out_dir, group_by, answer)
    groups: dict[str, list[dict]] = {}
    buckets: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r[group_by]) if group_by else "all", []).append(r)
        buckets.setdefault(r["bucket"] or "-", []).append(r)
    return {"group_by": group_by, "answer": answer, "match": match, "overall": summarize(rows, answer, match),
            "groups": {k: summarize(v, answer, match) for k, v in sorted(groups.items())},
            "buckets": {k: summarize(v, answer, match) for k, v in sorted(buckets.items(),
                                                                          key=lambda kv: _edge(kv[0]))}}


def _edge(bucket: str) -> int:
    try:
        return int(bucket.split("-")[-1])
    except ValueError:
        return 1 << 62


def _fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _table(title: str, rows: dict[str, dict]) -> list[str]:
    scored = any(s["right"] is not None for s in rows.values())
    lines = [f"| {title} | acc_len | proposal acceptance | prompts | requests | truncated | mean out tok |"
             + (" right |" if scored else ""), "|---|---|---|---|---|---|---|" + ("---|" if scored else "")]
    for name, s in rows.items():
        lines.append(f"| {name} | {_fmt(s['acc_len'])} | {_fmt(s['proposal_acceptance'], 3)} | {s['prompts']} | "
                     f"{s['requests']} | {s['truncated']} | {_fmt(s['mean_out_tokens'], 1)} |"
                     + (f" {s['right']}/{s['scored']} |" if scored else ""))
    return lines


def to_markdown(report: dict) -> str:
    overall = report["overall"]
    lines = ["## Acceptance", "", *_table(report["group_by"] or "benchmark",
                                           {**report["groups"], "all": overall} if len(report["groups"]) > 1
                                           else report["groups"]),
             "", "## By length bucket", "", *_table("bucket", report["buckets"]), ""]
    if overall["rounds"]:
        width = len(overall["histogram"])
        lines += ["## Per-position acceptance (pooled)", "",
                  "| " + " | ".join(f"α_{k}" for k in range(1, width)) + " |",
                  "|" + "---|" * (width - 1),
                  "| " + " | ".join(f"{a:.3f}" for a in overall["alpha"]) + " |", "",
                  "## Accepted drafts per round", "",
                  "| " + " | ".join(str(n) for n in range(width)) + " |", "|" + "---|" * width,
                  "| " + " | ".join(str(c) for c in overall["histogram"]) + " |", "",
                  f"acc_len = 1 + {overall['accepted']} accepted / {overall['rounds']} rounds"]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Per-position acceptance and the accepted-length histogram as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overall = report["overall"]
    alpha, hist = overall["alpha"], overall["histogram"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.bar(range(1, len(alpha) + 1), alpha, color="#4c72b0")
    left.set(title="per-position acceptance α_k", xlabel="draft position k", ylabel="P(≥ k accepted)",
             ylim=(0, 1))
    total = sum(hist) or 1
    right.bar([n + 1 for n in range(len(hist))], [c / total for c in hist], color="#dd8452")
    right.set(title=f"tokens per round (acc_len {_fmt(overall['acc_len'])})", xlabel="accepted drafts + 1",
              ylabel="share of rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
