"""Our paged Qwen3 against transformers: logits and tapped hidden states for every way the engine
drives the target (one-shot prefill, chunked prefill, decode, verify, mixed batches).

float32 on both sides (transformers' Qwen3 computes its norms in float32 whatever the dtype, so
it is no float64 oracle): compared at 1e-4 of the magnitude (tests/numerics.py)."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_batch.backends.meta import AttnMeta
from dflash_batch.backends.torch_attention import TORCH
from dflash_batch.models.loader import load_model
from tests.numerics import assert_close
from tests.tiny_models import load_hf_model, make_qwen3_checkpoint

pytestmark = pytest.mark.numerics

PAGE = 4
NUM_PAGES = 40
TAPS = [3, 0, 2]  # includes the last layer; set_taps sorts them


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def build_meta(seqs: list[tuple[int, int, list[int]]], logits_rows: torch.Tensor | None = None) -> AttnMeta:
    """One forward over several sequences; each is (start position, new rows, its page ids)."""
    positions, slots, q_index, kv_lens = [], [], [], []
    row = 0
    for start, n, pages in seqs:
        pos = torch.arange(start, start + n)
        table = torch.tensor(pages)
        positions.append(pos)
        slots.append(table[pos // PAGE] * PAGE + pos % PAGE)
        q_index.append(torch.arange(row, row + n))
        kv_lens.append(start + n)
        row += n
    q_max = max(len(q) for q in q_index)
    q_idx = torch.full((len(seqs), q_max), row)  # padding -> scratch row T
    q_pos = torch.full((len(seqs), q_max), -1)
    for b, (q, p) in enumerate(zip(q_index, positions)):
        q_idx[b, : len(q)], q_pos[b, : len(p)] = q, p
    max_pages = max(len(pages) for _, _, pages in seqs)
    tables = torch.zeros(len(seqs), max_pages, dtype=torch.int64)  # padding page 0 is masked out
    for b, (_, _, pages) in enumerate(seqs):
        tables[b, : len(pages)] = torch.tensor(pages)
    return AttnMeta(
        positions=torch.cat(positions), slots=torch.cat(slots), q_index=q_idx, q_positions=q_pos,
        kv_lens=torch.tensor(kv_lens), block_tables=tables, page_size=PAGE, max_kv=max(kv_lens),
        logits_rows=torch.arange(row) if logits_rows is None else logits_rows, backend=TORCH,
    )


def shuffled_pages(seed: int = 0) -> list[int]:
    return torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(seed)).tolist()


def hf_reference(hf, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' full-sequence logits [T, V] and our taps' oracle [T, n_taps*H]."""
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1][0] for i in sorted(TAPS)], dim=-1)
    return out.logits[0], taps


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def models(request, tmp_path_factory):
    path = make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3"), tie_word_embeddings=request.param)
    return load_model(path), load_hf_model(path)


@pytest.fixture
def model(models):
    ours, _ = models
    ours.allocate_cache(NUM_PAGES * PAGE, torch.float32, "cpu")
    ours.set_taps(TAPS)
    return ours


@pytest.fixture
def hf(models):
    return models[1]


def test_one_shot_prefill(model, hf):
    ids = tokens(37, seed=1)
    logits, taps = model(ids, build_meta([(0, 37, shuffled_pages()[:10])]))
    ref_logits, ref_taps = hf_reference(hf, ids)
    assert logits.dtype == torch.float32 and logits.shape == (37, 256)
    assert_close(logits, ref_logits)
    assert_close(taps, ref_taps)


def test_last_layer_tap_is_post_norm(model, hf):
    """transformers reports hidden_states[-1] AFTER the final norm, not the last layer's raw output."""
    ids = tokens(9, seed=2)
    model.set_taps([3])
    _, taps = model(ids, build_meta([(0, 9, [0, 1, 2])]))
    raw = []
    hook = hf.model.layers[3].register_forward_hook(lambda mod, args, out: raw.append(out))
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
    hook.remove()
    with torch.no_grad():
        assert_close(out.hidden_states[-1], hf.model.norm(raw[0]))
    assert (out.hidden_states[-1] - raw[0]).abs().max() > 0.1
    assert_close(taps, out.hidden_states[-1][0])


def test_logits_rows_selects_rows(model, hf):
    ids = tokens(37, seed=1)
    rows = torch.tensor([36, 5])
    logits, _ = model(ids, build_meta([(0, 37, list(range(10)))], logits_rows=rows))
    assert_close(logits, hf_reference(hf, ids)[0][rows])


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill(model, hf, chunk):
    ids = tokens(37, seed=3)
    pages = shuffled_pages(seed=chunk)[:10]
    logits, taps = [], []
    for start in range(0, 37, chunk):
        n = min(chunk, 37 - start)
        out = model(ids[start : start + n], build_meta([(start, n, pages)]))
        logits.append(out[0])
        taps.append(out[1])
    ref_logits, ref_taps = hf_reference(hf, ids)
    assert_close(torch.cat(logits), ref_logits)
    assert_close(torch.cat(taps), ref_taps)


def test_greedy_decode(model, hf):
    prompt, steps = tokens(20, seed=4), 12
    pages = shuffled_pages(seed=4)[:8]
    logits, _ = model(prompt, build_meta([(0, 20, pages)], logits_rows=torch.tensor([19])))
    seq, step_logits = prompt.tolist(), [logits[0]]
    for _ in range(steps):
        seq.append(int(step_logits[-1].argmax()))
        out, _ = model(torch.tensor(seq[-1:]), build_meta([(len(seq) - 1, 1, pages)]))
        step_logits.append(out[0])
    ref_logits, _ = hf_reference(hf, torch.tensor(seq))
    assert_close(torch.stack(step_logits), ref_logits[19:])
    assert seq[20:] == ref_logits[19:-1].argmax(-1).tolist()


def test_verify_after_prefill(model, hf):
    ids = tokens(37, seed=5)
    pages = shuffled_pages(seed=5)[:10]
    model(ids[:29], build_meta([(0, 29, pages)]))
    logits, taps = model(ids[29:], build_meta([(29, 8, pages)]))
    ref_logits, ref_taps = hf_reference(hf, ids)
    assert_close(logits, ref_logits[29:])
    assert_close(taps, ref_taps[29:])


def test_mixed_batch_in_one_forward(model, hf):
    """A fresh prefill, a decode and a verify of three sequences, all in one forward."""
    seqs = [tokens(37, seed=6), tokens(12, seed=7), tokens(25, seed=8)]
    pages = shuffled_pages(seed=6)
    tables = [pages[0:10], pages[10:13], pages[13:20]]
    cached = [0, 11, 17]
    # Earlier steps left prefixes of sequences 1 and 2 in the cache (batched as well).
    model(torch.cat([seqs[1][:11], seqs[2][:17]]), build_meta([(0, 11, tables[1]), (0, 17, tables[2])]))

    new = [s[c:] for s, c in zip(seqs, cached)]
    meta = build_meta([(c, len(n), t) for c, n, t in zip(cached, new, tables)])
    logits, taps = model(torch.cat(new), meta)

    bounds = torch.tensor([0] + [len(n) for n in new]).cumsum(0).tolist()
    for b, (ids, c) in enumerate(zip(seqs, cached)):
        ref_logits, ref_taps = hf_reference(hf, ids)
        assert_close(logits[bounds[b] : bounds[b + 1]], ref_logits[c:])
        assert_close(taps[bounds[b] : bounds[b + 1]], ref_taps[c:])


def test_attention_bias(tmp_path):
    path = make_qwen3_checkpoint(tmp_path, attention_bias=True, seed=9)
    ours, hf = load_model(path), load_hf_model(path)
    ours.allocate_cache(NUM_PAGES * PAGE, torch.float32, "cpu")
    ids = tokens(23, seed=9)
    logits, taps = ours(ids, build_meta([(0, 23, shuffled_pages()[:6])]))
    assert taps is None
    assert_close(logits, hf_reference(hf, ids)[0])


def test_set_taps_validates(model):
    for bad in ([0, 0], [4], [-1]):
        with pytest.raises(ValueError):
            model.set_taps(bad)
    model.set_taps([2, 1])
    assert model.tap_ids == [1, 2]


def test_rope_theta_from_v5_and_v4_configs(tmp_path):
    path = make_qwen3_checkpoint(tmp_path, rope_theta=1e6, seed=10)
    ids = tokens(37, seed=10)
    meta = build_meta([(0, 37, list(range(10)))])

    def our_logits() -> torch.Tensor:
        ours = load_model(path)
        ours.allocate_cache(NUM_PAGES * PAGE, torch.float32, "cpu")
        return ours(ids, meta)[0]

    v5 = our_logits()  # transformers 5 writes rope_parameters
    assert_close(v5, hf_reference(load_hf_model(path), ids)[0])
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]  # transformers 4 layout
    (path / "config.json").write_text(json.dumps(config))
    assert torch.equal(our_logits(), v5)
