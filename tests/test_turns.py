"""Conversations in the engine (engine/turns.py): a later turn goes on from its row's caches
(K/V or latents, KDA state, the drafter's context and rings) and prefills only its own tokens.
Its tokens must be exactly those of a single-turn request whose prompt is the whole history
(prompt, earlier turns, this turn's opening), on both model families, in float64, greedy and
sampled; a turn that outgrows the bucket comes back with its whole prompt."""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future

import pytest

from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Completion, Request, SamplingParams
from tests.engine_util import bucket, pair_of_each_family, random_prompts


class Scripted:
    """A conversation whose turns open with fixed tokens (the tests' stand-in for a chat
    template's user turns): records each turn it is told of; `later`: each opening is made
    that many seconds later, on another thread (as a tool call's is)."""

    def __init__(self, openings: list[list[int]], later: float = 0.0):
        self.openings, self.turns, self.later = list(openings), [], later

    def ended(self, turn: Completion) -> Future:
        self.turns.append(turn)
        future = Future()
        opening = self.openings.pop(0) if self.openings else None
        if self.later:
            threading.Timer(self.later, future.set_result, [opening]).start()
        else:
            future.set_result(opening)
        return future


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return pair_of_each_family(tmp_path_factory.mktemp("turns"))


def conversations(vocab: int, n: int = 5, turns: int = 3) -> tuple[list[list[int]], list[list[list[int]]]]:
    rng = random.Random(7)
    prompts = random_prompts([rng.randint(3, 40) for _ in range(n)], vocab=vocab, seed=3)
    openings = [random_prompts([rng.randint(1, 9) for _ in range(turns - 1)], vocab=vocab, seed=10 + i)
                for i in range(n)]
    return prompts, openings


def params(i: int, sampled: bool, stop: int) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=50 + i, stop_token_ids=(stop,))
    return SamplingParams(max_new_tokens=10, seed=50 + i, stop_token_ids=(stop,))


def turn_by_turn(engine: Engine, prompts, openings, sampled: bool, stop: int, b) -> list[list[list[int]]]:
    """Each turn a single-turn request of the whole history: the tokens of every turn."""
    histories, out = [list(p) for p in prompts], [[] for _ in prompts]
    for t in range(len(openings[0]) + 1):
        reqs = [Request((str(i), 0), h, params(i, sampled, stop)) for i, h in enumerate(histories)]
        done = {c.key: c for c in engine.generate(reqs, b)}
        for i, h in enumerate(histories):
            tokens = done[(str(i), 0)].token_ids
            out[i].append(tokens)
            if t < len(openings[i]):
                histories[i] = h + tokens + openings[i][t]
    return out


@pytest.mark.parametrize("family", ["qwen3", "kimi"])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_conversation_goes_on_from_its_caches_as_its_whole_history_would(pairs, family, sampled):
    target, drafter = pairs[family]
    engine = Engine(target, drafter, dtype=target.dtype, max_num_batched_tokens=16)
    vocab = target.vocab_size
    stop = 2 if family == "qwen3" else 5  # a token the tiny targets emit now and then: turns end mid-round too
    prompts, openings = conversations(min(vocab, 64))
    b = bucket(max_num_seqs=3, max_tokens=256)
    expected = turn_by_turn(engine, prompts, openings, sampled, stop, b)
    one_shot = engine.prefill_tokens

    engine.prefill_tokens = 0
    scripts = [Scripted(o) for o in openings]
    reqs = [Request((str(i), 0), p, params(i, sampled, stop), turns=s) for i, (p, s) in enumerate(zip(prompts, scripts))]
    ends = {c.key: c for c in engine.generate(reqs, b)}
    assert sorted(ends) == sorted(r.key for r in reqs)
    for i, s in enumerate(scripts):
        assert [t.token_ids for t in s.turns] == expected[i], f"conversation {i}"
        # turn 1 ran its prompt; each later turn its last token (the anchor) and its opening
        assert [t.computed_tokens for t in s.turns] == [len(prompts[i])] + [1 + len(o) for o in openings[i]]
    assert any(t.finish_reason == "stop" for s in scripts for t in s.turns)
    assert engine.prefill_tokens == sum(t.computed_tokens for s in scripts for t in s.turns) < one_shot


def test_turns_made_later_let_other_rows_run_meanwhile(pairs):
    """A next turn made off the engine's thread: the row waits (keeping its caches) while the
    others decode, and goes on once it is made."""
    target, drafter = pairs["qwen3"]
    engine = Engine(target, drafter, dtype=target.dtype)
    prompts, openings = conversations(8, n=2)
    b = bucket(max_num_seqs=2, max_tokens=256)
    expected = turn_by_turn(engine, prompts, openings, False, 2, b)
    slow, quick = Scripted(openings[0], later=0.5), Scripted(openings[1])
    reqs = [Request(("0", 0), prompts[0], params(0, False, 2), turns=slow),
            Request(("1", 0), prompts[1], params(1, False, 2), turns=quick)]
    ends = [c.key for c in engine.generate(reqs, b)]
    assert ends == [("1", 0), ("0", 0)]  # the quick conversation ran while the slow one waited
    assert [t.token_ids for t in slow.turns] == expected[0]
    assert [t.token_ids for t in quick.turns] == expected[1]
    assert [t.computed_tokens for t in slow.turns][1:] == [1 + len(o) for o in openings[0]]


def test_a_turn_that_outgrows_the_bucket_comes_back_with_its_whole_prompt(pairs):
    target, drafter = pairs["qwen3"]
    engine = Engine(target, drafter, dtype=target.dtype)
    prompt = random_prompts([30], vocab=8, seed=5)[0]
    opening = [1] * 20
    s = Scripted([opening, opening])
    b = bucket(max_num_seqs=1, max_tokens=64)  # turn 1 fits (30 + 10); turn 2 does not (30 + t + 20 + 10)
    (done,) = engine.generate([Request(("0", 0), prompt, SamplingParams(max_new_tokens=10), turns=s)], b)
    assert len(s.turns) == 1 and done.next_prompt == prompt + s.turns[0].token_ids + opening


@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_a_turn_cut_by_a_stop_string_goes_on_as_its_whole_history_would(pairs, family):
    """A stop string cuts a turn on the host after its round moved the recurrent state past the
    cut: that turn's conversation prefills its history whole (Kimi-K3), not from its state."""
    target, drafter = pairs[family]

    def decode(ids: list[int]) -> str:  # a character per token: stop strings match token runs
        return "".join(chr(65 + i % 58) for i in ids)

    engine = Engine(target, drafter, dtype=target.dtype, decode=decode)
    vocab = min(target.vocab_size, 64)
    prompts, openings = conversations(vocab)
    b = bucket(max_num_seqs=3, max_tokens=256)
    plain = turn_by_turn(engine, prompts, openings, False, -1, b)
    stops = tuple({decode(t[2:4]) for turns in plain for t in turns[:1]})  # cut early in first turns

    def with_stops(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=10, seed=50 + i, stop=stops)

    histories, expected = [list(p) for p in prompts], [[] for _ in prompts]
    for t in range(3):
        done = {c.key: c for c in engine.generate([Request((str(i), 0), h, with_stops(i))
                                                   for i, h in enumerate(histories)], b)}
        for i in range(len(prompts)):
            expected[i].append(done[(str(i), 0)].token_ids)
            if t < 2:
                histories[i] = histories[i] + expected[i][-1] + openings[i][t]
    scripts = [Scripted(o) for o in openings]
    list(engine.generate([Request((str(i), 0), p, with_stops(i), turns=s)
                          for i, (p, s) in enumerate(zip(prompts, scripts))], b))
    assert [[t.token_ids for t in s.turns] for s in scripts] == expected
    cut = [t for s in scripts for t in s.turns if t.stop_reason in stops]
    assert cut and any(len(t.token_ids) < 9 for t in cut)


@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_conversations_sharing_a_head_keep_its_pages_between_turns(pairs, family):
    """Shared heads apply to the conversations' first turns: members read the head's pages and
    keep reading them between turns (three heads for a pool of two: a head's pages go back only
    when its conversations end), and every turn is its whole history's."""
    target, drafter = pairs[family]
    engine = Engine(target, drafter, dtype=target.dtype, shared_head_tokens=96)
    vocab = min(target.vocab_size, 64)
    heads = random_prompts([80, 72, 90], vocab=vocab, seed=21)
    prompts, openings = conversations(vocab, n=6)
    prompts = [heads[i % 3] + p for i, p in enumerate(prompts)]
    b = bucket(max_num_seqs=4, max_tokens=256)
    expected = turn_by_turn(Engine(target, drafter, dtype=target.dtype, share_prompts=False), prompts, openings,
                            False, 2, b)
    scripts = [Scripted(o) for o in openings]
    list(engine.generate([Request((str(i), 0), p, params(i, False, 2), turns=s)
                          for i, (p, s) in enumerate(zip(prompts, scripts))], b))
    assert [[t.token_ids for t in s.turns] for s in scripts] == expected
    assert sum(s.turns[0].cached_tokens > 0 for s in scripts) >= 2  # heads were shared (a pool of two)


def test_conversations_beside_single_turn_rows_with_mixed_settings_in_one_batch(pairs):
    """Neighbours: single-turn requests, greedy and sampled conversations of uneven lengths share
    the batch; each is what it would be alone."""
    target, drafter = pairs["kimi"]
    engine = Engine(target, drafter, dtype=target.dtype)
    vocab = min(target.vocab_size, 64)
    prompts, openings = conversations(vocab, n=6)
    b = bucket(max_num_seqs=4, max_tokens=256)

    def mixed(i: int) -> SamplingParams:
        return params(i, sampled=i % 2 == 1, stop=5)

    expected = {}
    for i in range(6):  # alone, turn by turn, each turn a single-turn request of its whole history
        history, expected[i] = list(prompts[i]), []
        for t in range(i % 3 + 1):
            (c,) = engine.generate([Request((str(i), 0), history, mixed(i))], b)
            expected[i].append(c.token_ids)
            if t < i % 3:
                history = history + c.token_ids + openings[i][t]
    scripts = {i: Scripted(openings[i][:i % 3]) for i in range(6) if i % 3}  # i % 3 == 0: a single-turn row
    reqs = [Request((str(i), 0), prompts[i], mixed(i), turns=scripts.get(i)) for i in range(6)]
    ends = {c.key[0]: c for c in engine.generate(reqs, b)}
    for i in range(6):
        got = [t.token_ids for t in scripts[i].turns] if i in scripts else [ends[str(i)].token_ids]
        assert got == expected[i], i
