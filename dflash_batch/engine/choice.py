"""The verify rows' tokens from the target's logits, a group of sequences at a time.

A round that samples, or reports logprobs, needs each verify row's logits over the whole
vocabulary, and the sampler holds about six float32 copies of them (the filtered logits, the
top-p sort's values and int64 indices, the probabilities and their running sum). Over the whole
batch at once that grows with the batch: 3.9 MB a verified token for Kimi-K3's 163,840 ids, more
than the rest of the round's activations. So each rank keeps its vocabulary slice of every row,
and the rows are gathered, checked, scored and chosen SAMPLER_BYTES' worth at a time. A row's
finiteness, logprobs and token are functions of that row alone (its coin is hashed from its own
seed and position), so the grouping changes none of them; tests/test_choice.py holds it to the
ungrouped choice for every sampling setting. The plan (sizing.py) counts one group.
"""

from __future__ import annotations

import torch

from dflash_batch import parallel
from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.sampling import (add_bias_, choose_tokens, hold_stops_, log_probs, mask_disallowed_,
                                          penalize_)
from dflash_batch.kernels.sample import top1
from dflash_batch.models.activations import SAMPLER_COPIES

SAMPLER_BYTES = 256 * 2**20  # the sampler's copies of one group's rows, at most


def group_rows(vocab: int) -> int:
    """Verify rows chosen at once for a vocabulary of `vocab` ids (all of it, not a rank's slice)."""
    return max(1, SAMPLER_BYTES // (SAMPLER_COPIES * vocab * 4))


def choose_verified(b: DecodeBatch, n: int, W: int, local: torch.Tensor, positions: torch.Tensor, greedy: bool,
                    constrained: bool, sample) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [n * W], finite [n * W]) of the verify rows of sequences 0..n-1, W rows each, from
    this rank's vocabulary slice of their logits `local` [n * W, V / ranks]; the rows' logprobs
    land in `b` where asked. `greedy`: argmax only; else each row's logit edits and seeded sample."""
    per = max(1, group_rows(local.shape[-1] * parallel.world_size()) // W)  # sequences a group
    if n <= per:  # one group: no loop for torch.compile to specialise on n
        return _choose(b, 0, n, W, local, positions, greedy, constrained, sample)
    return _in_groups(b, n, W, per, local, positions, greedy, constrained, sample)


@torch.compiler.disable  # a loop over n: traced, it would compile again for every batch size
def _in_groups(b: DecodeBatch, n: int, W: int, per: int, local: torch.Tensor, positions: torch.Tensor, greedy: bool,
               constrained: bool, sample) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = torch.empty(n * W, dtype=torch.long, device=local.device)
    finite = torch.empty(n * W, dtype=torch.bool, device=local.device)
    for s in range(0, n, per):
        e = min(n, s + per)
        rows = slice(s * W, e * W)
        chosen[rows], finite[rows] = _choose(b, s, e, W, local[rows], positions[rows], greedy, constrained, sample)
    return chosen, finite


def _choose(b: DecodeBatch, s: int, e: int, W: int, local: torch.Tensor, positions: torch.Tensor, greedy: bool,
            constrained: bool, sample) -> tuple[torch.Tensor, torch.Tensor]:
    """The group of sequences s..e-1: their rows' logits gathered, then as choose_verified."""
    logits = parallel.all_gather_last(local)
    # A row whose logits are not finite fails alone (its sequence becomes an error row); checked
    # before held stop ids are set to -inf.
    finite = torch.isfinite(logits).all(-1)
    if b.token_logprob is not None:  # scored before any logit edit below
        scores = log_probs(logits, b.temperature[s:e, :W].reshape(-1))
        top = scores.topk(b.top_logprobs.shape[-1], dim=-1)
        b.top_logprobs[s:e, :W] = top.values.view(e - s, W, -1)
        b.top_logprob_ids[s:e, :W] = top.indices.view(e - s, W, -1)
    # greedy: no row samples, biases or holds its stop ids (engine.py decides)
    chosen = top1(logits) if greedy else _edited_sample(b, s, e, W, logits, positions, constrained, sample)
    if b.token_logprob is not None:
        b.token_logprob[s:e, :W] = scores.gather(-1, chosen[:, None]).view(e - s, W)
    return chosen, finite


def _edited_sample(b: DecodeBatch, s: int, e: int, W: int, logits: torch.Tensor, positions: torch.Tensor,
                   constrained: bool, sample) -> torch.Tensor:
    """Each verify row's token: its logit bias, penalties along the drafted path, held stop ids
    and grammar mask applied (in place), then the seeded sample."""
    n = e - s

    def per_verify_row(t: torch.Tensor) -> torch.Tensor:  # [rows, L] -> [n * W, L]
        return t[s:e, None, :].expand(n, W, -1).reshape(n * W, -1)

    def verified(t: torch.Tensor) -> torch.Tensor:  # [rows, B, ...] -> [n * W, ...]
        return t[s:e, :W].reshape(n * W, *t.shape[2:])

    if b.bias is not None:
        add_bias_(logits, per_verify_row(b.bias_ids), per_verify_row(b.bias))
    if b.counts is not None:
        # A row verifying fewer drafts than W (engine/row_drafts.py) has blanks (-1) past them; read
        # as token 0, they change only the rows past its count, which it never keeps.
        penalize_(logits, b.counts[s:e], b.in_prompt[s:e], b.ids[s:e, 1:W].clamp_min(0), b.repetition[s:e],
                  b.frequency[s:e], b.presence[s:e])
    held = (positions + 1).view(n, W) < b.min_stop_pos[s:e, None]
    hold_stops_(logits, per_verify_row(b.stop_ids), held.reshape(-1))
    if constrained:
        mask_disallowed_(logits, verified(b.allowed_bits.view(b.rows, b.block, -1)))
    return choose_tokens(logits, verified(b.temperature), verified(b.top_k), verified(b.top_p), verified(b.seed),
                         positions + 1, sample, verified(b.min_p))
