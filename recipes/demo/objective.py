"""The DFlash block objective (shared/reference/dflash_training.md §2-3) and the selector's.

Per sequence, random anchors are drawn among the response tokens (resampled every step, blocks
may overlap). The block of anchor a is [token[a], mask x (B-1)] at positions a..a+B-1; row k >= 1
is trained to predict the token at a+k ("same position" labels: a shifted label was one of the
two low-acceptance bugs the doc lists) with weight exp(-(k-1)/gamma), and only where a+k is a
response token inside the sequence.

Labels: by default the frozen target's own greedy choice at a+k given the true prefix (its
argmax at a+k-1): what greedy verification will accept, computed from the same target forward
that gives the taps. "data" uses the text itself.

The selector is trained teacher-forced (doc §3): at each supervised row, among the top-k of the
backbone's logits, K-way CE of the selector's scores after the true predecessor (the anchor for
k = 1, else the label of k-1), toward the gold token; rows whose gold token is not in the top-k
are dropped. It sees detached hidden states and logits, so it cannot disturb the backbone
(the doc's toy-scale evidence: the selector adds little, the backbone is what matters).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from recipes.demo import drafter_forward


def sample_anchors(resp_start: torch.Tensor, lengths: torch.Tensor, count: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, up to `count` distinct anchors in [resp_start, length-2] (each has at least one
    label), sorted. Returns anchors [B, count] and valid [B, count] (False: a dead, padded block)."""
    B = len(lengths)
    anchors = torch.zeros(B, count, dtype=torch.int64)
    valid = torch.zeros(B, count, dtype=torch.bool)
    for b in range(B):
        lo, hi = int(resp_start[b]), int(lengths[b]) - 1
        if hi <= lo:
            continue
        pick = (torch.randperm(hi - lo, generator=gen)[:count] + lo).sort().values
        anchors[b, :len(pick)], valid[b, :len(pick)] = pick, True
    return anchors, valid


def block_targets(ids: torch.Tensor, labels_next: torch.Tensor, resp_start: torch.Tensor, lengths: torch.Tensor,
                  anchors: torch.Tensor, valid: torch.Tensor, block: int, mask_id: int,
                  gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, labels_next [B, S] (labels_next[t] = the token the label source puts at t+1).
    Returns block_ids [B, n, block], labels [B, n, block] (row k: the token at anchor+k),
    weights [B, n, block] (0 on row 0, dead blocks and rows past the response), and the
    unweighted mask of supervised rows."""
    B, n = anchors.shape
    pos = anchors[..., None] + torch.arange(block)                               # [B, n, block]
    inside = (pos < lengths[:, None, None]) & (pos >= resp_start[:, None, None])
    safe = pos.clamp(max=ids.shape[1] - 1)
    labels = labels_next.gather(1, (safe - 1).clamp(min=0).view(B, -1)).view(B, n, block)
    block_ids = torch.full((B, n, block), mask_id, dtype=torch.int64)
    block_ids[..., 0] = ids.gather(1, anchors)
    k = torch.arange(block)
    supervised = inside & valid[..., None] & (k > 0)
    decay = torch.exp(-(k - 1).clamp(min=0) / gamma)
    return block_ids, labels, supervised * decay, supervised


def draft_loss(drafter, embed_w: torch.Tensor, head_w: torch.Tensor, taps: torch.Tensor, block_ids: torch.Tensor,
               anchors: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, supervised: torch.Tensor,
               selector_alpha: float) -> tuple[torch.Tensor, dict]:
    """Weighted block CE + alpha * selector CE; metrics: the base loss, per-row teacher-forced
    accuracy, and the teacher-forced acceptance length (1 + accepted prefix per block)."""
    hidden = drafter_forward.forward(drafter, embed_w, taps, block_ids, anchors)   # [B, n, block, D]
    rows = supervised.nonzero(as_tuple=True)
    h = hidden[rows]
    logits = F.linear(h, head_w).float() * drafter.output_multiplier
    gold, w = labels[rows], weights[rows]
    base = (F.cross_entropy(logits, gold, reduction="none") * w).sum() / w.sum().clamp(min=1e-6)

    # Selector: the predecessor of row k is the anchor for k = 1 (and, unused, k = 0), else label k-1.
    anchor = block_ids[..., :1]
    predecessor = torch.cat([anchor, anchor, labels[..., 1:-1]], dim=-1)[rows]
    unary, cand = logits.detach().topk(drafter.candidate_selector.top_k, dim=-1)
    hit = cand == gold[:, None]
    keep = hit.any(-1)
    scores = drafter_forward.selector_scores(drafter, h.detach()[keep], unary[keep], cand[keep], predecessor[keep])
    sel_w = w[keep]
    selector = (F.cross_entropy(scores, hit[keep].float().argmax(-1), reduction="none") * sel_w).sum() \
        / sel_w.sum().clamp(min=1e-6)

    with torch.no_grad():
        correct = torch.zeros_like(supervised)
        correct[rows] = logits.argmax(-1) == gold
        per_row = [(correct[..., k].sum() / supervised[..., k].sum().clamp(min=1)).item()
                   for k in range(1, supervised.shape[-1])]
        # A block counts rows k = 1.. until its first miss; rows without a label end it too.
        run = (correct[..., 1:] & supervised[..., 1:]).long().cumprod(-1).sum(-1)
        live = supervised[..., 1]
        tf_acc_len = (1 + run[live].float()).mean().item() if live.any() else math.nan
        recall = keep.float().mean().item()
    metrics = dict(base=base.item(), selector=selector.item(), acc=per_row, tf_acc_len=tf_acc_len,
                   topk_recall=recall)
    return base + selector_alpha * selector, metrics
