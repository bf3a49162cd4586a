"""Token choice for every row of a forward: greedy, or temperature + top-k + top-p + min-p,
after the logit edits a request may ask for (logit bias, penalties, held stop ids).

Sampling is by inverse CDF at the row's coin, hashed from (the sample's seed, the position of
the token being chosen) (kernels/coins.py): a sequence's tokens never depend on what else is in
the batch, where its row sits, or how its prompt was chunked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_batch.kernels.sample import sample_torch
from dflash_batch.models.layers.dtypes import wide


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row logits / temperature, with every token outside top-k (<= 0: off), top-p (1: off)
    and min-p (0: off) at -inf.

    logits [N, V]; temperature, top_p, min_p [N] float; top_k [N] int64. Top-p keeps the smallest
    prefix of the sorted distribution whose mass before the token is < top_p (the token that
    crosses top_p is kept), applied after top-k, as transformers and the DFlash reference do;
    min-p then keeps the tokens at least min_p times as likely as the most likely one (last in
    transformers' order; the ratio does not depend on the renormalisations before it).
    """
    scaled = wide(logits) / temperature.clamp_min(1e-5)[:, None]
    sorted_p, order = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    sorted_p = sorted_p * keep
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    keep &= ((sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]) | (top_p[:, None] >= 1)
    if min_p is not None:
        keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    return scaled.masked_fill(~torch.zeros_like(keep).scatter_(-1, order, keep), float("-inf"))


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution rows are sampled from (see filter_logits)."""
    return torch.softmax(filter_logits(logits, temperature, top_k, top_p, min_p), dim=-1)


def log_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """What `logprobs` report: log_softmax(logits / temperature) per row, temperature 0 read as 1
    (the target's own distribution, before bias, penalties and filters)."""
    return torch.log_softmax(wide(logits) / torch.where(temperature > 0, temperature, 1.0)[:, None], dim=-1)


def add_bias_(logits: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Add each row's biases to `logits` in place. ids [N, L] (-1: none; ids past the vocabulary
    are ignored), bias [N, L]. Touches N x L entries, no host sync (graph-safe)."""
    valid = (ids >= 0) & (ids < logits.shape[-1])
    return logits.scatter_add_(-1, ids.clamp(0, logits.shape[-1] - 1), (bias * valid).to(logits.dtype))


def hold_stops_(logits: torch.Tensor, stop_ids: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Set each row's stop ids to -inf in place where `held` (min_tokens not reached yet).

    logits [N, V]; stop_ids [N, S] (-1: none); held [N] bool. A minimum with +inf leaves an entry
    as it is, so padding ids (clamped onto id 0) and ids listed twice are harmless."""
    cut = torch.where(held[:, None] & (stop_ids >= 0), float("-inf"), float("inf")).to(logits.dtype)
    return logits.scatter_reduce_(-1, stop_ids.clamp_min(0), cut, reduce="amin")


def penalize_(logits: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor, drafts: torch.Tensor,
              repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties to `logits` in place, as vLLM and the
    OpenAI API define them: a token already generated or in the prompt has its logit divided by
    `repetition` where positive, multiplied where not; then `frequency` x (times generated) and
    `presence` x (generated at all) are subtracted.

    logits [n * B, V] are the B verify rows of n sequences; counts [n, V] how often each token
    was generated before the block (its anchor included); prompt [n, V] bool; drafts [n, B - 1].
    Row j of a block follows d_1..d_j, so it sees them as generated: penalties are those of
    target-only decoding along the drafted path. Each row's penalties are [n] (1, 0, 0: off,
    which leaves every logit exactly as it is). No host sync, no branch on values (graph-safe).
    """
    n, V = counts.shape
    B = logits.shape[0] // n
    rows = logits.view(n, B, V)
    rep, freq, pres = (x.view(n, 1, 1).to(logits.dtype) for x in (repetition, frequency, presence))

    def penalized(x: torch.Tensor, count: torch.Tensor, in_prompt: torch.Tensor) -> torch.Tensor:
        seen = (count > 0) | in_prompt
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        return x - freq * count - pres * (count > 0)

    if B > 1:
        # At the drafts' ids the count grows along the block: in row j, token t has been drafted
        # #{k < j: d_{k+1} == t} times. Every entry of one id in a row gets the same value.
        at = drafts[:, None, :].expand(n, B, B - 1)
        k = torch.arange(B - 1, device=logits.device)
        seen_by_row = k[None, :] < torch.arange(B, device=logits.device)[:, None]  # [B, B - 1]
        same = drafts[:, :, None] == drafts[:, None, :]                           # [n, B - 1, B - 1]
        extra = (same[:, None] & seen_by_row[None, :, None, :]).sum(-1)          # [n, B, B - 1]
        drafted = penalized(rows.gather(-1, at), counts.gather(-1, drafts)[:, None, :] + extra,
                            prompt.gather(-1, drafts)[:, None, :])
    rows.copy_(penalized(rows, counts[:, None, :], prompt[:, None, :]))
    if B > 1:
        rows.scatter_(-1, at, drafted)
    return logits


def mask_disallowed_(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Set each row's tokens a grammar does not allow to -inf in place. bits [N, ceil(V / 32)]
    int32, bit t of a row set iff token t is allowed (xgrammar's bitmask layout)."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().view(bits.shape[0], -1)[:, :logits.shape[-1]]
    return logits.masked_fill_(~allowed, float("-inf"))


def choose_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seed: torch.Tensor, position: torch.Tensor,
                  sample: Callable[..., torch.Tensor] = sample_torch, min_p: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """One token per row: argmax where temperature == 0, else the row's seeded sample from the
    filtered distribution (seed and position per row: the coin of the token being chosen)."""
    greedy = logits.argmax(-1)
    drawn = sample(filter_logits(logits, temperature, top_k, top_p, min_p), seed, position)
    return torch.where(temperature > 0, drawn, greedy)
