"""Shared heads: the prompt prefixes that rows of one bucket have in common, found before it runs.

An offline run knows every prompt before it starts, so it can find exactly which rows begin
alike (a system prompt, few-shot examples, one document asked many questions) and admit those
rows together: the engine prefills a head once, keeps its state at the head's exact end, and
every other row of the head starts there (engine/heads.py).

The heads come from the rows' prompts sorted as token sequences, where rows with a common
prefix are neighbours and the longest common prefix (LCP) of neighbours spans a prefix tree.
Each row gets at most one head: the heads are chosen by dynamic programming over that tree, to
save the most prompt tokens (a short head shared by many rows, or longer heads shared by
fewer, or both).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from dflash_batch.limits import MIN_HEAD_TOKENS


@dataclass(frozen=True)
class SharedHead:
    index: int                # among this plan's heads
    length: int               # prompt tokens shared: at most the shortest member's prompt less one
    members: tuple[int, ...]  # indices of the prompts that start with it, in admission order
    kind: Hashable = None     # what its members agree on besides tokens (shared_heads' kinds)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (compared a slice at a time)."""
    n, low = min(len(a), len(b)), 0
    step = 256
    while low < n:
        high = min(n, low + step)
        if a[low:high] != b[low:high]:
            while a[low] == b[low]:
                low += 1
            return low
        low = high
    return n


Tree = list[tuple[int, int, list[int]]]  # (shared tokens, or a leaf's prompt index; parent; children)


def prefix_tree(prompts: list[list[int]], order: list[int], lcp: list[int]) -> Tree:
    """The ranges of the sorted prompts `order` (lcp: of neighbours): a range of two or more
    shares `low` tokens, the smallest LCP inside it, and splits where that LCP is, into
    ranges that share more, or single prompts (leaves). A prompt of just `low` tokens cannot
    take its range's head (a head ends before a prompt does): such prompts hang from a range of
    `low - 1` tokens above the rest. A parent comes before its children. Built with a stack,
    not recursion: prompts that are each other's prefixes nest as deep as there are of them."""
    tree: Tree = []
    stack = [(0, len(order), -1)]
    while stack:
        lo, hi, parent = stack.pop()
        if parent >= 0:
            tree[parent][2].append(len(tree))
        if hi - lo == 1:
            tree.append((order[lo], parent, []))
            continue
        low = min(lcp[lo:hi - 1])
        cuts = [lo] + [j + 1 for j in range(lo, hi - 1) if lcp[j] == low] + [hi]
        parts = list(zip(cuts, cuts[1:]))
        short = [(a, b) for a, b in parts if b - a == 1 and len(prompts[order[a]]) == low]
        if short and len(short) < len(parts):
            rest = [p for p in parts if p not in short]
            stack += [(a, b, len(tree)) for a, b in short]
            stack.append((rest[0][0], rest[-1][1], len(tree)))  # (sorted: the short prompts come first)
            tree.append((low - 1, parent, []))
            continue
        stack += [(a, b, len(tree)) for a, b in parts]
        tree.append((low - 1 if short else low, parent, []))
    return tree


def choose_heads(tree: Tree, prompts: list[list[int]], min_tokens: int) -> list[tuple[int, list[int]]]:
    """The heads that save the most prompt tokens, as (length, members): each prompt joins the
    nearest chosen range above it (the longest head it can have) if that head ends before the
    prompt does, saving the head's length; each head costs its length once (its first member
    computes it). Dynamic programming: value[v][a] is the most range v saves when the nearest
    chosen range above it shares `a` tokens (0: none)."""
    value: list[dict[int, int]] = [{} for _ in tree]
    chosen: list[int | None] = [None] * len(tree)  # what choosing range v saves (None: too short a head)
    above: list[list[int]] = [[0] for _ in tree]  # the head lengths a range may inherit
    for v, (_, parent, _) in enumerate(tree):
        if parent >= 0:
            up = tree[parent][0]
            above[v] = above[parent] + ([up] if up >= min_tokens else [])
    for v in reversed(range(len(tree))):
        low, _, children = tree[v]
        if not children:
            value[v] = {a: a if a < len(prompts[low]) else 0 for a in above[v]}
            continue
        if low >= min_tokens:
            chosen[v] = sum(value[c][low] for c in children) - low
        for a in above[v]:
            value[v][a] = max(sum(value[c][a] for c in children), chosen[v] if chosen[v] is not None else 0)
    members: dict[int, list[int]] = {}  # by the range whose head they share
    walk = [(0, 0, -1)] if tree else []  # (range, inherited head length, its range)
    while walk:
        v, a, owner = walk.pop()
        low, _, children = tree[v]
        if not children:
            if 0 < a < len(prompts[low]):
                members.setdefault(owner, []).append(low)
            continue
        if chosen[v] is not None and chosen[v] > sum(value[c][a] for c in children):
            a, owner = low, v
        walk += [(c, a, owner) for c in children]
    return [(tree[v][0], sorted(m)) for v, m in members.items() if len(m) > 1]


def shared_heads(prompts: list[list[int]], kinds: list[Hashable] | None = None,
                 min_tokens: int = MIN_HEAD_TOKENS) -> tuple[list[int], list[SharedHead]]:
    """The heads of these prompts (each shared by two or more, at least `min_tokens` long) and
    an admission order: the prompts in their own order, except that a head's members come
    together where its first member is. Prompts of different `kinds` (what else must match for
    two rows to share a prefill, e.g. the prompt logprobs they ask for) never share a head.
    The head of a member stops at least one token before its prompt's end: the token after a
    prompt comes from its last position's logits, which each row computes itself."""
    kinds = kinds or [None] * len(prompts)
    kind_rank = {k: i for i, k in enumerate(dict.fromkeys(kinds))}
    order = sorted(range(len(prompts)), key=lambda i: (kind_rank[kinds[i]], prompts[i]))
    lcp = [common_prefix(prompts[a], prompts[b]) if kinds[a] == kinds[b] else 0 for a, b in zip(order, order[1:])]
    head_of = {i: (length, members) for length, members in choose_heads(prefix_tree(prompts, order, lcp), prompts,
                                                                        min_tokens) for i in members}
    admission, heads = [], []
    for i in range(len(prompts)):
        if i not in head_of:
            admission.append(i)
        elif head_of[i][1][0] == i:  # its head's first member: the head's members come here
            length, members = head_of[i]
            heads.append(SharedHead(len(heads), length, tuple(members), kinds[i]))
            admission += members
    return admission, heads
