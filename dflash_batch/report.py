"""The model card's tables from an output directory (all shards): acceptance per group and per
length bucket, per-position acceptance and the accepted-length histogram.

Every ratio is pooled as a ratio of sums over rows: acc_len = 1 + sum(accepted) / sum(rounds),
proposal acceptance = sum(accepted) / sum(drafts verified), alpha_k = #(rounds with >= k accepted)
/ #(rounds that verified >= k drafts): a draft schedule (speculation: auto, or drafts: k) verifies
fewer than B-1 drafts a round, and a position no round tried has no alpha. A per-row mean of
acc_len would weight short answers like long ones. Parts written before rows recorded the drafts
verified (output schema v1) count every round as verifying the whole block, and the report says so.

With an expected-answer column the tables also score the responses: `exact` (the stripped
response is the answer), `contains` (the answer appears in it) or `last-number` (its last number
equals the answer's, as GSM8K-style graders read a final answer). Rows made by `make-needle`
(a `needle_answer` column) are scored by it (`contains`), and a long-context table puts
retrieval beside acceptance per bucket.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_batch.io.ledger import array_spec, list_sums, part_files, read_part, speculation
from dflash_batch.models.layers.expert_parallel import default_placement, imbalance, place
from dflash_batch.plan.experts import routed_counts

COLUMNS = ["row_id", "sample_index", "status", "finish_reason", "prompt_tokens", "completion_tokens", "bucket",
           "spec_block_size", "spec_rounds", "spec_accepted", "spec_drafts_verified", "spec_histogram",
           "spec_verified_histogram"]
HISTOGRAMS = ("spec_histogram", "spec_verified_histogram")  # rounds by drafts accepted, by drafts verified
NEEDLE = "needle_answer"  # make-needle's expected values: report scores retrieval by them


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


class _Totals:
    """One table line's sums, added part by part."""

    COUNTS = ("prompts", "requests", "errors", "truncated", "in_tokens", "tokens", "rounds", "accepted", "drafted",
              "speculated", "right", "scored")

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.COUNTS, 0)
        self.histograms = [np.zeros(0, dtype=np.int64) for _ in HISTOGRAMS]

    def add(self, sums: dict, histograms: list[np.ndarray]) -> None:
        for k in self.COUNTS:
            self.sums[k] += int(sums.get(k) or 0)
        for i, h in enumerate(histograms):
            total = self.histograms[i]
            if len(h) > len(total):
                total = self.histograms[i] = np.pad(total, (0, len(h) - len(total)))
            total[:len(h)] += h

    def summary(self, answer: str | None) -> dict:
        s, hist, verified = self.sums, *(h.tolist() for h in self.histograms)
        rounds = s["rounds"]
        trials = [sum(verified[k:]) for k in range(1, len(hist))]  # rounds that verified draft k
        return {
            "acc_len": 1 + s["accepted"] / rounds if rounds else None,
            "proposal_acceptance": s["accepted"] / s["drafted"] if s["drafted"] else None,
            "prompts": s["prompts"], "requests": s["requests"], "errors": s["errors"], "truncated": s["truncated"],
            "mean_in_tokens": s["in_tokens"] / s["prompts"] if s["prompts"] else None,
            "mean_out_tokens": s["tokens"] / s["requests"] if s["requests"] else None,
            "rounds": rounds, "accepted": s["accepted"],
            "speculation": speculation(s["speculated"], s["requests"]),  # on | off | on for k/n (auto)
            "histogram": hist,  # rounds with n = 0..B-1 accepted drafts
            "verified_histogram": verified,  # rounds that verified n = 0..B-1 drafts
            "alpha": [sum(hist[k:]) / n if n else None for k, n in enumerate(trials, 1)] if rounds else [],
            "trials": trials if rounds else [],
            "right": s["right"] if answer else None, "scored": s["scored"] if answer else None,
        }


def _part_sums(t: pa.Table, answer: str | None, match: str) -> pa.Table:
    """Per row of a part, the numbers a table line sums (Arrow compute: no Python row objects)."""
    ok = pc.equal(t["status"], "ok")
    spec = pc.and_(ok, pc.fill_null(pc.greater(t["spec_rounds"], 0), False))

    def where(mask, col) -> pa.Array:
        return pc.if_else(mask, pc.fill_null(col, 0), 0).cast(pa.int64())

    rounds = where(spec, t["spec_rounds"])
    first = pc.equal(t["sample_index"], 0)
    cols = {
        "prompts": first.cast(pa.int64()), "requests": ok.cast(pa.int64()),
        "in_tokens": where(first, t["prompt_tokens"]),
        "errors": pc.invert(ok).cast(pa.int64()),
        "truncated": pc.and_(ok, pc.equal(t["finish_reason"], "length")).cast(pa.int64()),
        "tokens": where(ok, t["completion_tokens"]), "rounds": rounds, "accepted": where(spec, t["spec_accepted"]),
        "drafted": where(spec, t["spec_drafts_verified"]),
        "speculated": pc.and_(ok, pc.is_valid(t["spec_block_size"])).cast(pa.int64())}
    if answer:  # scoring reads the text: Python, but one part at a time
        oks = ok.to_pylist()
        cols["right"] = pa.array([int(bool(o) and is_right(r, a, match)) for o, r, a in
                                  zip(oks, t["response"].to_pylist(), t[answer].to_pylist())], pa.int64())
        # an error row has no response to score: the rate is over the rows that answered
        cols["scored"] = pc.and_(ok, pc.is_valid(t[answer])).cast(pa.int64())
    return pa.table(cols)


def build_report(out_dir: Path, group_by: str | None = None, answer: str | None = None,
                 match: str = "last-number") -> dict:
    """The tables, summed part by part with Arrow: memory does not grow with the number of rows
    (`prompts` counts each row_id's sample 0). A finished run without rows (its inputs held none)
    has empty tables, as `status` calls it complete; an unfinished one without rows is refused."""
    files = part_files(out_dir)
    if not files:
        _refuse_unless_finished(out_dir)
    names = pq.read_schema(files[0]).names if files else []
    if group_by is None and "dataset" in names:
        group_by = "dataset"
    if answer is None and NEEDLE in names:  # make-needle prompts: retrieval is their answer
        answer, match = NEEDLE, "contains"
    for col, what in ((group_by, "group by"), (answer, "score against")):
        if col is not None and files and col not in names:
            raise KeyError(f"{out_dir}: no column {col!r} to {what} in the output (columns: {names})")
    cols = list(dict.fromkeys(COLUMNS + ([group_by] if group_by else []) + (["response", answer] if answer else [])))
    totals: dict[str, dict[str, _Totals]] = {"overall": {}, "groups": {}, "buckets": {}}
    assumed = False  # some part predates the record of drafts verified
    for f in files:
        t, legacy = read_part(f, cols)
        assumed |= legacy
        sums = _part_sums(t, answer, match)
        spec = pc.and_(pc.equal(t["status"], "ok"), pc.fill_null(pc.greater(t["spec_rounds"], 0), False))
        labels = {"overall": pa.array(["all"] * t.num_rows, pa.string()),
                  "groups": pc.cast(t[group_by], pa.string()) if group_by else pa.array(["all"] * t.num_rows),
                  "buckets": pc.fill_null(t["bucket"], "-")}
        for table, label in labels.items():
            label = pc.fill_null(label.combine_chunks() if isinstance(label, pa.ChunkedArray) else label, "None")
            encoded = pc.dictionary_encode(label)
            keys = encoded.indices.to_numpy()
            grouped = sums.append_column("key", encoded.indices).group_by("key").aggregate(
                [(c, "sum") for c in sums.column_names])
            # speculative rows' histograms only (a null code for the others adds nothing)
            hists = [list_sums(pc.if_else(spec, t[h], pa.scalar(None, t[h].type)), keys, len(encoded.dictionary))
                     for h in HISTOGRAMS]
            for row in grouped.to_pylist():
                name = encoded.dictionary[row["key"]].as_py()
                totals[table].setdefault(name, _Totals()).add(
                    {c: row[f"{c}_sum"] for c in sums.column_names}, [h[row["key"]] for h in hists])
    turns = _turns(files) if "turn_completion_tokens" in names else {}
    groups = {k: v.summary(answer) for k, v in sorted(totals["groups"].items())}
    buckets = {k: v.summary(answer) for k, v in sorted(totals["buckets"].items(), key=lambda kv: _edge(kv[0]))}
    return {"group_by": group_by, "answer": answer, "match": match,
            "overall": totals["overall"].get("all", _Totals()).summary(answer), "groups": groups,
            "buckets": buckets, "schedule": _schedules(out_dir), "whole_block_assumed": assumed, "turns": turns,
            "experts": _experts(out_dir)}


def _experts(out_dir: Path) -> dict | None:
    """A MoE target's routing on several expert ranks, every shard's counts summed: per layer the
    hottest rank's load over the mean on them, by default and as `experts place` would place them, and
    the forwards each shard's group served for the others with no rows of its own."""
    records = [orjson.loads(p.read_bytes()) for p in sorted((out_dir / "stats").glob("shard-*.json"))]
    records = [r for r in records if (r.get("experts") or {}).get("routed_tokens")]
    if not records:
        return None
    ranks, redundant = records[0]["experts"]["ranks"], records[0]["experts"].get("redundant", 0)
    if ranks == 1:  # one rank holds every expert: no load to balance
        return None
    layers = {}
    for layer, counts in routed_counts(out_dir).items():
        if len(counts) % ranks == 0:
            default = default_placement(len(counts), ranks, redundant)
            layers[str(layer)] = {"routed": sum(counts), "default": imbalance(counts, default),
                                  "placed": imbalance(counts, place(counts, ranks, redundant))}
    return {"ranks": ranks, "layers": layers,
            "idle_forwards": {str(r["shard"]): r["experts"].get("idle_forwards", 0) for r in records}}


TURNS = ("turn_prompt_tokens", "turn_completion_tokens", "turn_spec_rounds", "turn_spec_accepted")


def _turns(files: list[Path]) -> dict[int, dict]:
    """Conversations' sums per assistant turn (1 = the first), over their ok rows: how many
    reached it, the prompt tokens the target ran for it, the tokens it generated, its pooled
    acc_len; and the tool calls and errors of all turns."""
    sums: dict[int, list[int]] = {}
    tools = [0, 0]
    for f in files:
        t = pq.read_table(f, columns=["status", *TURNS, "tool_calls", "tool_errors"])
        t = t.filter(pc.equal(t["status"], "ok"))
        for row in t.to_pylist():
            for i, values in enumerate(zip(*(row[c] for c in TURNS)), start=1):
                line = sums.setdefault(i, [0, 0, 0, 0, 0])
                line[0] += 1
                for j, v in enumerate(values, start=1):
                    line[j] += v or 0
            tools[0] += row["tool_calls"] or 0
            tools[1] += row["tool_errors"] or 0
    return {i: {"conversations": n, "mean_prompt_tokens": prompt / n, "mean_out_tokens": out / n,
                "acc_len": 1 + accepted / rounds if rounds else None, "tool_calls": tools[0], "tool_errors": tools[1]}
            for i, (n, prompt, out, rounds, accepted) in sorted(sums.items())}


def _refuse_unless_finished(out_dir: Path) -> None:
    """A run with no committed part: refused unless every shard is complete as `status` calls it
    (then the run has no rows)."""
    from dflash_batch.plan.expected import settled_states  # reads the inputs: only for a run without parts

    run_file = out_dir / "run.json"
    if not run_file.exists():
        raise FileNotFoundError(f"{out_dir}: no run.json; not a dflash-batch output directory")
    run = orjson.loads(run_file.read_bytes())
    states, _, _ = settled_states(out_dir, run, [0] * run["num_shards"])
    todo = [i for i, state in enumerate(states) if state != "complete"]
    if todo:
        raise FileNotFoundError(f"{out_dir}: no committed part files yet, and shard(s) {array_spec(todo)} of "
                                f"{run['num_shards']} not complete (`dflash-batch status {out_dir}` says how to "
                                "finish them)")


def _schedules(out_dir: Path) -> dict[str, dict]:
    """Each shard's speculation schedule by bucket, as its stats keep it ("bucket, shard i")."""
    out = {}
    for path in sorted((out_dir / "stats").glob("shard-*.json")):
        record = orjson.loads(path.read_bytes())
        for bucket, schedule in (record.get("schedule") or {}).items():
            out[f"{bucket}, shard {record['shard']}"] = schedule
    return out


def _schedule_lines(name: str, s: dict) -> list[str]:
    """One bucket's schedule: acceptance by position, by batch size the cost of a round at each
    k and the rounds run at it, and how many drafts its sequence-rounds verified."""
    block = s["block_size"]
    lines = [f"### {name} ({s['mode']})", "",
             "| | " + " | ".join(f"k={k}" for k in range(block)) + " |", "|---|" + "---|" * block,
             "| P(draft k accepted \\| k-1 were) | – | "
             + " | ".join(_fmt(a, 3) for a in s["acceptance_by_position"]) + " |",
             "| expected tokens a round | " + " | ".join(_fmt(e) for e in s["expected_tokens"]) + " |"]
    for size in sorted(set(s["cost_ms"]) | set(s["rounds_by_k"]), key=int):
        costs = s["cost_ms"].get(size)
        if costs:
            lines.append(f"| batch {size}: ms a round | " + " | ".join(_fmt(c) for c in costs) + " |")
        rounds = s["rounds_by_k"].get(size, {})
        lines.append(f"| batch {size}: rounds run | " + " | ".join(str(rounds.get(str(k), 0)) for k in range(block))
                     + " |")
    # Drafts each sequence-round verified: one k a round (exploring, pinned, per_row off) and per
    # row (engine/row_drafts.py), with the drafts verified per draft kept of each.
    for mode, counts in (s.get("drafts_verified") or {}).items():
        if counts:
            lines.append(f"| sequence-rounds that verified k ({mode}; {_fmt(s['verified_per_kept'][mode])} "
                         "verified per kept) | " + " | ".join(str(counts.get(str(k), 0)) for k in range(block))
                         + " |")
    return lines + [""]


def _edge(bucket: str) -> int:
    try:
        return int(bucket.split("-")[-1])
    except ValueError:
        return 1 << 62


def _fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _table(title: str, rows: dict[str, dict], speculation: bool = False) -> list[str]:
    """`speculation`: a column saying whether each line's requests ran with the drafter."""
    scored = any(s["right"] is not None for s in rows.values())
    lines = [f"| {title} | acc_len | proposal acceptance | prompts | requests | truncated | mean out tok |"
             + (" speculation |" if speculation else "") + (" right |" if scored else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if speculation else "") + ("---|" if scored else "")]
    for name, s in rows.items():
        lines.append(f"| {name} | {_fmt(s['acc_len'])} | {_fmt(s['proposal_acceptance'], 3)} | {s['prompts']} | "
                     f"{s['requests']} | {s['truncated']} | {_fmt(s['mean_out_tokens'], 1)} |"
                     + (f" {s['speculation']} |" if speculation else "")
                     + (f" {s['right']}/{s['scored']} |" if scored else ""))
    return lines


def to_markdown(report: dict) -> str:
    overall = report["overall"]
    if not overall["requests"] and not overall["errors"]:  # no row (a retry's may hold no sample 0)
        return "No rows: every shard of the run finished, and its inputs held no rows."
    lines = ["## Acceptance", "", *_table(report["group_by"] or "benchmark",
                                           {**report["groups"], "all": overall} if len(report["groups"]) > 1
                                           else report["groups"]),
             "", "## By length bucket", "", *_table("bucket", report["buckets"], speculation=True), ""]
    if report["answer"] == NEEDLE:  # the card's long-context table: acceptance beside retrieval
        lines += ["## Long context", "",
                  "| bucket | input tokens | acc_len | proposal acceptance | retrieval | speculation |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {name} | {_fmt(s['mean_in_tokens'], 0)} | {_fmt(s['acc_len'])} | "
                  f"{_fmt(s['proposal_acceptance'], 3)} | {s['right']}/{s['scored']} | {s['speculation']} |"
                  for name, s in report["buckets"].items()]
        lines.append("")
    if report.get("turns"):
        first = next(iter(report["turns"].values()))
        lines += ["## Conversations, by turn", "",
                  f"{first['tool_calls']} tool calls, {first['tool_errors']} of them failed; prompt tokens: "
                  "those the target ran for the turn (later turns: their own only, the rest kept from earlier turns)",
                  "", "| turn | conversations | mean prompt tokens | mean out tok | acc_len |", "|---|---|---|---|---|"]
        lines += [f"| {i} | {t['conversations']} | {_fmt(t['mean_prompt_tokens'], 1)} | "
                  f"{_fmt(t['mean_out_tokens'], 1)} | {_fmt(t['acc_len'])} |" for i, t in report["turns"].items()]
        lines.append("")
    if report.get("experts"):
        e = report["experts"]
        lines += ["## Routed experts", "", f"The hottest of {e['ranks']} expert ranks' load over the mean, by layer: "
                  "with the default placement, and placed from these counts (`dflash-batch experts place`). "
                  "Forwards served for other data-parallel groups with no rows of the shard's own: " +
                  ", ".join(f"shard {s} {n}" for s, n in e["idle_forwards"].items()) + ".", "",
                  "| layer | routed tokens | hottest/mean default | hottest/mean placed |", "|---|---|---|---|"]
        lines += [f"| {layer} | {x['routed']} | {_fmt(x['default'], 3)} | {_fmt(x['placed'], 3)} |"
                  for layer, x in e["layers"].items()]
        lines.append("")
    if report.get("schedule"):
        lines += ["## Speculation schedule (drafts verified a round, k)", ""]
        for name, s in report["schedule"].items():
            lines += _schedule_lines(name, s)
    if overall["rounds"]:
        width = len(overall["histogram"])
        lines += ["## Per-position acceptance (pooled)", "",
                  "α_k = rounds that accepted at least k drafts / rounds that verified draft k (trials)", "",
                  "| | " + " | ".join(f"α_{k}" for k in range(1, width)) + " |",
                  "|---|" + "---|" * (width - 1),
                  "| α | " + " | ".join(_fmt(a, 3) for a in overall["alpha"]) + " |",
                  "| trials | " + " | ".join(str(n) for n in overall["trials"]) + " |", "",
                  "## Accepted drafts per round", "",
                  "| " + " | ".join(str(n) for n in range(width)) + " |", "|" + "---|" * width,
                  "| " + " | ".join(str(c) for c in overall["histogram"]) + " |", "",
                  f"acc_len = 1 + {overall['accepted']} accepted / {overall['rounds']} rounds"]
    if report.get("whole_block_assumed"):
        lines += ["", "Note: some rows were written before outputs recorded the drafts each round verified "
                      "(output schema v1): their proposal acceptance and α assume every round verified the "
                      "whole block, which understates them where a draft schedule verified fewer."]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Per-position acceptance and the accepted-length histogram as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overall = report["overall"]
    alpha, hist = overall["alpha"], overall["histogram"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.bar(range(1, len(alpha) + 1), [np.nan if a is None else a for a in alpha], color="#4c72b0")
    left.set(title="per-position acceptance α_k", xlabel="draft position k", ylabel="P(≥ k accepted | k tried)",
             ylim=(0, 1))
    total = sum(hist) or 1
    right.bar([n + 1 for n in range(len(hist))], [c / total for c in hist], color="#dd8452")
    right.set(title=f"tokens per round (acc_len {_fmt(overall['acc_len'])})", xlabel="accepted drafts + 1",
              ylabel="share of rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
