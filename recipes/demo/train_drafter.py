"""Phase 2: the DFlash2-MLA drafter against the frozen target (online: the target's taps and
greedy labels are recomputed for every batch; for a model this small that is cheaper than
storing them).

Only response tokens are anchors and labels (the drafter only ever drafts answers), and the
target's embedding and head are borrowed frozen, as at inference.
"""

from __future__ import annotations

import time

import torch

from recipes.demo import objective, schedule, target_forward
from recipes.demo.batches import Batch, BatchMaker


class DraftData:
    """Builds the drafter's inputs for a batch: taps, block ids, labels, weights."""

    def __init__(self, target, drafter, anchors: int, gamma: float, labels: str, seed: int):
        self.target, self.drafter = target, drafter
        self.anchors, self.gamma, self.labels, self.seed = anchors, gamma, labels, seed
        self.stream = drafter.config["dflash_config"].get("aux_hidden_stream", "prefix")

    def inputs(self, batch: Batch, step: int) -> dict:
        with torch.no_grad():
            logits, taps = target_forward.forward(self.target, batch.ids, self.drafter.target_layer_ids, self.stream)
        if self.labels == "target":
            labels_next = logits.argmax(-1)        # the target's greedy token after each position
        else:
            labels_next = torch.cat([batch.ids[:, 1:], batch.ids[:, -1:]], dim=1)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        anchors, valid = objective.sample_anchors(batch.resp_start, batch.lengths, self.anchors, gen)
        block_ids, labels, weights, supervised = objective.block_targets(
            batch.ids, labels_next, batch.resp_start, batch.lengths, anchors, valid,
            self.drafter.block_size, self.drafter.mask_token_id, self.gamma)
        return dict(taps=taps, block_ids=block_ids, anchors=anchors, labels=labels, weights=weights,
                    supervised=supervised)


def train(drafter, target, maker: BatchMaker, batch_size: int, anchors: int, gamma: float, labels: str,
          alpha: float, lr: float, warmup: int, steps: int | None, seconds: float | None, eval_every: int,
          seed: int, log: dict) -> int:
    for p in target.parameters():
        p.requires_grad_(False)
    embed_w, head_w = target.model.embed_tokens.weight, target.lm_head.weight
    data = DraftData(target, drafter, anchors, gamma, labels, seed)
    optim = schedule.adamw(drafter, lr)
    eval_inputs = data.inputs(maker.batch(0, batch_size, stream=2), -1)
    history, evals, start = log.setdefault("steps", []), log.setdefault("eval", []), time.monotonic()

    def evaluate(step: int) -> dict:
        with torch.no_grad():
            _, em = objective.draft_loss(drafter, embed_w, head_w, **eval_inputs, selector_alpha=alpha)
        evals.append(dict(step=step, **em))
        return em

    def step_fn(step: int, step_lr: float) -> None:
        inputs = data.inputs(maker.batch(step, batch_size, stream=3), step)
        for group in optim.param_groups:
            group["lr"] = step_lr
        loss, m = objective.draft_loss(drafter, embed_w, head_w, **inputs, selector_alpha=alpha)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optim.step()
        history.append(dict(step=step, lr=step_lr, t=round(time.monotonic() - start, 2), **m))
        if eval_every and step % eval_every == 0:
            em = evaluate(step)
            print(f"drafter step {step}: loss {m['base']:.3f} | held-out loss {em['base']:.3f} "
                  f"tf_acc_len {em['tf_acc_len']:.2f} acc1 {em['acc'][0]:.2f} "
                  f"recall {em['topk_recall']:.2f} ({time.monotonic() - start:.0f}s)", flush=True)

    n = schedule.run_phase(step_fn, lr, warmup, steps, seconds)
    em = evaluate(n)
    print(f"drafter done: {n} steps, held-out loss {em['base']:.3f} tf_acc_len {em['tf_acc_len']:.2f} "
          f"acc {[round(a, 2) for a in em['acc']]} ({time.monotonic() - start:.0f}s)", flush=True)
    log["total_steps"], log["seconds"] = n, round(time.monotonic() - start, 1)
    return n
