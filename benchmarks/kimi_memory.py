"""Memory plan for the production pair (Kimi-K3 + kimi-k3-dflash2) at TP8 on 288 GB GPUs.

Shapes are those of the reference checkpoint configs (shared/reference). Prints the cache bytes
per token and per sequence, weights per rank, and the largest max_num_seqs per length bucket, as
the engine allocates them (the drafter's sliding layers in rings of their window and a block,
its full layer per token) and with the sliding layers kept whole.

usage: python benchmarks/kimi_memory.py [--gpu-gb 288] [--reserve-gb 16] [--tp 8]
"""

from __future__ import annotations

import argparse

from dflash_batch.plan.memory import planned_expert_bytes

H, LAYERS, VOCAB = 7168, 93, 163840
MLA, KDA = 24, 69
KDA_HEADS, KDA_D, CONV = 96, 128, 4
Q_LORA, KV_LORA, ROPE, NOPE, V = 1536, 512, 64, 128, 128
MLA_HEADS = 96
EXPERTS, TOPK, MOE_I, LATENT, SHARED_I, DENSE_I = 896, 16, 3072, 3584, 6144, 33792
DRAFT_LAYERS, DRAFT_HEADS, DRAFT_I, BLOCK, TAPS, SEL_R, SEL_K = 5, 64, 14336, 8, 5, 256, 16
DRAFT_SLIDING, DRAFT_WINDOW, PAGE = 4, 4096, 16  # 4 sliding layers (window 4096) + 1 full
BF16, F32 = 2, 4
GB = 1e9
EXPERT_CONFIG = dict(num_hidden_layers=LAYERS, first_k_dense_replace=1, moe_layer_freq=1, num_experts=EXPERTS,
                     moe_intermediate_size=MOE_I, routed_expert_hidden_size=LATENT)


def weights_per_rank(tp: int) -> dict[str, float]:
    """Bytes per rank: replicated tensors whole, sharded ones / tp, experts packed in MXFP4 (4.25 bits)."""
    mla_sharded = MLA_HEADS * (NOPE + ROPE) * Q_LORA + MLA_HEADS * (NOPE + V) * KV_LORA + 2 * MLA_HEADS * V * H
    mla_repl = (Q_LORA + KV_LORA + ROPE) * H
    kda_sharded = 4 * KDA_HEADS * KDA_D * H + KDA_HEADS * KDA_D * KDA_D + KDA_HEADS * H + KDA_HEADS * KDA_D * H
    kda_repl = KDA_D * H
    moe_repl = EXPERTS * H + 2 * LATENT * H          # router, latent down/up
    shared = 3 * SHARED_I * H
    sharded = (MLA * mla_sharded + KDA * kda_sharded + (LAYERS - 1) * shared + 3 * DENSE_I * H
               + 2 * VOCAB * H) * BF16 / tp
    replicated = (MLA * mla_repl + KDA * kda_repl + (LAYERS - 1) * moe_repl) * BF16
    experts = planned_expert_bytes(EXPERT_CONFIG, tp)  # the loader keeps them packed (tests/test_memory_plan.py)
    draft_attn = DRAFT_HEADS * (NOPE + ROPE) * Q_LORA + DRAFT_HEADS * (NOPE + V) * KV_LORA + DRAFT_HEADS * V * H
    draft_sharded = DRAFT_LAYERS * (draft_attn + 3 * DRAFT_I * H) * BF16 / tp
    draft_repl = (TAPS * H * H + DRAFT_LAYERS * ((Q_LORA + KV_LORA + ROPE) * H + 4 * 2 * 2 * (H // 16) * H)
                  + 2 * VOCAB * SEL_R + SEL_R * H) * BF16
    return {"target sharded (bf16)": sharded, "target replicated (bf16)": replicated,
            "routed experts (mxfp4)": experts, "drafter": draft_sharded + draft_repl}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu-gb", type=float, default=288)
    ap.add_argument("--reserve-gb", type=float, default=16, help="activations, workspaces, graphs")
    ap.add_argument("--tp", type=int, default=8)
    args = ap.parse_args()
    tp = args.tp
    mla_token = MLA * (KV_LORA + ROPE) * BF16               # replicated on every rank
    draft_layer_token = (KV_LORA + ROPE) * BF16
    draft_token = (DRAFT_LAYERS - DRAFT_SLIDING) * draft_layer_token  # the full layer
    ring_slots = -(-(DRAFT_WINDOW + BLOCK - 1) // PAGE) * PAGE  # engine/engine.py: drafter.ring_pages
    rings = DRAFT_SLIDING * ring_slots * draft_layer_token
    heads = KDA_HEADS // tp
    kda_state = KDA * (heads * KDA_D * KDA_D * F32 + 3 * heads * KDA_D * (CONV - 1) * BF16)
    staged = BLOCK * KDA * heads * KDA_D * KDA_D * F32      # a state per verify row (before replay)
    replay = BLOCK * KDA * (3 * heads * KDA_D * BF16 + (heads * KDA_D + heads) * F32)  # raw qkv; gate, beta
    print(f"per token, per rank: MLA latent {mla_token:,} B, drafter latent {draft_token:,} B (its full layer)")
    print(f"per sequence, per rank: KDA state {kda_state / 1e6:.1f} MB; drafter rings {rings / 1e6:.1f} MB "
          f"({DRAFT_SLIDING} sliding layers x {ring_slots} slots); verify staging {replay / 1e6:.1f} MB replay "
          f"inputs (per-row states, before replay: {staged / 1e6:.0f} MB)")
    w = weights_per_rank(tp)
    for k, v in w.items():
        print(f"weights per rank, {k}: {v / GB:.1f} GB")
    free = args.gpu_gb * GB - sum(w.values()) - args.reserve_gb * GB
    print(f"weights total {sum(w.values()) / GB:.1f} GB; left for caches on a {args.gpu_gb:.0f} GB GPU: "
          f"{free / GB:.1f} GB (after {args.reserve_gb:.0f} GB reserve)")
    print(f"{'bucket':>7} {'GB/seq':>8} {'max_num_seqs':>13} {'GB/seq (sliding layers whole)':>30} "
          f"{'max_num_seqs':>13}")
    fits = {}
    for ctx in (8192, 32768, 65536, 131072):
        ringed = ctx * (mla_token + draft_token) + rings + kda_state + replay
        whole = ctx * (mla_token + DRAFT_LAYERS * draft_layer_token) + kda_state + replay
        print(f"{ctx // 1024:>6}k {ringed / GB:>8.2f} {int(free // ringed):>13} {whole / GB:>30.2f} "
              f"{int(free // whole):>13}")
        fits[ctx] = int(free // ringed)
    logits_per_round(fits[8192], tp)


def logits_per_round(seqs: int, tp: int) -> None:
    """A greedy round's logits per rank: gathered whole rows (bf16 gathered, widened to fp32) against
    each rank's vocabulary slice and the few values a row it sends (parallel.sharded_top1 / _topk)."""
    verify, draft = seqs * BLOCK, seqs * (BLOCK - 1)
    whole = (verify + draft) * VOCAB * (BF16 + F32)
    sent_whole = (verify + draft) * VOCAB * BF16 * (tp - 1) / tp
    sent_split = (verify * 3 + draft * 2 * SEL_K) * F32 * (tp - 1)
    print(f"logits of a greedy round at {seqs} sequences, per rank: whole rows {whole / GB:.2f} GB "
          f"(all-gather receives {sent_whole / GB:.2f} GB); vocabulary slices {whole / tp / GB:.2f} GB "
          f"(receives {sent_split / 1e6:.1f} MB: argmax and selector top-{SEL_K} per row)")


if __name__ == "__main__":
    main()
