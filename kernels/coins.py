"""Per-token random coins from a counter-based hash: coin(seed, position) in [0, 1).

A sequence's coin for the token at `position` depends only on its own seed and that position:
not on the batch it runs in, its row in that batch, its neighbours, or how many coins were drawn
before (a generator's stream would depend on all of that). The same bits come out of the torch
and the Triton versions, so a kernel and its reference sample the same token.

The hash is a chain of 32-bit xorshift-multiply mixers (Wellons' "lowbias32" shape) on int64
lanes kept below 2**32; both multipliers are odd and below 2**31, so no product overflows int64.
"""

from __future__ import annotations

import torch

from dflash_batch.kernels._triton import jit, tl

M32 = 0xFFFFFFFF
MUL1, MUL2 = 0x7FEB352D, 0x1B873593
SALT = 0x9E3779B9  # keeps seed 0 away from the mixer's fixed point at 0
SCALE = 2.0 ** -24  # 24 random bits: every coin is an exact float32 in [0, 1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * MUL1) & M32
    x = x ^ (x >> 15)
    x = (x * MUL2) & M32
    return x ^ (x >> 16)


def coin_bits(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """32 hashed bits (int64) for each (seed, position); seed >= 0 int64, position int64."""
    seed, position = torch.broadcast_tensors(seed.to(torch.int64), position.to(torch.int64))
    h = _mix32(((seed >> 32) & M32) ^ SALT)
    h = _mix32(h ^ (seed & M32))
    return _mix32(h ^ (position & M32))


def coins(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1), one per (seed, position)."""
    return (coin_bits(seed, position) >> 8).to(torch.float32) * SCALE


@jit
def mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & 0xFFFFFFFF
    return x ^ (x >> 16)


@jit
def coin(seed, position):
    """The Triton twin of `coins` for int64 scalars or blocks."""
    h = mix32(((seed >> 32) & 0xFFFFFFFF) ^ 0x9E3779B9)
    h = mix32(h ^ (seed & 0xFFFFFFFF))
    h = mix32(h ^ (position & 0xFFFFFFFF))
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08
