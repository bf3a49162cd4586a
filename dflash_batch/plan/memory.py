"""What a rank holds of a model's weights: measured on a loaded model, and counted from a config.

`planned_expert_bytes` counts Kimi-K3's routed experts at their stored MXFP4 size from the spec's
formula alone; tests/test_memory_plan.py checks that a loaded tiny Kimi-K3 holds exactly that
(`resident_bytes`), so the loader cannot quietly widen the experts that the memory plan
(sizing.py, which reads the models' own parameters) counts as packed.
"""

from __future__ import annotations

from torch import nn

MXFP4_GROUP = 32  # weights per E8M0 scale byte


def resident_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of this rank's parameters and buffers: the routed experts, and all the rest."""
    out = {"routed experts": 0, "other": 0}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out["routed experts" if ".experts." in f".{name}" else "other"] += t.nbytes
    return out


def moe_layers(config: dict) -> int:
    """Decoder layers with routed experts (DeepSeek's rule, which Kimi's configs keep)."""
    first, freq = config.get("first_k_dense_replace", 1), config.get("moe_layer_freq", 1)
    return sum(i >= first and i % freq == 0 for i in range(config["num_hidden_layers"]))


def planned_expert_bytes(config: dict, tp: int) -> int:
    """Routed expert bytes a rank holds, stored as MXFP4: each of w1, w3 [inter, latent] and w2
    [latent, inter] as a 4-bit code per weight plus a scale byte per 32 input columns; the
    intermediate width is cut across the tp ranks."""
    latent, inter = config["routed_expert_hidden_size"], config["moe_intermediate_size"] // tp
    per_expert = 2 * inter * (latent // 2 + -(-latent // MXFP4_GROUP)) + latent * (inter // 2 + -(-inter // MXFP4_GROUP))
    return moe_layers(config) * config["num_experts"] * per_expert
