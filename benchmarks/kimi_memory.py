"""Kimi-K3 + kimi-k3-dflash2 on the GPUs its users have: the memory plan of each production job
(dflash-batch plan: the engine's own allocation on the meta device), then what one round moves
between the ranks of a tensor-parallel group against the time its weights take to read.

Communication, per round of `rows` sequences (block 8: rows * 8 verify tokens, the same drafter
tokens), per rank, in bf16: the target's all-reduces (each layer's attention output; each MoE
layer's routed sum at the latent width and its shared experts' output; the dense layer's MLP) and
the drafter's (attention and MLP of each of its 5 layers). An all-reduce of M bytes costs each GPU
2 (g-1)/g M over NVLink among the g GPUs of a node and, across N nodes, 2 (N-1)/N M/g over its own
InfiniBand NIC (NCCL's hierarchical rings: one rail a GPU). Expert parallelism instead (experts
split across the ranks, attention data-parallel) sends each token's latent row to the ranks of its
top-k experts and back: 2 * min(top_k, ranks) * latent bytes a token a MoE layer, from the rank
holding the token only.

Context parallelism (engine.context_parallel: the MLA latents split across the group by token)
adds, per MLA layer and token (the target's full-attention layers on the verify tokens, the
drafter's layers on its block), a gather of every rank's query heads (heads x (512 + 64) bf16),
the reduce-scatter of the float32 outputs weighted by their log-sum-exps (heads x 512 x 4) and
a gather of the log-sum-exps (heads x ranks x 4): an all-gather or reduce-scatter of M bytes costs
each GPU (g-1)/g M over NVLink and (N-1)/N M/g over its NIC, half an all-reduce; latency three
collectives a layer. What it frees: each sequence's latents on every rank but 1/TP (the plan's
caches per sequence, split and not). It pays while its milliseconds stay below what the extra
sequences are worth at the same HBM floor: floor x (seqs with / seqs without - 1).

usage: python benchmarks/kimi_memory.py
"""

from __future__ import annotations

from pathlib import Path

from dflash_batch.job import gpu_bytes, load_job
from dflash_batch.models.loader import load_config
from dflash_batch.plan.memory import moe_layers
from dflash_batch.sizing import GB, plan_job

JOBS = Path(__file__).resolve().parent.parent / "jobs"
TARGET = load_config(JOBS / "models/moonshotai/Kimi-K3")["text_config"]
DRAFTER = load_config(JOBS / "models/lightseekorg/kimi-k3-dflash2")
H, LATENT, TOP_K = TARGET["hidden_size"], TARGET["routed_expert_hidden_size"], TARGET["num_experts_per_token"]
LAYERS, MOE_LAYERS, DRAFT_LAYERS = TARGET["num_hidden_layers"], moe_layers(TARGET), DRAFTER["num_hidden_layers"]
BLOCK, BF16 = DRAFTER["dflash_config"]["block_size"], 2
MLA_LAYERS = len(TARGET["linear_attn_config"]["full_attn_layers"])
# Per GPU, one direction, GB/s: NVLink 4 (H200) and 5 (GB300); a 400 Gb/s NIC; HBM3e.
NVLINK = {"h200": 450, "gb300": 900}
IB, HBM = 50, {"h200": 4800, "gb300": 8000}
LATENCY_US = {"nvlink": 8, "ib": 25}  # an all-reduce's fixed cost inside a node / across nodes (assumed)


def tp_bytes_per_token() -> tuple[int, int]:
    """(bytes all-reduced a token of a round, all-reduces a round)."""
    target = LAYERS * H + MOE_LAYERS * (LATENT + H) + H  # attention outputs; routed + shared; layer 0's MLP
    drafter = DRAFT_LAYERS * 2 * H
    return (target + drafter) * BF16, LAYERS + 2 * MOE_LAYERS + 1 + 2 * DRAFT_LAYERS


def main() -> None:
    jobs = [("kimi-k3-dflash2.yaml", "gb300", 8), ("kimi-k3-dflash2-h200.yaml", "h200", 8),
            ("kimi-k3-dflash2-h100.yaml", "h100", 8)]
    plans = {name: plan_job(load_job(JOBS / name), JOBS, gpu_bytes(gpu), with_split=True) for name, gpu, _ in jobs}
    print("memory plan per rank (dflash-batch plan JOB), GB, at each job's reserve and engine.gpu_memory_headroom; "
          "split: the MLA latents split across the ranks (engine.context_parallel, on where the buckets need it):")
    print(f"{'job':<28} {'gpu':>6} {'tp':>4} {'nodes':>5} {'weights':>8} {'bucket':>13} {'seqs':>5} {'split':>5} "
          f"{'total':>7}")
    for name, gpu, per_node in jobs:
        plan = plans[name]
        for need in plan.runs.needs:
            print(f"{name:<28} {gpu:>6} {plan.tp:>4} {-(-plan.tp // per_node):>5} "
                  f"{sum(plan.weights.values()) / GB:>8.1f} {need.bucket.name:>13} {need.bucket.max_num_seqs:>5} "
                  f"{'yes' if plan.uses_split else 'no':>5} {(plan.base + need.total) / GB:>7.1f}")
    per_token, calls = tp_bytes_per_token()
    print(f"\ntensor parallelism: {per_token / 1e6:.2f} MB all-reduced a token of a round, {calls} all-reduces a round")
    print(f"{'setup':<22} {'rows':>5} {'MB/rank':>8} {'NVLink ms':>9} {'IB ms':>6} {'latency ms':>10} "
          f"{'HBM floor ms':>12} {'EP MB/rank':>10} {'EP IB ms':>8}")
    for label, gpu, tp, nodes, name in (("TP8, 1 GB300 node", "gb300", 8, 1, "kimi-k3-dflash2.yaml"),
                                        ("TP16, 2 H200 nodes", "h200", 16, 2, "kimi-k3-dflash2-h200.yaml")):
        plan = plans[name]
        weights = sum(plan.weights.values())
        g = tp // nodes
        for rows in (1, 16, plan.runs.needs[0].bucket.max_num_seqs):
            m = rows * BLOCK * per_token
            nvlink = 2 * (g - 1) / g * m / (NVLINK[gpu] * 1e9) * 1e3
            ib = 2 * (nodes - 1) / nodes * m / g / (IB * 1e9) * 1e3 if nodes > 1 else 0.0
            latency = calls * (LATENCY_US["ib" if nodes > 1 else "nvlink"]) / 1e3
            # A round reads every weight the rank holds (at 16 experts a token, past a few rows nearly all).
            floor = weights / (HBM[gpu] * 1e9) * 1e3
            ep = rows * BLOCK / tp * MOE_LAYERS * 2 * min(TOP_K, tp) * LATENT * BF16  # this rank's tokens only
            ep_ib = ep * (nodes - 1) / nodes / (IB * 1e9) * 1e3 if nodes > 1 else 0.0
            print(f"{label:<22} {rows:>5} {m * 2 * (g - 1) / g / 1e6:>8.1f} {nvlink:>9.2f} {ib:>6.2f} "
                  f"{latency:>10.2f} {floor:>12.2f} {ep / 1e6:>10.1f} {ep_ib:>8.2f}")

    print("\ncontext parallelism: what the latent split adds a round, against the memory it frees "
          "(plan at the job's TP, reserve and headroom; rows: the largest batch the split fits)")
    print(f"{'setup':<22} {'rows':>5} {'KB/token':>8} {'MB/rank':>8} {'NVLink ms':>9} {'IB ms':>6} {'latency ms':>10} "
          f"{'HBM floor ms':>12} {'freed MB/seq':>12} {'seqs w/o':>8} {'seqs with':>9} {'pays below ms':>13}")
    for label, gpu, tp, nodes, name in (("TP8, 1 GB300 node", "gb300", 8, 1, "kimi-k3-dflash2.yaml"),
                                        ("TP16, 2 H200 nodes", "h200", 16, 2, "kimi-k3-dflash2-h200.yaml")):
        plan = plans[name]  # at the job's TP, the one named here
        need, split = plan.whole.needs[0], plan.split.needs[0]
        without, with_split = plan.whole.largest[0], plan.split.largest[0]
        freed = (need.caches - split.caches) / need.bucket.max_num_seqs
        per_token = cp_bytes_per_token(tp)
        g = tp // nodes
        m = with_split * BLOCK * per_token
        nvlink = (g - 1) / g * m / (NVLINK[gpu] * 1e9) * 1e3
        ib = (nodes - 1) / nodes * m / g / (IB * 1e9) * 1e3 if nodes > 1 else 0.0
        latency = 3 * (MLA_LAYERS + DRAFT_LAYERS) * LATENCY_US["ib" if nodes > 1 else "nvlink"] / 1e3
        floor = sum(plan.weights.values()) / (HBM[gpu] * 1e9) * 1e3
        pays = floor * (with_split / without - 1)
        print(f"{label:<22} {with_split:>5} {per_token / 1e3:>8.0f} {m * (g - 1) / g / 1e6:>8.0f} {nvlink:>9.2f} "
              f"{ib:>6.2f} {latency:>10.2f} {floor:>12.2f} {freed / 1e6:>12.0f} {without:>8} {with_split:>9} "
              f"{pays:>13.1f}")


def cp_bytes_per_token(ranks: int) -> int:
    """Bytes the latent split gathers and reduce-scatters a token of a round (target verify + drafter block)."""
    def layer(config: dict) -> int:
        heads, latent, rope = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
        return heads * ((latent + rope) * BF16 + latent * 4 + ranks * 4)
    return MLA_LAYERS * layer(TARGET) + DRAFT_LAYERS * layer(DRAFTER)


if __name__ == "__main__":
    main()
