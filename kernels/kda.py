"""Kimi Delta Attention through flash-linear-attention's Triton kernels (fla-core), in the layouts
of dflash_batch/models/layers/kda.py, whose torch functions they must equal:

    q, k [*B, T, H, K] (L2-normalised, not scaled), v [*B, T, H, V], g [*B, T, H, K] (log decay),
    beta [*B, T, H], state [*B, H, K, V] float32 or None -> (o [*B, T, H, V] float32, new state)

`recurrent` (verify and the replay commit: a few rows, any batch) is fla's fused recurrent
kernel, which also runs on the CPU under TRITON_INTERPRET=1; `chunked` (prefill: one sequence,
thousands of rows) is fla's chunked kernel, autotuned, so CUDA only. fla is imported at first use:
machines without it never import it (`available`).
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def available() -> bool:
    """fla-core is installed (asked once: the model asks on every KDA layer's forward)."""
    return importlib.util.find_spec("fla") is not None


def _fla_layout(single: bool, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fla takes contiguous float32 [B, T, ...]: a single sequence [T, ...] gets a batch dim of 1."""
    return tuple((x.unsqueeze(0) if single else x).to(torch.float32).contiguous() for x in xs)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    single = q.dim() == 3
    q, k, v, g, beta = _fla_layout(single, q, k, v, g, beta)
    if state is None:
        state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    else:
        state, = _fla_layout(single, state)
    # The kernel reads the start state and writes the final one to a new tensor (the caller
    # decides whether it is committed); o is written in float32, as the torch path returns it.
    out, final = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                         inplace_final_state=False, out=torch.empty_like(v))
    return (out[0], final[0]) if single else (out, final)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence [T, H, .] from `state` [H, K, V]."""
    from fla.ops.kda import chunk_kda

    q, k, v, g, beta = _fla_layout(True, q, k, v, g, beta)
    initial = None if state is None else _fla_layout(True, state)[0]
    out, final = chunk_kda(q, k, v, g, beta, initial_state=initial, output_final_state=True)
    return out[0], final[0]
