"""Checkpoint loading: every mismatch is refused by name, shards and renames load exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_batch.models.layers.linear import ColumnParallelLinear
from dflash_batch.models.loader import load_config, load_model, load_weights
from dflash_batch.models.registry import model_class
from tests.tiny_models import make_qwen3_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3"))


def edited_copy(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint, applying edit(tensors) to its tensor dict."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensors_are_all_named(checkpoint, tmp_path):
    names = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    path = edited_copy(checkpoint, tmp_path / "c", lambda t: [t.pop(n) for n in names])
    with pytest.raises(ValueError) as err:
        load_model(path)
    assert str(path) in str(err.value)
    for n in names:
        assert f"missing: {n}" in str(err.value)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    name = "model.layers.0.self_attn.bogus.weight"
    path = edited_copy(checkpoint, tmp_path / "c", lambda t: t.update({name: torch.zeros(3)}))
    with pytest.raises(ValueError, match=f"unexpected: {name}"):
        load_model(path)


def test_misshaped_tensor_is_named(checkpoint, tmp_path):
    name = "model.layers.2.self_attn.k_proj.weight"
    path = edited_copy(checkpoint, tmp_path / "c", lambda t: t.update({name: torch.zeros(16, 64)}))
    with pytest.raises(ValueError, match=rf"shape mismatch: {name}: checkpoint \[16, 64\] vs model \[32, 64\]"):
        load_model(path)


def test_missing_or_invalid_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_config(tmp_path)


def test_missing_weights_file(checkpoint, tmp_path):
    shutil.copy(checkpoint / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        model_class({"architectures": ["LlamaForCausalLM"]})


def test_sharded_index_loads(checkpoint, tmp_path):
    sharded = make_qwen3_checkpoint(tmp_path, max_shard_size="40KB")  # same seed as `checkpoint`
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    single, multi = load_model(checkpoint).state_dict(), load_model(sharded).state_dict()
    assert single.keys() == multi.keys()
    for name in single:
        assert torch.equal(single[name], multi[name]), name


def test_tied_head_shares_embedding_and_ignores_stored_copy(tmp_path):
    src = make_qwen3_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    # Some tied checkpoints store the head anyway; it must be accepted and not used.
    path = edited_copy(src, tmp_path / "c", lambda t: t.update({"lm_head.weight": torch.zeros(256, 64)}))
    model = load_model(path)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, load_file(src / "model.safetensors")["model.embed_tokens.weight"])


def test_dtype_casts_parameters_but_not_rope(checkpoint):
    model = load_model(checkpoint, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary_emb.inv_freq.dtype == torch.float32


class Renamed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = ColumnParallelLinear(4, 6)

    def checkpoint_name(self, name: str) -> str | None:
        return None if name.startswith("unused.") else name.removeprefix("draft.")


def test_checkpoint_name_renames_and_skips(tmp_path):
    weight = torch.randn(6, 4)
    save_file({"draft.proj.weight": weight, "unused.x": torch.zeros(2)}, tmp_path / "model.safetensors")
    model = Renamed()
    load_weights(model, tmp_path)
    assert torch.equal(model.proj.weight, weight)
