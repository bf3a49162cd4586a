"""Kimi-K3's routed experts stay packed as MXFP4 in memory: a loaded tiny Kimi-K3 holds exactly the
bytes the spec's count gives (plan/memory.py; the memory plan, sizing.py, reads the same parameters),
on one rank and on each of two; its outputs equal those of the same model
with the experts stored dequantized; each rank's packed slice is the dequantized weight's slice."""

from __future__ import annotations

import pytest
import torch

from dflash_batch import parallel
from dflash_batch.engine.cache import SeqRows, build_meta
from dflash_batch.models.loader import load_model
from dflash_batch.models.quant import dequant_mxfp4
from dflash_batch.plan.memory import planned_expert_bytes, resident_bytes
from dflash_batch.testing.kimi import make_kimi_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_storage")
    wide = dict(moe_intermediate_size=64)  # 32 columns of w2 a rank at TP2: whole scale groups
    return make_kimi_checkpoint(d / "mxfp4", **wide), make_kimi_checkpoint(d / "bf16", expert_format="bf16", **wide)


@pytest.mark.parametrize("tp", [1, 2])
def test_resident_expert_bytes_are_the_plans(checkpoints, monkeypatch, tp):
    packed, dense = checkpoints
    full = load_model(dense, torch.float32) if tp == 2 else None  # on one rank: every expert whole
    monkeypatch.setattr(parallel, "world_size", lambda: tp)
    for rank in range(tp):
        monkeypatch.setattr(parallel, "rank", lambda r=rank: r)
        model = load_model(packed, torch.bfloat16)
        experts = resident_bytes(model)["routed experts"]
        assert experts == planned_expert_bytes(model.config, tp)
        assert all(p.dtype == torch.uint8 for n, p in model.named_parameters() if ".experts." in n)
        # 4.25 bits a weight: about 0.27 of what bfloat16 experts would take
        config = model.config
        weights = 3 * config["moe_intermediate_size"] // tp * config["routed_expert_hidden_size"] * config["num_experts"]
        layers = sum(hasattr(layer, "block_sparse_moe") for layer in model.model.layers)
        assert experts < 0.3 * 2 * weights * layers
        if full is not None:  # this rank's slice of w1 (rows) and w2 (columns), dequantized, is the dense model's
            inter = config["moe_intermediate_size"] // tp
            moe, dense_moe = model.model.layers[1].block_sparse_moe, full.model.layers[1].block_sparse_moe
            (w1, s1), (w2, s2) = moe.experts.w1.stacked(), moe.experts.w2.stacked()
            for e in (0, config["num_experts"] - 1):
                want1 = dense_moe.experts[e].w1.weight[rank * inter:(rank + 1) * inter]
                want2 = dense_moe.experts[e].w2.weight[:, rank * inter:(rank + 1) * inter]
                assert torch.equal(dequant_mxfp4(w1[e], s1[e], torch.float32), want1)
                assert torch.equal(dequant_mxfp4(w2[e], s2[e], torch.float32), want2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_packed_experts_give_the_dequantized_models_outputs(checkpoints, dtype):
    outputs = []
    for checkpoint in checkpoints:
        model = load_model(checkpoint, dtype)
        model.allocate_cache(64, dtype, "cpu")
        model.allocate_state(1, 1, 8, "cpu")
        ids = torch.randint(0, model.vocab_size, (19,), generator=torch.Generator().manual_seed(0))
        meta = build_meta([SeqRows(list(range(16)), 0, len(ids), len(ids))], 4, None, "cpu", [0], False)
        outputs.append(model(ids, meta)[0])
    assert torch.equal(*outputs)


def test_a_scale_group_split_across_ranks_is_refused(tmp_path, monkeypatch):
    checkpoint = make_kimi_checkpoint(tmp_path / "narrow")  # moe_intermediate_size 32: 16 columns a rank
    monkeypatch.setattr(parallel, "world_size", lambda: 2)
    with pytest.raises(ValueError, match="not a multiple of its scale group of 32"):
        load_model(checkpoint, torch.bfloat16)
