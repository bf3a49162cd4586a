"""A deterministic stand-in for the engine, for the data-path tests and benchmark.

Each request's output depends only on its own prompt and seed (never on batch composition),
like the real engine's, so resumed and uninterrupted runs must produce identical rows.
Completions come back out of input order within each batch, as continuous batching does.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from dflash_batch.engine.request import Completion, Request, SpecCounters
from dflash_batch.plan.buckets import Bucket


class FakeEngine:
    def __init__(self, tokenizer, vocab_size: int = 300, delay_s: float = 0.0, block_size: int = 8,
                 max_tokens: int | None = None, log: str | None = None):
        self.tok, self.vocab, self.delay, self.block = tokenizer, vocab_size, delay_s, block_size
        self.log = log  # a file: each row the runner took, one "row_id sample_index" line
        self.vocab_size = None  # accepts any prompt id
        self.max_tokens = max_tokens

    def _complete(self, req: Request) -> Completion:
        p = req.params
        # a cheap deterministic walk over the vocabulary (an LCG seeded by the request)
        state = (p.seed ^ hash(tuple(req.prompt_ids))) & 0xFFFFFFFF
        limit = p.max_new_tokens if self.max_tokens is None else min(p.max_new_tokens, self.max_tokens)
        tokens, finish, reason = [], "length", None
        for _ in range(limit):
            state = (state * 1103515245 + 12345) & 0x7FFFFFFF
            t = 10 + state % (self.vocab - 10)
            tokens.append(t)
            if t in p.stop_token_ids:
                finish, reason = "stop", str(t)
                break
        text = self.tok.decode(tokens[:-1] if finish == "stop" else tokens)
        for s in p.stop:
            i = text.find(s)
            if i >= 0:
                text, finish, reason = text[:i], "stop", s
        per_round = [(state >> i) % self.block for i in range(max(1, len(tokens) // 3))]
        # rounds verify fewer drafts than the block at times (a draft schedule), never fewer than they accepted
        verified = [max(n, (state >> (i + 5)) % self.block) for i, n in enumerate(per_round)]
        return Completion(req.key, tokens, text, finish, reason, SpecCounters(self.block, per_round, verified),
                          ttft_s=0.001, latency_s=0.002)

    def generate(self, requests: Iterable[Request], bucket: Bucket) -> Iterator[Completion]:
        batch: list[Request] = []
        for req in [*requests, None]:
            if req is not None:
                batch.append(req)
                if len(batch) < bucket.max_num_seqs:
                    continue
            for c in sorted((self._complete(r) for r in batch), key=lambda c: len(c.token_ids)):
                if self.delay:
                    time.sleep(self.delay)
                yield c
                if self.log:  # the runner asks for the next row only once it has handed this one on
                    with open(self.log, "a") as f:
                        f.write(f"{c.key[0]} {c.key[1]}\n")
            batch = []


def fake_factory(**kwargs):
    return lambda job, tokenizer: FakeEngine(tokenizer, **kwargs)
