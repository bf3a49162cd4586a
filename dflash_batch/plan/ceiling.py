"""A bandwidth ceiling on a bucket's decode throughput: what one round must read from HBM, and
the tokens per second per GPU that reading it at the GPU's peak bandwidth allows.

A decode round of a large MoE is bound by memory traffic: every rank reads the weights the
round's tokens touch (all dense weights; of the routed experts, those some token of the batch
routes to) and the caches it attends over. The ceiling counts every cache a bucket holds as read
once a round (sequences at their bucket's longest) and nothing else (no activations, no
collectives, no compute): a bound, not a prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

# Peak HBM bandwidth per GPU, TB/s, from NVIDIA's datasheets: H100 SXM5 3.35, H200 4.8, HGX B200
# 8, GB300 NVL72 8 (per Blackwell Ultra GPU).
HBM_TBPS = {"h100": 3.35, "h200": 4.8, "b200": 8.0, "gb300": 8.0}
# The model card's acceptance length on MATH-500 (lightseekorg/kimi-k3-dflash2: GSM8K 5.9,
# MATH-500 4.6, AIME and writing 2.8, ~4.8 at 128k).
CARD_ACC_LEN = 4.6


@dataclass(frozen=True)
class Ceiling:
    seqs: int
    read: int          # bytes a rank reads a round
    round_ms: float    # the floor that reading sets
    tokens_per_s: float  # per GPU, at the acceptance length

    def describe(self, acc_len: float) -> str:
        return (f"{self.seqs} seqs: {self.read / 1e9:.1f} GB read a round -> at least {self.round_ms:.1f} ms -> "
                f"at most {self.tokens_per_s:,.0f} tokens/s per GPU at acc_len {acc_len:g}")


def experts_touched(tokens: int, experts: int, per_token: int) -> float:
    """The expected share of a layer's routed experts that `tokens` tokens route to, each to
    `per_token` of them (routing taken as uniform: a skewed router touches fewer)."""
    return 1.0 - (1.0 - per_token / experts) ** tokens


def ceiling(seqs: int, block: int, tp: int, dense: int, routed: int, caches: int, tbps: float, acc_len: float,
            experts: int = 0, per_token: int = 0) -> Ceiling:
    """A round of `seqs` sequences verifying `block` tokens each on `tp` ranks: a rank reads its
    `dense` weight bytes, the touched share of its `routed` expert bytes, and its `caches`; the
    group emits acc_len tokens a sequence a round (acc_len = 1 + accepted / rounds)."""
    share = experts_touched(seqs * block, experts, per_token) if experts else 1.0
    read = dense + int(routed * share) + caches
    seconds = read / (tbps * 1e12)
    return Ceiling(seqs, read, seconds * 1e3, seqs * acc_len / seconds / tp)
