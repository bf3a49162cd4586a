"""plan/heads.py: the heads found over a bucket's prompts against every partition of the rows into
groups, enumerated (the most prompt tokens a set of heads can save), and the admission order's
rules."""

from __future__ import annotations

import random

import pytest

from dflash_batch.plan.heads import MIN_HEAD_TOKENS, common_prefix, shared_heads


def partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in partitions(rest):
        for i in range(len(p)):
            yield p[:i] + [[first] + p[i]] + p[i + 1:]
        yield [[first]] + p


def saved(group: list[int], prompts: list[list[int]], min_tokens: int) -> int:
    """What one group saves sharing its longest possible head (one that ends before each prompt)."""
    if len(group) < 2:
        return 0
    length = min(min(common_prefix(prompts[group[0]], prompts[i]) for i in group[1:]),
                 min(len(prompts[i]) for i in group) - 1)
    return (len(group) - 1) * length if length >= min_tokens else 0


def nested_prompts(r: random.Random) -> list[list[int]]:
    """A system prompt, documents after it, questions after those; some prompts are a document
    with nothing after it, some are the same as another."""
    system = [r.randrange(9) for _ in range(r.randrange(2, 7))]
    docs = [system + [r.randrange(9) for _ in range(r.randrange(0, 6))] for _ in range(3)]
    return [r.choice(docs) + [r.randrange(3) for _ in range(r.randrange(0, 4))] for _ in range(r.randrange(2, 8))]


def check_rules(prompts: list[list[int]], kinds: list, min_tokens: int) -> tuple[list[int], list]:
    order, heads = shared_heads(prompts, kinds, min_tokens)
    assert sorted(order) == list(range(len(prompts)))
    seen = set()
    for h in heads:
        assert len(h.members) >= 2 and h.length >= min_tokens and not seen & set(h.members)
        seen |= set(h.members)
        assert len({kinds[i] for i in h.members}) == 1
        for i in h.members:
            assert prompts[i][:h.length] == prompts[h.members[0]][:h.length] and h.length < len(prompts[i])
        at = order.index(h.members[0])
        assert order[at:at + len(h.members)] == list(h.members), "a head's members are admitted together"
    alone = [i for i in order if i not in seen]
    assert alone == sorted(alone), "rows without a head keep their order"
    return order, heads


@pytest.mark.parametrize("seed", range(40))
def test_heads_save_the_most_any_grouping_can(seed):
    r = random.Random(seed)
    prompts, min_tokens = nested_prompts(r), r.choice([1, 2, 3, 5])
    kinds = [r.randrange(2) if seed % 4 == 0 else None for _ in prompts]
    _, heads = check_rules(prompts, kinds, min_tokens)
    best = max(sum(saved(g, prompts, min_tokens) for g in p if len({kinds[i] for i in g}) == 1)
               for p in partitions(list(range(len(prompts)))))
    assert sum((len(h.members) - 1) * h.length for h in heads) == best


def test_the_synthesis_case_and_its_edges():
    r = random.Random(0)
    system = [r.randrange(1000) for _ in range(2048)]
    prompts = [system + [r.randrange(1000) for _ in range(64)] for _ in range(256)]
    order, heads = check_rules(prompts + [[1, 2, 3]], [None] * 257, MIN_HEAD_TOKENS)
    assert [(h.length, len(h.members)) for h in heads] == [(2048, 256)]
    # A head of just MIN_HEAD_TOKENS is shared; one shorter is not.
    for length, found in ((MIN_HEAD_TOKENS, 1), (MIN_HEAD_TOKENS - 1, 0)):
        assert len(shared_heads([system[:length] + [1], system[:length] + [2]])[1]) == found
    # Prompts that are each other's prefixes, thousands deep: no recursion limit.
    chain = [[7] * k for k in range(1, 1500)]
    check_rules(chain, [None] * len(chain), MIN_HEAD_TOKENS)
