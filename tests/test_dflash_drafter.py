"""DFlash v1 / DFlash2 drafters (GQA) against the z-lab reference `dflash==0.1.0`.

The reference runs the way `dflash_generate` drives it: context taps plus one block per call,
with a DynamicCache cropped back to the committed length after each draft. Ours runs the
engine's way: context K/V written into a paged cache (page size 4, scattered pages), then one
forward over the block rows.

float32 on both sides (the reference is a float32 transformers model): hidden states are
compared at 1e-4 of their magnitude, batch == alone at 1e-5 of it (tests/numerics.py); proposals
(argmax / the selector's path) must be identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache, Qwen3Config

from dflash.model import DFlash2DraftModel, DFlashDraftModel
from dflash.model import build_target_layer_ids as reference_layer_ids
from dflash_batch.models.dflash import DFlash2Drafter, build_target_layer_ids
from dflash_batch.models.layers.linear import ParallelLMHead
from dflash_batch.models.loader import load_model
from tests import drafter_util
from tests.test_tp import free_port
from tests.drafter_util import (
    HIDDEN, MASK, NUM_PAGES, PAGE, TAPS, VOCAB, block_ids, load_drafter, meta_for, scattered_tables,
)
from tests.tiny_models import randomize_
from tests.numerics import REL32, assert_close

pytestmark = pytest.mark.numerics


def drafter_config(version: int, block_size: int, sliding: bool, is_causal: bool | None) -> Qwen3Config:
    extra = {} if is_causal is None else {"is_causal": is_causal}
    dflash = dict(block_size=block_size, mask_token_id=MASK, target_layer_ids=TAPS,
                  input_embedding_scale=0.7, output_multiplier=1.5, final_logit_softcapping=3.0)
    if version == 2:
        dflash.update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    layers = 3
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        use_sliding_window=sliding, sliding_window=5 if sliding else None,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"] if sliding else None,
        num_target_layers=6, dflash_config=dflash,
        architectures=["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"], **extra)


def make_drafter(directory: Path, version: int, block_size: int = 8, sliding: bool = True,
                 is_causal: bool | None = False, seed: int = 0) -> nn.Module:
    """A random reference drafter saved to directory; returns the reference model."""
    cls = DFlash2DraftModel if version == 2 else DFlashDraftModel
    ref = cls(drafter_config(version, block_size, sliding, is_causal))
    randomize_(ref, seed)  # also fills the conv base_kernel, which the reference leaves torch.empty
    ref.save_pretrained(directory)
    return ref.eval()


def target_io(seed: int = 1) -> tuple[nn.Embedding, ParallelLMHead]:
    """The target's embedding and head (ours: the drafter reads the head's vocabulary slice; the
    reference calls it as a plain linear layer)."""
    gen = torch.Generator().manual_seed(seed)
    embed, head = nn.Embedding(VOCAB, HIDDEN), ParallelLMHead(HIDDEN, VOCAB)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN ** 0.5)
    return embed, head


@torch.no_grad()
def reference_draft(ref: nn.Module, embed: nn.Embedding, taps: torch.Tensor, ids: torch.Tensor,
                    ctx_start: int, cache: DynamicCache | None) -> torch.Tensor:
    """One `dflash_generate` draft call: hidden [B, hidden] of the block, cache cropped after."""
    scale = ref.config.dflash_config["input_embedding_scale"]
    start = ctx_start + taps.shape[0]
    hidden = ref(target_hidden=taps[None], noise_embedding=F.embedding(ids, embed.weight)[None] * scale,
                 position_ids=torch.arange(ctx_start, start + len(ids))[None],
                 past_key_values=cache, use_cache=cache is not None)[0]
    if cache is not None:
        cache.crop(start - cache.get_seq_length())
    return hidden


@torch.no_grad()
def reference_proposal(ref: nn.Module, head: nn.Module, hidden: torch.Tensor, anchor: int) -> torch.Tensor:
    if isinstance(ref, DFlash2DraftModel):
        return ref.propose(hidden[None, 1:], torch.tensor([anchor]), head, 0.0)[0][0]
    return ref.compute_logits(hidden[None, 1:], head).argmax(-1)[0]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("version", [1, 2])
def test_matches_reference_over_rounds(tmp_path, version, block_size, sliding, is_causal):
    ref = make_drafter(tmp_path, version, block_size, sliding, is_causal)
    embed, head = target_io()
    ours = load_drafter(tmp_path, embed, head)
    cache = DynamicCache(config=ref.config)
    cache.activate_past_recording()  # as dflash_generate: sliding layers keep history until cropped
    table = scattered_tables(1)[:1]
    gen = torch.Generator().manual_seed(3)
    start = 0
    # Round 1: the prompt's 20 taps; round 2: the 3 rows the verify accepted (anchor + 2 drafts).
    for n_ctx, anchor in [(20, 17), (3, 42)]:
        taps = torch.randn(n_ctx, len(TAPS) * HIDDEN, generator=gen)
        ids = block_ids(anchor, block_size)
        want = reference_draft(ref, embed, taps, ids, start, cache)
        ours.write_context(taps, meta_for([torch.arange(start, start + n_ctx)], table))
        start += n_ctx
        got = ours(ids, meta_for([torch.arange(start, start + block_size)], table))
        assert_close(got, want, rel=REL32)
        proposal = ours.propose(got.view(1, block_size, HIDDEN), torch.tensor([anchor]))
        assert proposal.tolist() == [reference_proposal(ref, head, want, anchor).tolist()]


@pytest.mark.parametrize("version", [1, 2])
def test_batch_equals_each_alone(tmp_path, version):
    ref = make_drafter(tmp_path, version, block_size=8, sliding=True, is_causal=False)
    embed, head = target_io()
    ours = load_drafter(tmp_path, embed, head)
    tables = scattered_tables(2)
    gen = torch.Generator().manual_seed(5)
    ctx_lens, anchors = [20, 13], [17, 99]
    taps = [torch.randn(n, len(TAPS) * HIDDEN, generator=gen) for n in ctx_lens]
    ids = torch.cat([block_ids(a, 8) for a in anchors])
    blocks = [torch.arange(n, n + 8) for n in ctx_lens]

    ours.write_context(torch.cat(taps), meta_for([torch.arange(n) for n in ctx_lens], tables))
    together = ours(ids, meta_for(blocks, tables))
    proposals = ours.propose(together.view(2, 8, HIDDEN), torch.tensor(anchors))

    for b in range(2):
        ours.allocate_cache(NUM_PAGES * PAGE, torch.float32, "cpu")
        ours.write_context(taps[b], meta_for([torch.arange(ctx_lens[b])], tables[b:b + 1]))
        alone = ours(ids[b * 8:(b + 1) * 8], meta_for(blocks[b:b + 1], tables[b:b + 1]))
        assert_close(together[b * 8:(b + 1) * 8], alone, rel=1e-5)
        # The reference without a cache (context and block in one call) agrees too.
        want = reference_draft(ref, embed, taps[b], ids[b * 8:(b + 1) * 8], 0, None)
        assert_close(alone, want, rel=REL32)
        assert proposals[b].tolist() == reference_proposal(ref, head, want, anchors[b]).tolist()


def test_tensor_parallel_matches_single(tmp_path):
    checkpoints = [str(tmp_path / f"v{v}") for v in (1, 2)]
    for version, path in zip((1, 2), checkpoints):
        make_drafter(Path(path), version, block_size=8, sliding=True, is_causal=False)
    embed, head = target_io()
    weights = (embed.weight.data, head.weight.data)
    single = [drafter_util.two_rounds(Path(c), *weights) for c in checkpoints]
    mp.spawn(drafter_util.run, args=(2, free_port(), checkpoints, *weights, str(tmp_path)), nprocs=2)
    for rank in range(2):
        for got, want in zip(torch.load(tmp_path / f"rank{rank}.pt"), single):
            for a, b in zip(got["hidden"], want["hidden"]):
                assert_close(a, b, rel=REL32)
            assert [p.tolist() for p in got["proposals"]] == [p.tolist() for p in want["proposals"]]


def test_checkpoint_names(tmp_path):
    """TokenSpeed's layout (bare codebooks, `model.` prefix, an embed_tokens copy) loads the same
    weights as z-lab's save_pretrained layout; a missing layer tensor is named in the error."""
    make_drafter(tmp_path, 2)
    zlab = load_file(tmp_path / "model.safetensors")
    assert "candidate_selector.predecessor_codebook.weight" in zlab  # what save_pretrained writes
    reference = load_model(tmp_path).state_dict()

    def tokenspeed_name(name: str) -> str:
        return "model." + (name.removesuffix(".weight") if "codebook" in name else name)

    tokenspeed = {tokenspeed_name(name): t for name, t in zlab.items()}
    tokenspeed["model.embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN)
    save_file(tokenspeed, tmp_path / "model.safetensors")
    loaded = load_model(tmp_path).state_dict()
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)

    del zlab["layers.1.mlp.up_proj.weight"]
    save_file(zlab, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing: layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_config_rules():
    config = drafter_config(2, 8, sliding=True, is_causal=None).to_dict()
    model = DFlash2Drafter(config)
    # TokenSpeed semantics: no is_causal in the config means a non-causal block in every layer.
    assert not any(layer.self_attn.causal for layer in model.layers)
    assert [layer.self_attn.window for layer in model.layers] == [5, 5, None]
    assert (model.block_size, model.mask_token_id, model.target_layer_ids) == (8, MASK, TAPS)

    assert "is_causal" not in config
    config["dflash_config"].pop("target_layer_ids")
    assert DFlash2Drafter(config).target_layer_ids == reference_layer_ids(6, 3)
    for target_layers, draft_layers in [(36, 5), (93, 5), (61, 6), (28, 1), (40, 2)]:
        assert build_target_layer_ids(target_layers, draft_layers) == reference_layer_ids(target_layers, draft_layers)
    with pytest.raises(ValueError, match="attention_mode 'mqa'"):
        DFlash2Drafter({**config, "dflash_config": {**config["dflash_config"], "attention_mode": "mqa"}})
    config["dflash_config"].pop("mask_token_id")
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlash2Drafter(config)
