"""Long context on the tiny pairs: a 32k-token prompt prefilled in chunks == in one shot (the
target's logits, taps and KDA state, and the drafter's context rows, whole and in rings), and
the drafter's sliding layers keeping only a ring of their window, drafting exactly what whole
caches draft, with speculative greedy == target-only greedy for prompts far past the window,
for both families (Qwen3 + DFlash2, Kimi-K3 + DFlash2-MLA). All in float64: these are
invariants, and a difference of one key or one state row shows above rounding."""

from __future__ import annotations

import pytest
import torch

from dflash_batch.backends.meta import Ring
from dflash_batch.backends.torch_attention import TorchAttention
from dflash_batch.engine.cache import SeqRows, build_meta
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.testing import kimi_pair
from tests.engine_util import F64, bucket, load_pair, make_drafter, make_target, random_prompts, run
from tests.numerics import assert_close

pytestmark = pytest.mark.numerics

PAGE = 16
WINDOW = 8


class WholeCaches(TorchAttention):
    """The torch backend with sliding layers kept whole (as a backend without rings runs them)."""

    def reads_rings(self, latent: bool) -> bool:
        return False


def sliding_caches(drafter) -> list[torch.Tensor]:
    return [t for layer in drafter.layers if layer.self_attn.window is not None
            for t in vars(layer.self_attn).values() if isinstance(t, torch.Tensor)]


def full_caches(drafter) -> list[torch.Tensor]:
    return [t for layer in drafter.layers if layer.self_attn.window is None
            for t in vars(layer.self_attn).values() if isinstance(t, torch.Tensor)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("long")
    make_drafter(d / "qwen3_drafter", 2, sliding=True, window=WINDOW, layers=3)
    return {"qwen3": (make_target(d / "qwen3_target"), d / "qwen3_drafter"),
            "kimi": kimi_pair.make_kimi_pair(d / "kimi", window=WINDOW)}


def load(pairs, family: str):
    if family == "kimi":
        return kimi_pair.load_pair(*pairs[family], F64)
    return load_pair(*pairs[family], F64)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_rings_draft_what_whole_caches_draft(pairs, family):
    """Prompts up to 40x the window, prefilled in chunks 8x the ring; four rows reused by nine
    requests; the first prompt sampled twice at once (the follower copies the leader's ring) and
    once more later (on Qwen3 it copies the prefilled prompt but for its last window); on Qwen3
    two prompts sharing a 128-token head, the shorter one copying it from the longer (the copy
    stops a window before its prompt's end: its ring holds none of the head). Every draft's
    hidden states equal those drawn from whole caches, greedy, sampled and with prompt logprobs
    (the copies' own prefill adds only what they did not copy), and greedy outputs equal
    target-only."""
    target, drafter = load(pairs, family)
    vocab = kimi_pair.VOCAB if family == "kimi" else 8
    head, long, short, *rest = random_prompts([128, 20, 3, 320, 70, 9, 180, 41], vocab=vocab, seed=3)
    prompts = [rest[0], rest[0], head + long, head + short, rest[0], *rest[1:]]
    b = bucket(max_num_seqs=4, max_tokens=512)

    def drafts(attention, **params) -> tuple[list, list[torch.Tensor], list]:
        hidden = []
        forward = drafter.forward

        def recorded(ids, meta, block_size=None):  # each draft's hidden states, but a padding row's
            out = forward(ids, meta, block_size)
            hidden.append(out.view(meta.block_tables.shape[0], -1, out.shape[-1])[meta.block_tables[:, 0] >= 0].clone())
            return out

        drafter.forward = recorded
        try:
            engine = Engine(target, drafter, dtype=F64, attention=attention, max_num_batched_tokens=128)
            reqs = [Request((str(i), 0), p, SamplingParams(seed=100 + i, max_new_tokens=40, **params))
                    for i, p in enumerate(prompts)]
            done = {c.key: c for c in engine.generate(reqs, b)}
        finally:
            drafter.forward = forward
        return ([(done[r.key].token_ids, done[r.key].spec.per_round) for r in reqs], hidden,
                [done[r.key].prompt_logprobs for r in reqs])

    outputs = {}
    cases = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, top_k=4),
             "prompt logprobs": dict(temperature=0.0, prompt_logprobs=2)}
    for name, params in cases.items():
        whole, whole_hidden, whole_scores = drafts(WholeCaches(), **params)
        assert all(c.shape[0] == full_caches(drafter)[0].shape[0] for c in sliding_caches(drafter))
        ring, ring_hidden, ring_scores = drafts(TorchAttention(), **params)
        rows_of_slots = (b.max_num_seqs + 1) * PAGE  # a ring page per row holds window + block - 1
        assert {c.shape[0] for c in sliding_caches(drafter)} == {rows_of_slots}
        assert all(c.shape[0] > 20 * rows_of_slots for c in full_caches(drafter))
        assert ring == whole
        assert len(ring_hidden) == len(whole_hidden)
        for got, want in zip(ring_hidden, whole_hidden):
            assert_close(got, want)
        for got, want, prompt in zip(ring_scores, whole_scores, prompts):
            if "prompt_logprobs" in params:
                assert len(got.token) == len(want.token) == len(prompt)
                assert_close(torch.tensor(got.token[1:], dtype=F64), torch.tensor(want.token[1:], dtype=F64))
        outputs[name] = ring
    plain = run(Engine(target, None, dtype=F64), prompts, b, max_new_tokens=40)
    assert [tokens for tokens, _ in outputs["greedy"]] == [c.token_ids for c in plain]
    assert sum(sum(rounds) for _, rounds in outputs["greedy"]) > 0, "no draft accepted"


@pytest.mark.slow  # minutes
def test_chunked_prefill_at_32k_equals_one_shot(pairs):
    """A 32k-token prompt through the tiny Kimi-K3 and its drafter's context: in chunks of 8192
    tokens (the default max_num_batched_tokens) == in one forward. Logits and taps of every row,
    the KDA layers' recurrent and conv states, the drafter's full layer's context rows and its
    sliding layers' rings (the one-shot write keeps the last ring-full of 32k rows), which hold
    what whole caches hold at those positions."""
    length, chunk = 32768, 8192
    ids = torch.randint(0, kimi_pair.VOCAB, (length,), generator=torch.Generator().manual_seed(7))
    pages = list(range(length // PAGE + 1))
    ring = Ring(drafter_ring_pages := -(-(WINDOW + kimi_pair.BLOCK - 1) // PAGE))

    def prefill(step: int) -> dict[str, torch.Tensor]:
        target, drafter = load(pairs, "kimi")
        target.allocate_cache(len(pages) * PAGE, F64, "cpu")
        target.allocate_state(1, 1, kimi_pair.BLOCK, "cpu")
        drafter.allocate_cache(len(pages) * PAGE, F64, "cpu", ring.slots(1, PAGE))
        logits, taps = [], []
        with torch.inference_mode():
            for s in range(0, length, step):
                part = ids[s:s + step]
                meta = build_meta([SeqRows(pages, s, len(part), s + len(part))], PAGE, None, "cpu", [0],
                                  batch_rows=[0], ring=ring)
                out, tapped = target(part, meta)
                drafter.write_context(tapped, meta)
                logits.append(out)
                taps.append(tapped)
        kda = [layer.self_attn for layer in target.model.layers if layer.is_kda]
        return {"logits": torch.cat(logits), "taps": torch.cat(taps),
                "kda state": torch.stack([a.state[0] for a in kda]),
                "kda conv": torch.stack([a.conv_state[0] for a in kda]),
                "drafter full layer": torch.cat(full_caches(drafter))[:length],
                # (not the scratch page past the ring: rows that are not kept are written there)
                "drafter rings": torch.cat([c[:ring.pages * PAGE] for c in sliding_caches(drafter)])}

    assert drafter_ring_pages == 1
    want, got = prefill(length), prefill(chunk)
    for name in want:
        assert_close(got[name], want[name], msg=name)
    # The rings hold the last ring-full of positions, as whole caches hold them.
    _, whole = load(pairs, "kimi")
    whole.allocate_cache(len(pages) * PAGE, F64, "cpu")
    with torch.inference_mode():
        whole.write_context(want["taps"], build_meta([SeqRows(pages, 0, length, length)], PAGE, None, "cpu", [0]))
    span = ring.pages * PAGE
    last = torch.arange(length - span, length)
    expected = []
    for cache in sliding_caches(whole):
        ring_rows = torch.empty_like(cache[:span])
        ring_rows[last % span] = cache[last]  # row 0's ring: position p on slot p mod span
        expected.append(ring_rows)
    assert_close(want["drafter rings"], torch.cat(expected))
