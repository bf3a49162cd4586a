"""Phase 1: next-token training of the Kimi-K3-architecture target on the synthetic data.

The loss is next-token CE over every real token (questions too: the model is a plain LM; the
random names and numbers there are simply unpredictable). The log also tracks the response-only
loss, the part a demo job generates. The latent MoE's router bias is balanced the way
DeepSeek-V3's noaux_tc is: not by gradient but by a fixed step toward equal expert load after
every batch (overloaded experts' bias down, underloaded up).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from recipes.demo import schedule, target_forward
from recipes.demo.batches import Batch, BatchMaker

ROUTER_BIAS_RATE = 1e-2


def balance_router(moe_inputs: list, valid: torch.Tensor, rate: float = ROUTER_BIAS_RATE) -> None:
    with torch.no_grad():
        for moe, h in moe_inputs:
            x = h.reshape(-1, h.shape[-1])[valid.reshape(-1)]
            scores = torch.sigmoid(F.linear(x.float(), moe.gate.weight.float()))
            ids = torch.topk(scores + moe.gate.e_score_correction_bias, moe.top_k, dim=-1).indices
            load = torch.bincount(ids.reshape(-1), minlength=scores.shape[-1]).float()
            moe.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def losses(model, batch: Batch, moe_inputs: list | None = None) -> tuple[torch.Tensor, dict]:
    logits, _ = target_forward.forward(model, batch.ids, moe_inputs=moe_inputs)
    S = batch.ids.shape[1]
    pos = torch.arange(S - 1)
    real = pos[None] < (batch.lengths[:, None] - 1)              # predicting a real next token
    response = real & (pos[None] + 1 >= batch.resp_start[:, None])
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch.ids[:, 1:].reshape(-1),
                         reduction="none").view(real.shape)
    loss = (ce * real).sum() / real.sum()
    with torch.no_grad():
        hit = (logits[:, :-1].argmax(-1) == batch.ids[:, 1:]) & response
        metrics = dict(loss=loss.item(), response_loss=((ce * response).sum() / response.sum()).item(),
                       response_acc=(hit.sum() / response.sum()).item())
    return loss, metrics


def train(model, maker: BatchMaker, batch_size: int, lr: float, warmup: int, steps: int | None,
          seconds: float | None, eval_every: int, log: dict) -> int:
    optim = schedule.adamw(model, lr)
    eval_batch = maker.batch(0, batch_size, stream=1)
    history, evals, start = log.setdefault("steps", []), log.setdefault("eval", []), time.monotonic()

    def step_fn(step: int, step_lr: float) -> None:
        batch = maker.batch(step, batch_size)
        for group in optim.param_groups:
            group["lr"] = step_lr
        moe_inputs = []
        loss, m = losses(model, batch, moe_inputs)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        balance_router(moe_inputs, torch.arange(batch.ids.shape[1])[None] < batch.lengths[:, None])
        history.append(dict(step=step, lr=step_lr, t=round(time.monotonic() - start, 2), **m))
        if eval_every and (step % eval_every == 0):
            with torch.no_grad():
                _, em = losses(model, eval_batch)
            evals.append(dict(step=step, **em))
            print(f"target step {step}: loss {m['loss']:.3f} | held-out loss {em['loss']:.3f} "
                  f"response {em['response_loss']:.3f} acc {em['response_acc']:.3f} "
                  f"({time.monotonic() - start:.0f}s)", flush=True)

    n = schedule.run_phase(step_fn, lr, warmup, steps, seconds)
    with torch.no_grad():
        _, em = losses(model, eval_batch)
    evals.append(dict(step=n, **em))
    print(f"target done: {n} steps, held-out loss {em['loss']:.3f} response {em['response_loss']:.3f} "
          f"acc {em['response_acc']:.3f} ({time.monotonic() - start:.0f}s)", flush=True)
    log["total_steps"], log["seconds"] = n, round(time.monotonic() - start, 1)
    return n
