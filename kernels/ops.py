"""dflash-batch's own Triton kernels, each beside the plain torch function it must equal.

    coins.py    per-token coins hashed from (seed, position)
    sample.py   seeded sampling from filtered logits
    accept.py   acceptance (longest matching prefix + bonus, stop tokens, budgets) and the next anchor
    prepare.py  a round's positions, cache slots and draft ids from the decoding state
    scatter.py  paged K/V and latent cache writes, slot -1 skipped
    attn_res.py Kimi-K3's block attention residual mix
    moe_mxfp4.py routed MoE experts (SiTU) straight from MXFP4 weights
    kda.py      Kimi Delta Attention through flash-linear-attention's kernels (fla-core; its torch
                twins are in dflash_batch/models/layers/kda.py, which picks them: `kda_kernels`)

`for_device(device)` picks the Triton versions on CUDA devices (when Triton is installed) and
the torch references everywhere else; tests run the Triton versions on CPU under
TRITON_INTERPRET=1. The package is imported as `dflash_batch.kernels` (the folder stays at the
repository's top level, linked from dflash_batch/), and it has no __init__.py: a top-level
`import kernels` is never this folder's, so Hugging Face's `kernels` package keeps its name.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dflash_batch.kernels import _triton
from dflash_batch.kernels.accept import accept_torch, accept_triton
from dflash_batch.kernels.attn_res import attn_res_torch, attn_res_triton
from dflash_batch.kernels.moe_mxfp4 import moe_mxfp4_torch, moe_mxfp4_triton
from dflash_batch.kernels.prepare import prepare_torch, prepare_triton
from dflash_batch.kernels.sample import sample_torch, sample_triton
from dflash_batch.kernels.scatter import scatter_torch, scatter_triton

TORCH = SimpleNamespace(name="torch", sample=sample_torch, accept=accept_torch, prepare=prepare_torch,
                        scatter=scatter_torch, attn_res=attn_res_torch, moe_mxfp4=moe_mxfp4_torch)
TRITON = SimpleNamespace(name="triton", sample=sample_triton, accept=accept_triton, prepare=prepare_triton,
                         scatter=scatter_triton, attn_res=attn_res_triton, moe_mxfp4=moe_mxfp4_triton)


def for_device(device: torch.device | str) -> SimpleNamespace:
    return TRITON if torch.device(device).type == "cuda" and _triton.available() else TORCH
