"""Seeded synthetic training text: arithmetic word problems with worked answers.

Everything comes from this machine and a seed, so the demo pair is reproducible without any
download. Each problem picks a template, names, an item and numbers; its worked answer is
fully determined by the question (the answer template is tied to the question template), so a
trained target answers the same way every time and its greedy output is predictable: the text
a speculative drafter can learn to anticipate. Optional Python standard-library snippets add
some less regular text.

Samples are chats rendered with the tokenizer's template (user question -> assistant worked
answer); a fraction are plain "Q: ... A: ..." text. The assistant part (answer + end token) is
what the drafter is trained on and what the demo job asks the pair to generate.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

NAMES = ["Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Zoe", "Jack", "Nora",
         "Omar", "Iris", "Paul", "Ruby", "Hugo", "Lena", "Ivan", "Maya", "Theo", "Ella", "Noah",
         "Ava", "Luca", "Sara", "Eli", "Chloe", "Finn", "Alice"]
ITEMS = ["apples", "pencils", "books", "marbles", "cookies", "stickers", "coins", "cards",
         "shells", "balloons", "stamps", "candies", "toys", "flowers", "eggs", "buttons"]
CONTAINERS = ["boxes", "bags", "baskets", "jars", "packs", "rows"]
SYSTEM_PROMPTS = ["You are a helpful math tutor.", "Answer the question step by step.",
                  "Show your work and give the final answer."]
END = "<|im_end|>"   # the end of an assistant turn: the eos the models learn to emit
PLAIN_END = "<|eos|>"  # the end of a plain text sample


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # the worked answer, ending with "The answer is N."


def _add(r: random.Random, name: str, item: str) -> list[tuple[str, str]]:
    a, b = r.randint(2, 40), r.randint(2, 40)
    c = a + b
    return [
        (f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
         f"{name} starts with {a} {item} and buys {b} more, so we add: {a} + {b} = {c}. "
         f"{name} has {c} {item} now. The answer is {c}."),
        (f"There are {a} {item} in a basket. {name} puts in {b} more {item}. How many {item} are in the basket?",
         f"The basket had {a} {item}. Adding {b} more gives {a} + {b} = {c}. The answer is {c}."),
        (f"{name} found {a} {item} on Monday and {b} {item} on Tuesday. How many {item} did {name} find in total?",
         f"On Monday {name} found {a} and on Tuesday {b}. In total: {a} + {b} = {c}. The answer is {c}."),
    ]


def _sub(r: random.Random, name: str, item: str, other: str) -> list[tuple[str, str]]:
    a = r.randint(10, 60)
    b = r.randint(1, a - 1)
    c = a - b
    return [
        (f"{name} has {a} {item} and gives {b} of them to {other}. How many {item} does {name} have left?",
         f"{name} starts with {a} {item} and gives away {b}, so we subtract: {a} - {b} = {c}. "
         f"{name} has {c} {item} left. The answer is {c}."),
        (f"A shop had {a} {item}. It sold {b} {item} today. How many {item} are left in the shop?",
         f"The shop had {a} {item} and sold {b}. Left: {a} - {b} = {c}. The answer is {c}."),
        (f"{name} needs {a} {item} and already has {b}. How many more {item} does {name} need?",
         f"{name} needs {a} and has {b}. The difference is {a} - {b} = {c}. The answer is {c}."),
    ]


def _mul(r: random.Random, name: str, item: str) -> list[tuple[str, str]]:
    a, b = r.randint(2, 9), r.randint(2, 12)
    c = a * b
    box = r.choice(CONTAINERS)
    return [
        (f"{name} has {a} {box} with {b} {item} in each. How many {item} does {name} have?",
         f"There are {a} {box} and each holds {b} {item}, so we multiply: {a} x {b} = {c}. "
         f"{name} has {c} {item}. The answer is {c}."),
        (f"Each of {a} friends brings {b} {item} to {name}'s party. How many {item} are there?",
         f"{a} friends bring {b} {item} each. In total: {a} x {b} = {c}. The answer is {c}."),
    ]


def _div(r: random.Random, name: str, item: str) -> list[tuple[str, str]]:
    a, b = r.randint(2, 9), r.randint(2, 12)
    c = a * b
    return [
        (f"{name} shares {c} {item} equally among {a} friends. How many {item} does each friend get?",
         f"{name} has {c} {item} for {a} friends, so we divide: {c} / {a} = {b}. "
         f"Each friend gets {b} {item}. The answer is {b}."),
        (f"{c} {item} are packed into bags of {a}. How many bags are there?",
         f"Each bag holds {a} {item}. The number of bags is {c} / {a} = {b}. The answer is {b}."),
    ]


def _two_step(r: random.Random, name: str, item: str, other: str) -> list[tuple[str, str]]:
    a, b = r.randint(5, 40), r.randint(2, 30)
    s = a + b
    c = r.randint(1, s - 1)
    d = s - c
    return [
        (f"{name} has {a} {item}, buys {b} more, and then gives {c} to {other}. How many {item} does {name} have?",
         f"First, {name} buys {b} more: {a} + {b} = {s}. Then {name} gives {c} to {other}: "
         f"{s} - {c} = {d}. {name} has {d} {item}. The answer is {d}."),
    ]


def problem(r: random.Random) -> Problem:
    """One random word problem with its worked answer."""
    name, other = r.sample(NAMES, 2)
    item = r.choice(ITEMS)
    kind = r.choice(("add", "sub", "mul", "div", "two"))
    options = {"add": lambda: _add(r, name, item), "sub": lambda: _sub(r, name, item, other),
               "mul": lambda: _mul(r, name, item), "div": lambda: _div(r, name, item),
               "two": lambda: _two_step(r, name, item, other)}[kind]()
    return Problem(*r.choice(options))


def chat_messages(p: Problem, r: random.Random, system_rate: float = 0.25) -> list[dict]:
    """A chat for one problem; a quarter of them start with a system prompt."""
    messages = [{"role": "system", "content": r.choice(SYSTEM_PROMPTS)}] if r.random() < system_rate else []
    return messages + [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}]


def stdlib_snippets(r: random.Random, count: int, lines: int = 8) -> list[str]:
    """`count` runs of `lines` non-empty source lines from the standard library's .py files."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out = []
    while len(out) < count:
        text = [ln for ln in r.choice(files).read_text(errors="ignore").splitlines() if ln.strip()]
        if len(text) > lines:
            start = r.randrange(len(text) - lines)
            out.append("\n".join(text[start:start + lines]) + "\n")
    return out


@dataclass(frozen=True)
class Sample:
    """Training text split where the loss of the drafter starts: prompt + response."""

    prompt: str    # rendered chat up to the assistant header (or "Q: ... A:")
    response: str  # the answer with its end token ("" for code snippets: not a chat turn)


def samples(seed: int, count: int, render, plain_rate: float = 0.1, code_rate: float = 0.0) -> list[Sample]:
    """`count` seeded samples. `render(messages) -> str` renders a chat up to and including the
    assistant header (the tokenizer's template with add_generation_prompt)."""
    r = random.Random(seed)
    out = []
    for _ in range(count):
        u = r.random()
        if u < code_rate:
            out.append(Sample("<|bos|>" + stdlib_snippets(r, 1)[0] + PLAIN_END, ""))
        elif u < code_rate + plain_rate:
            p = problem(r)
            out.append(Sample(f"<|bos|>Q: {p.question}\nA:", f" {p.answer}{PLAIN_END}"))
        else:
            msgs = chat_messages(problem(r), r)
            out.append(Sample(render(msgs[:-1]), msgs[-1]["content"] + END))
    return out


def eval_problems(seed: int, count: int) -> list[Problem]:
    """Held-out problems for the acceptance measurement and the demo job (use a seed the
    training streams do not: they derive theirs as seed * 1_000_003 + step)."""
    r = random.Random(seed)
    return [problem(r) for _ in range(count)]


def final_answer(text: str) -> str | None:
    """N from "... The answer is N." (None if the text has no such sentence)."""
    head, sep, tail = text.rpartition("The answer is ")
    return tail.split(".")[0].strip() if sep else None
