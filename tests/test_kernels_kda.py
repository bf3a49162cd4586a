"""kernels/kda.py: fla's fused recurrent KDA kernel (on the CPU under TRITON_INTERPRET=1) in our
layouts == the torch delta rule of models/layers/kda.py run in float64; rows with no decay and no
write (g = 0, beta = 0: how the replay commit masks rejected rows) leave the state as the
accepted prefix left it, to the bit. chunk_kda (prefill) is autotuned and runs on a GPU only:
tests/test_gpu.py checks it there."""

from __future__ import annotations

import pytest
import torch

from dflash_batch.kernels import _triton
from dflash_batch.kernels import kda as fla_kda
from dflash_batch.models.layers.kda import kda_recurrent, l2norm
from tests.numerics import assert_close

pytestmark = [pytest.mark.numerics, pytest.mark.skipif(
    not (fla_kda.available() and _triton.available()), reason="fla-core or Triton is not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, K, V = 3, 32, 16  # head dims below the kernel's 32-wide value tile: a masked tile


def inputs(*batch: int, T: int, seed: int, lower_bound: float = -5.0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(*batch, T, H, K, generator=gen)) for _ in range(2))
    v = torch.randn(*batch, T, H, V, generator=gen)
    g = lower_bound * torch.rand(*batch, T, H, K, generator=gen)  # Kimi-K3's gate: (lower_bound, 0)
    beta = torch.rand(*batch, T, H, generator=gen)
    state = torch.randn(*batch, H, K, V, generator=gen)
    return q, k, v, g, beta, state


def on_device(*xs: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if x is None else x.to(DEVICE) for x in xs]


@pytest.mark.parametrize("batch", [(), (4,)], ids=["one", "batched"])
@pytest.mark.parametrize("T", [1, 8, 33])
@pytest.mark.parametrize("fresh", [False, True], ids=["state", "zeros"])
def test_recurrent_equals_torch_in_float64(batch, T, fresh):
    q, k, v, g, beta, state = inputs(*batch, T=T, seed=T)
    state = None if fresh else state
    want_o, want_S = kda_recurrent(*(x.double() for x in (q, k, v, g, beta)), None if fresh else state.double())
    o, S = fla_kda.recurrent(*on_device(q, k, v, g, beta, state))
    assert o.dtype == S.dtype == torch.float32 and o.shape == want_o.shape and S.shape == want_S.shape
    assert_close(o.cpu().double(), want_o, rel=1e-5)
    assert_close(S.cpu().double(), want_S, rel=1e-5)


def test_bfloat16_inputs():
    q, k, v, g, beta, state = inputs(2, T=8, seed=1)
    v = v.bfloat16()
    want_o, want_S = kda_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(), state.double())
    o, S = fla_kda.recurrent(*on_device(q, k, v, g, beta, state))
    assert o.dtype == torch.float32
    assert_close(o.cpu().double(), want_o, rel=1e-5)
    assert_close(S.cpu().double(), want_S, rel=1e-5)


def test_masked_rows_keep_the_prefix_state():
    """Sequence b keeps its first kept[b] rows; the rest replay with g = 0 and beta = 0."""
    q, k, v, g, beta, state = inputs(4, T=8, seed=2)
    kept = torch.tensor([1, 3, 8, 5])
    live = torch.arange(8) < kept[:, None]
    g_m, beta_m = torch.where(live[..., None, None], g, 0), torch.where(live[..., None], beta, 0)
    _, S = fla_kda.recurrent(*on_device(q, k, v, g_m, beta_m, state))
    for b, n in enumerate(kept.tolist()):
        _, prefix = fla_kda.recurrent(*on_device(q[b, :n], k[b, :n], v[b, :n], g[b, :n], beta[b, :n], state[b]))
        assert torch.equal(S[b], prefix), b
