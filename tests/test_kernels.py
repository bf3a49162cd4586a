"""kernels/: every Triton kernel equals its torch reference (on the CPU under TRITON_INTERPRET=1,
fixed configs), on random inputs with odd sizes and padding rows; coins are uniform and the
sampler's draw for a row never depends on the rows around it."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import kstest

from dflash_batch.kernels import _triton
from dflash_batch.kernels.accept import accept_torch, accept_triton
from dflash_batch.kernels.coins import coins
from dflash_batch.kernels.prepare import prepare_torch, prepare_triton
from dflash_batch.kernels.sample import sample_torch, sample_triton
from dflash_batch.kernels.scatter import scatter_torch, scatter_triton

needs_triton = pytest.mark.skipif(not _triton.available(), reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- coins -----------------------------------------------------------------------------------------
def test_coins_are_uniform_and_independent_of_neighbours():
    along_positions = coins(torch.tensor(12345), torch.arange(100_000))
    along_seeds = coins(torch.arange(100_000) * 7919, torch.tensor(3))
    for u in (along_positions, along_seeds):
        assert kstest(u.numpy(), "uniform").pvalue > 1e-3
        assert 0 <= float(u.min()) and float(u.max()) < 1
    # consecutive positions are not correlated
    assert abs(float(torch.corrcoef(torch.stack([along_positions[:-1], along_positions[1:]]))[0, 1])) < 0.02
    # seeds span 63 bits: high bits matter
    assert not torch.equal(coins(torch.tensor(1 << 40), torch.arange(8)), coins(torch.tensor(0), torch.arange(8)))


# -- sampling --------------------------------------------------------------------------------------
def filtered_logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Scaled logits with about a third of each row filtered out (-inf), as top-k/top-p leave them."""
    g = gen(seed)
    logits = 2 * torch.randn(n, vocab, generator=g)
    drop = torch.rand(n, vocab, generator=g) < 0.3
    drop[torch.arange(n), logits.argmax(-1)] = False
    return logits.masked_fill(drop, float("-inf"))


@needs_triton
@pytest.mark.parametrize("vocab", [1, 7, 100, 1029])
def test_sample_triton_equals_torch(vocab):
    n = 67
    logits = filtered_logits(n, vocab, vocab)
    seed = torch.randint(0, 2**62, (n,), generator=gen(1))
    position = torch.randint(0, 131072, (n,), generator=gen(2))
    want = sample_torch(logits, seed, position)
    got = sample_triton(logits.to(DEVICE), seed.to(DEVICE), position.to(DEVICE), block=128).cpu()
    assert torch.equal(got, want)
    assert not torch.isinf(logits.gather(1, want[:, None])).any(), "a filtered-out token was drawn"


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_sample_depends_only_on_the_row_seed_and_position(impl):
    sample = sample_torch if impl == "torch" else sample_triton
    vocab = 300
    row = filtered_logits(1, vocab, 5)
    seed, position = torch.tensor([987654321]), torch.tensor([4242])
    alone = sample(row.to(DEVICE), seed.to(DEVICE), position.to(DEVICE)).cpu()
    for batch, where, neighbours in ((5, 0, 11), (5, 4, 12), (33, 17, 13)):
        logits = filtered_logits(batch, vocab, neighbours)
        logits[where] = row[0]
        seeds = torch.randint(0, 2**62, (batch,), generator=gen(neighbours))
        positions = torch.randint(0, 9999, (batch,), generator=gen(neighbours + 1))
        seeds[where], positions[where] = seed, position
        got = sample(logits.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE)).cpu()
        assert got[where] == alone[0], (batch, where)


def test_sample_follows_the_softmax():
    vocab, draws = 6, 60_000
    logits = torch.tensor([[1.0, 0.0, float("-inf"), 2.0, -1.0, 0.5]]).expand(draws, vocab)
    got = sample_torch(logits, torch.full((draws,), 77), torch.arange(draws))
    counts = torch.bincount(got, minlength=vocab).double()
    expected = torch.softmax(logits[0].double(), 0) * draws
    assert counts[2] == 0
    keep = expected > 0
    assert float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()) < 20.5  # chi2(4) p ~ 4e-4


# -- acceptance ------------------------------------------------------------------------------------
def acceptance_case(n: int, B: int, seed: int):
    """Blocks whose drafts match the chosen tokens for a random prefix, random budgets (0 for
    padding rows, 1 near the end), and stop tokens that sometimes land inside the kept part."""
    g = gen(seed)
    vocab = 12
    chosen = torch.randint(0, vocab, (n, B), generator=g)
    ids = torch.randint(0, vocab, (n, B), generator=g)
    prefix = torch.randint(0, B, (n,), generator=g)
    for r in range(n):
        ids[r, 1:1 + prefix[r]] = chosen[r, :prefix[r]]
    budget = torch.randint(0, 2 * B, (n,), generator=g)
    budget[::5] = 0
    budget[1::7] = 1
    stop_ids = torch.randint(vocab - 3, vocab + 2, (n, 3), generator=g)
    stop_ids[::3] = -1
    pos = torch.randint(0, 1000, (n,), generator=g)
    return ids, chosen, pos, budget, stop_ids


@needs_triton
@pytest.mark.parametrize("n, B", [(1, 1), (37, 8), (13, 5), (64, 16)])
def test_accept_triton_equals_torch(n, B):
    ids, chosen, pos, budget, stop_ids = acceptance_case(n, B, n * B)
    ref = [t.clone() for t in (ids, pos, budget)]
    out_ref = torch.zeros(n, B + 2, dtype=torch.int64)
    acc_ref = accept_torch(ref[0], chosen, ref[1], ref[2], stop_ids, out_ref)
    dev = [t.clone().to(DEVICE) for t in (ids, pos, budget)]
    out = torch.zeros(n, B + 2, dtype=torch.int64, device=DEVICE)
    acc = accept_triton(dev[0], chosen.to(DEVICE), dev[1], dev[2], stop_ids.to(DEVICE), out)
    assert torch.equal(out.cpu(), out_ref)
    assert torch.equal(acc.cpu(), acc_ref)
    for got, want in zip(dev, ref):
        assert torch.equal(got.cpu(), want)


def test_accept_torch_by_definition():
    n, B = 50, 6
    ids, chosen, pos, budget, stop_ids = acceptance_case(n, B, 3)
    st = [t.clone() for t in (ids, pos, budget)]
    out = torch.zeros(n, B + 2, dtype=torch.int64)
    accepted = accept_torch(st[0], chosen, st[1], st[2], stop_ids, out)
    for r in range(n):
        d, c, room = ids[r, 1:].tolist(), chosen[r].tolist(), int(budget[r])
        a = 0
        while a < B - 1 and d[a] == c[a]:
            a += 1
        a = min(a, room)
        emit = c[:a + 1][:room]
        stops = [s for s in stop_ids[r].tolist() if s >= 0]
        cut = next((i for i, t in enumerate(emit) if t in stops), None)
        if cut is not None:
            emit = emit[:cut + 1]
        finished = 1 if cut is not None else (2 if room and len(emit) == room else 0)
        assert int(accepted[r]) == a
        assert out[r].tolist() == emit + [-1] * (B - len(emit)) + [len(emit), finished], r
        assert int(st[1][r]) == int(pos[r]) + len(emit)
        assert int(st[2][r]) == room - len(emit)
        assert int(st[0][r, 0]) == (emit[-1] if emit else int(ids[r, 0]))


# -- next-round inputs -----------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("n, B, page", [(1, 1, 16), (9, 8, 16), (21, 5, 3), (4, 16, 1)])
def test_prepare_triton_equals_torch(n, B, page):
    g = gen(n + B)
    P = 20
    tables = torch.randperm(n * P, generator=g).view(n, P)
    tables[::4] = -1  # padding rows
    pos = torch.randint(0, P * page - B, (n,), generator=g)
    budget = torch.randint(0, 3 * B, (n,), generator=g)
    ids = torch.randint(0, 99, (n, B), generator=g)
    want = prepare_torch(ids, pos, budget, tables, page, 98)
    got = prepare_triton(*(t.to(DEVICE) for t in (ids, pos, budget, tables)), page, 98)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)
    assert (want[2].view(n, B)[::4] == -1).all()


# -- cache scatter ---------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("shape", [(7,), (3, 33), (1, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_triton_equals_torch(shape, dtype):
    g = gen(sum(shape))
    slots_total, T = 50, 23
    cache = torch.randn(slots_total, *shape, generator=g).to(dtype)
    slots = torch.randperm(slots_total, generator=g)[:T]
    slots[::3] = -1
    values = torch.randn(T, *shape, generator=g)
    want = cache.clone()
    scatter_torch(want, slots, values)
    got = cache.clone().to(DEVICE)
    scatter_triton(got, slots.to(DEVICE), values.to(DEVICE), block=16)
    assert torch.equal(got.cpu(), want)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(want[untouched], cache[untouched])
