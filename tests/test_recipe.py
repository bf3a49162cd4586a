"""The demo training recipe (recipes/demo): a short run of both phases at the tiny preset, then
the proofs that it trains a drafter and that what it trains is what the product runs:
- the saved target and drafter load through the product loader and decode through the engine,
  speculative output == target-only, at an acceptance length a drafter gets only by learning;
- the training forward of the target gives the inference model's logits and taps (same weights);
- the training forward of the drafter gives the inference drafter's block hidden states for a
  block whose context is the target's taps, and the selector's training scores pick the
  inference greedy path;
- the training-speed KDA pieces equal the product's KDA functions.

float32 throughout: the training forwards (batched, unpaged) against the inference models
(paged) at 1e-4 of the magnitude (tests/numerics.py); the KDA pieces at 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from dflash_batch.engine.cache import SeqRows, build_meta
from dflash_batch.models.layers.kda import kda_chunked, l2norm, short_conv
from dflash_batch.models.loader import load_model
from recipes.demo import drafter_forward, evaluate, target_forward, train
from recipes.demo.batches import BatchMaker
from recipes.demo.kda_train import kda_zero_state, short_conv_silu
from tests.numerics import REL32, assert_close

pytestmark = pytest.mark.numerics

# Enough steps for a drafter that has learned something: over seeds 0-4 this gives acc_len
# 1.77-2.13 on 8 held-out problems (a drafter that has learned nothing gives 1.0).
TARGET_STEPS, DRAFTER_STEPS, MIN_ACC_LEN = 60, 150, 1.5
PAGE, PAGES = 4, list(range(64))[::-1]  # a reversed page table: slots are not positions


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    log = train.main(["--out", str(out), "--preset", "tiny", "--target-steps", str(TARGET_STEPS),
                      "--drafter-steps", str(DRAFTER_STEPS), "--warmup", "2",
                      "--batch", "6", "--draft-batch", "6", "--anchors", "6", "--vocab", "384",
                      "--tokenizer-samples", "2000", "--eval-every", "0", "--stream", "attn_res"])
    return out, log


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_losses_go_down(run):
    _, log = run
    target = [s["loss"] for s in log["target"]["steps"]]
    drafter = [s["base"] for s in log["drafter"]["steps"]]
    assert (len(target), len(drafter)) == (TARGET_STEPS, DRAFTER_STEPS)
    assert log["machine"]["cpu"] and log["machine"]["torch"] == torch.__version__
    assert _mean(target[-3:]) < _mean(target[:3]) - 0.5, target
    assert _mean(drafter[-3:]) < _mean(drafter[:3]) - 0.5, drafter


def test_target_logits_and_taps_match_inference(run):
    out, _ = run
    target, drafter = evaluate.load_pair(out)
    assert target.tap_stream == "attn_res" and target.tap_ids == drafter.target_layer_ids
    batch = BatchMaker(out / "target", seed=5).batch(0, 3)
    with torch.no_grad():
        logits, taps = target_forward.forward(target, batch.ids, target.tap_ids, target.tap_stream)
    target.allocate_cache(len(PAGES) * PAGE, torch.float32, "cpu")
    target.allocate_state(1, 1, 8, "cpu")
    for b, n in enumerate(batch.lengths.tolist()):
        target.reset_state(0)
        meta = build_meta([SeqRows(PAGES, 0, n, n)], PAGE, None, "cpu", [0])
        want_logits, want_taps = target(batch.ids[b, :n], meta)
        assert_close(logits[b, :n], want_logits, rel=REL32)
        assert_close(taps[b, :n], want_taps, rel=REL32)


def test_drafter_block_matches_inference(run):
    out, _ = run
    target, drafter = evaluate.load_pair(out)
    batch = BatchMaker(out / "target", seed=6).batch(0, 1)
    n = int(batch.lengths[0])
    with torch.no_grad():
        _, taps = target_forward.forward(target, batch.ids, target.tap_ids, target.tap_stream)
    anchor = n - 4  # past the sliding window (8): the window cuts the context
    assert anchor > drafter.layers[0].self_attn.window
    block = torch.tensor([int(batch.ids[0, anchor])] + [drafter.mask_token_id] * (drafter.block_size - 1))
    with torch.no_grad():
        got = drafter_forward.forward(drafter, target.model.embed_tokens.weight, taps, block[None, None],
                                      torch.tensor([[anchor]]))[0, 0]
    drafter.allocate_cache(len(PAGES) * PAGE, torch.float32, "cpu")
    drafter.write_context(taps[0, :anchor], build_meta([SeqRows(PAGES, 0, anchor, anchor)], PAGE))
    B = drafter.block_size
    want = drafter(block, build_meta([SeqRows(PAGES, anchor, B, anchor + B)], PAGE, []))
    assert_close(got, want, rel=REL32)

    # The selector's training scores walk the same greedy path as the inference proposal.
    rows = want[1:]
    unary, cand = drafter.compute_logits(rows).topk(drafter.candidate_selector.top_k, dim=-1)
    prev, path = block[:1], []
    for k in range(B - 1):
        scores = drafter_forward.selector_scores(drafter, rows[k:k + 1], unary[k:k + 1], cand[k:k + 1], prev)
        prev = cand[k:k + 1, scores.argmax(-1)[0]]
        path.append(int(prev))
    assert path == drafter.propose(want[None], block[:1])[0].tolist()


def test_engine_decodes_the_trained_pair(run):
    out, _ = run
    result = evaluate.measure(out, prompts=8, max_new_tokens=24)
    assert result["same_output"], "speculative greedy output differs from target-only"
    assert result["acc_len"] >= MIN_ACC_LEN, result


def test_saved_checkpoints_are_hf_layout(run):
    out, _ = run
    assert (out / "target" / "tokenizer.json").is_file() and (out / "target" / "tokenizer_config.json").is_file()
    from safetensors import safe_open
    with safe_open(str(out / "target" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all(n.startswith("language_model.") for n in names)
    assert any(".block_sparse_moe.experts.0.w1.weight" in n for n in names)
    assert load_model(out / "drafter").config["dflash_config"]["aux_hidden_stream"] == "attn_res"


def test_training_kda_equals_product_kda():
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 2, 37, 2, 8  # T not a multiple of the 16-token chunk
    x, w = torch.randn(B, T, 3 * H * K, generator=gen), torch.randn(3 * H * K, 4, generator=gen)
    torch.testing.assert_close(short_conv_silu(x, w), short_conv(x, w, torch.zeros(B, 3 * H * K, 3))[0])
    q, k = (l2norm(torch.randn(B, T, H, K, generator=gen)) for _ in range(2))
    v = torch.randn(B, T, H, K, generator=gen)
    g = -5 * torch.rand(B, T, H, K, generator=gen)  # decays down to the gate's lower bound
    beta = torch.rand(B, T, H, generator=gen)
    want, _ = kda_chunked(q, k, v, g, beta, None)
    assert_close(kda_zero_state(q, k, v, g, beta), want, rel=1e-5)
