"""`dflash-batch make-needle`: RULER-style multi-key needle-in-a-haystack prompts at chosen lengths.

A prompt is a haystack cut from the user's own text to about `length` tokens of the model's
tokenizer, with `keys` needles ("One of the special magic numbers for KEY is: VALUE.") placed at
random depths, and a question about one of the keys. The row keeps the expected value in
`needle_answer`: `report` then prints retrieval beside acceptance per length bucket, so that a
drafter's acceptance at long context is read beside whether the target still reads its context.
Everything is drawn from `seed`: the same arguments write the same file.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator

from dflash_batch.plan.tokenize import Tokenizer

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = ("What is the special magic number for {key} mentioned in the provided text? "
            "Answer with the number only.")
MARGIN = 64  # tokens left for the question and the chat template around the haystack


def make_needles(texts: list[str], tokenizer: Tokenizer, lengths: list[int], count: int, keys: int,
                 seed: int = 0) -> Iterator[dict]:
    """`count` rows per length: {id, messages, needle_answer, needle_length, needle_depths}."""
    corpus = tokenizer.encode_batch(["\n\n".join(t.strip() for t in texts if t.strip())], False)[0]
    if len(corpus) < 16:
        raise ValueError("the haystack text has fewer than 16 tokens: give more text")
    for length in lengths:
        if length <= MARGIN + 16 * keys:
            raise ValueError(f"length {length} leaves no room for a haystack around {keys} needles")
        for i in range(count):
            rng = random.Random(f"{seed}:{length}:{i}")
            names = [''.join(rng.choices(string.ascii_lowercase, k=8)) for _ in range(keys)]
            values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(keys)]
            needles = [NEEDLE.format(key=k, value=v) for k, v in zip(names, values)]
            room = length - MARGIN - sum(len(ids) for ids in tokenizer.encode_batch(needles, False))
            start = rng.randrange(len(corpus))
            hay = [corpus[(start + j) % len(corpus)] for j in range(room)]  # the text, repeated as needed
            depths = sorted(rng.random() for _ in range(keys))
            cuts = [0, *(int(d * room) for d in depths), room]
            pieces = [tokenizer.decode(hay[a:b]) for a, b in zip(cuts, cuts[1:])]
            order = list(range(keys))
            rng.shuffle(order)  # which needle sits at which depth
            context = pieces[0] + "".join(f" {needles[k]} {piece}" for k, piece in zip(order, pieces[1:]))
            asked = rng.randrange(keys)
            yield {"id": f"needle-{length}-{i:04d}",
                   "messages": [{"role": "user", "content": f"{context}\n\n{QUESTION.format(key=names[asked])}"}],
                   "needle_answer": values[asked], "needle_length": length,
                   "needle_depths": [round(depths[order.index(k)], 4) for k in range(keys)]}
