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

from dflash_batch.tokenizer import Tokenizer

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = ("What is the special magic number for {key} mentioned in the provided text? "
            "Answer with the number only.")
TEMPLATE = 32  # tokens a chat template may add around the user's message


def make_needles(texts: list[str], tokenizer: Tokenizer, lengths: list[int], count: int, keys: int,
                 seed: int = 0) -> Iterator[dict]:
    """`count` rows per length: {id, messages, needle_answer, needle_length, needle_depths}; a
    row's message and a chat template's additions fit in `length` tokens."""
    corpus = tokenizer.encode_batch(["\n\n".join(t.strip() for t in texts if t.strip())], False)[0]
    if len(corpus) < 16:
        raise ValueError("the haystack text has fewer than 16 tokens: give more text")

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode_batch([text], False)[0])

    for length in lengths:
        for i in range(count):
            rng = random.Random(f"{seed}:{length}:{i}")
            names = ["".join(rng.choices(string.ascii_lowercase, k=8)) for _ in range(keys)]
            values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(keys)]
            needles = [NEEDLE.format(key=k, value=v) for k, v in zip(names, values)]
            asked = rng.randrange(keys)
            question = QUESTION.format(key=names[asked])
            start, depths = rng.randrange(len(corpus)), sorted(rng.random() for _ in range(keys))
            order = list(range(keys))
            rng.shuffle(order)  # which needle sits at which depth
            room = length - TEMPLATE - count_tokens(question) - sum(map(count_tokens, needles))
            for _ in range(10):  # text decoded in pieces tokenises a little differently: shrink to fit
                if room < 16:
                    raise ValueError(f"length {length} leaves no room for a haystack around {keys} needles")
                hay = [corpus[(start + j) % len(corpus)] for j in range(room)]  # the text, repeated as needed
                cuts = [0, *(int(d * room) for d in depths), room]
                pieces = [tokenizer.decode(hay[a:b]) for a, b in zip(cuts, cuts[1:])]
                context = pieces[0] + "".join(f" {needles[k]} {piece}" for k, piece in zip(order, pieces[1:]))
                content = f"{context}\n\n{question}"
                over = count_tokens(content) + TEMPLATE - length
                if over <= 0:
                    break
                room -= over
            yield {"id": f"needle-{length}-{i:04d}", "messages": [{"role": "user", "content": content}],
                   "needle_answer": values[asked], "needle_length": length,
                   "needle_depths": [round(depths[order.index(k)], 4) for k in range(keys)]}
