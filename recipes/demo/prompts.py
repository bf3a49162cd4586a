"""The demo job's prompts: held-out word problems in three groups, plus a few long few-shot
prompts so the job uses two length buckets.

    python -m recipes.demo.prompts --out jobs/demo/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from recipes.demo import data

SEED = 2 * 10 ** 9  # away from the training streams and from evaluate's held-out seed


def group(p: data.Problem) -> str:
    """Which kind of problem: the worked answer shows the operations it used."""
    if p.answer.count(" = ") > 1 or "First," in p.answer:
        return "two-step"
    return "mul-div" if (" x " in p.answer or " / " in p.answer) else "add-sub"


def rows(count: int, long_count: int) -> list[dict]:
    r = random.Random(SEED)
    out = []
    for i, p in enumerate(data.eval_problems(SEED, count)):
        out.append({"id": f"q{i:03d}", "dataset": group(p), "answer": data.final_answer(p.answer),
                    "messages": [{"role": "user", "content": p.question}]})
    for i in range(long_count):
        shots = data.eval_problems(SEED + 1 + i, 7)
        examples = "\n\n".join(f"Question: {s.question}\nAnswer: {s.answer}" for s in shots[:-1])
        q = shots[-1]
        system = r.choice(data.SYSTEM_PROMPTS)
        out.append({"id": f"long{i:02d}", "dataset": "few-shot", "answer": data.final_answer(q.answer),
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"Worked examples:\n\n{examples}\n\n"
                                                             f"Now this one: {q.question}"}]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("jobs/demo/prompts.jsonl"))
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--long", type=int, default=8)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows(args.count, args.long)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
