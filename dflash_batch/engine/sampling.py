"""Token choice for every row of a forward: greedy, or temperature + top-k + top-p.

Sampling is by inverse CDF with one uniform coin per row, drawn from the sequence's own
generator, so a sequence's tokens never depend on what else is in the batch.
"""

from __future__ import annotations

import torch


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Per-row probabilities after temperature, top-k (<= 0: off) and top-p (1: off).

    logits [N, V] float32; temperature, top_p [N] float; top_k [N] int64. Top-p keeps the
    smallest prefix of the sorted distribution whose mass before the token is < top_p (the token
    that crosses top_p is kept), applied after top-k, as transformers and the DFlash reference do.
    """
    probs = torch.softmax(logits / temperature.clamp_min(1e-5)[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    sorted_p = sorted_p * keep
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]
    sorted_p = sorted_p * keep
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def choose_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """One token per row: argmax where temperature == 0, else the inverse-CDF sample at `coins`."""
    greedy = logits.argmax(-1)
    if not bool((temperature > 0).any()):
        return greedy
    probs = filtered_probs(logits, temperature, top_k, top_p)
    cdf = probs.cumsum(-1)
    # right=True: the first token whose cumulative mass exceeds the coin, so a zero-probability
    # token can never be picked, even with a coin of exactly 0.
    target = (coins * cdf[:, -1]).unsqueeze(-1)
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max(logits.shape[-1] - 1)
    return torch.where(temperature > 0, sampled, greedy)
