"""Per-row draft counts (engine/row_drafts.py): each row of a round verifies the drafts worth it.

The choice (`row_widths`) is the best tokens-a-second over every way rows can cut their drafts,
by brute force; the calibration counts a draft as a trial only where the drafts before it were
accepted. The ragged verify is lossless: with rows verifying scattered numbers of drafts (the
choice replaced by a pseudo-random one, so every layout shows up), greedy decoding is the target's
own, both families in float64, eager and captured (emulated graphs), and the schedule's stats
count the drafts each row verified. The job file's forms: {per_row: false}, and per_row refused
where it cannot act."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_batch.build import resolve_engine
from dflash_batch.engine import engine as engine_module
from dflash_batch.engine import round as round_module
from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.request import Request, SamplingParams
from dflash_batch.engine.row_drafts import (ALL, EDGES, FRESH, KINDS, MISSED, PRIOR, SOME, Calibration, kind_of,
                                            last_round, learn, round_params, row_widths)
from dflash_batch.engine.schedule import Schedule
from dflash_batch.job import JobError, parse_job
from dflash_batch.plan.buckets import plan_buckets
from dflash_batch.testing import kimi_pair
from tests import fake_flashinfer
from tests.emulated_graphs import EmulatedGraphs, refuse_host_syncs
from tests.engine_util import F64, bucket, pair_of_each_family, random_prompts, run

EDGE_TENSOR = torch.tensor(EDGES, dtype=torch.float32)


def seconds(drafts: int, size: int, costs: list[float]) -> float:
    """The curve through (size x k, costs[k - 1]), extended along its end pieces."""
    if len(costs) == 1:
        return costs[0]
    points = [(size * (k + 1), c) for k, c in enumerate(costs)]
    (x0, y0), (x1, y1) = next(((a, b) for a, b in zip(points, points[1:]) if drafts <= b[0]), points[-2:])
    return y0 + (drafts - x0) * (y1 - y0) / (x1 - x0)


def rate_of(widths: list[int], chance: list[list[float]], rows: int, size: int, costs: list[float]) -> float:
    drafts = sum(w - 1 for w in widths)
    tokens = rows + sum(sum(c[:w - 1]) for c, w in zip(chance, widths))
    return tokens / seconds(drafts, size, costs)


@pytest.mark.parametrize("seed", range(12))
def test_the_choice_is_the_best_rate_over_every_cut(seed):
    """Every way each row can verify its first j drafts (j up to what its budget allows), within
    `most` drafts in all, on a cost curve rising in steps of any size (flat: the most that fit):
    row_widths reaches the best rate there is among those where every row with a draft to verify
    verifies its first (the `most` likeliest first drafts where `most` is fewer). Padding rows
    (budget 0) and rows with one token left verify none."""
    rng = random.Random(seed)
    n, D = rng.randint(1, 4), rng.randint(1, 3)
    probs = torch.tensor([[rng.random() for _ in range(D)] for _ in range(n)], dtype=torch.float32)
    budget = torch.tensor([rng.choice([0, 1, 2, 3, 9, 9]) for _ in range(n)])
    kinds = torch.tensor([rng.randrange(KINDS) for _ in range(n)])
    calibration = Calibration()
    calibration.hits = [rng.random() * 5 for _ in calibration.hits]
    calibration.trials = [h + rng.random() * 5 for h in calibration.hits]
    size = rng.randint(n, 6)
    flat = seed % 3 == 0  # a draft costs nothing: the most that fit
    costs = list(itertools.accumulate(rng.uniform(1.0, 2.0) if k == 0 else 0.0 if flat else rng.uniform(0, 0.6)
                                      for k in range(D)))
    most = rng.randint(0, n * D)
    params = torch.tensor(round_params(calibration, size, costs), dtype=torch.float64)
    with refuse_host_syncs():  # a captured round runs it
        widths = row_widths(probs, budget, kinds, EDGE_TENSOR, params, most)
    got = widths.tolist()

    rates = calibration.rates()
    chance = []
    for row, kind in zip(probs.tolist(), kinds.tolist()):  # P(drafts 1..j accepted): the product of their rates
        product, c = 1.0, []
        for p in row:
            product *= rates[sum(e <= p for e in EDGES) + kind * (len(EDGES) + 1)]
            c.append(product)
        chance.append(c)
    rows = int((budget > 0).sum())
    rooms = [max(0, min(D, b - 1)) for b in budget.tolist()]
    firsts = min(most, sum(r > 0 for r in rooms))
    cuts = [w for w in itertools.product(*(range(1, r + 2) for r in rooms)) if sum(w) - n <= most
            and sum(x > 1 for x in w) == firsts and (firsts == most or all(x > 1 for x, r in zip(w, rooms) if r))]
    best = max(rate_of(list(w), chance, rows, size, costs) for w in cuts)
    assert all(1 <= w <= r + 1 for w, r in zip(got, rooms)) and sum(got) - n <= most, (got, rooms, most)
    assert rate_of(got, chance, rows, size, costs) == pytest.approx(best, rel=1e-6)
    if flat:
        assert sum(got) - n == min(most, sum(rooms))


def test_the_calibration_counts_a_draft_once_those_before_it_were_accepted():
    """A row that verified 3 drafts and kept 1 is a trial of drafts 1 and 2 (1 accepted), not of
    draft 3; one that kept all 3 of 3 is a trial of each; a sampling row's trials go to its own
    bins. Each bin's estimate leans on the drafter's own probability (the bin's mid-point) with
    PRIOR trials' weight."""
    calibration = Calibration()
    calibration.record([[0.97, 0.55, 0.01], [0.97, 0.97, 0.97], [0.97, 0.55, 0.2]], [3, 3, 2], [1, 3, 0],
                       [kind_of(False, FRESH), kind_of(False, FRESH), kind_of(True, FRESH)])
    bin_of = {p: sum(e <= p for e in EDGES) for p in (0.97, 0.55, 0.2, 0.01)}
    sampling = len(EDGES) + 1  # a sampling row's bins come after the greedy rows'
    assert calibration.trials[bin_of[0.97]] == 4 and calibration.hits[bin_of[0.97]] == 4
    assert calibration.trials[bin_of[0.55]] == 1 and calibration.hits[bin_of[0.55]] == 0
    assert calibration.trials[bin_of[0.01]] == 0
    assert calibration.trials[sampling + bin_of[0.97]] == 1 and calibration.hits[sampling + bin_of[0.97]] == 0
    assert sum(calibration.trials[sampling:]) == 1
    mid = calibration.mids[bin_of[0.55]]
    assert calibration.rates()[bin_of[0.55]] == pytest.approx(PRIOR * mid / (1 + PRIOR))
    assert calibration.rates()[bin_of[0.97]] == pytest.approx((4 + PRIOR * 0.965) / (4 + PRIOR))
    assert calibration.rates()[sampling + bin_of[0.97]] == pytest.approx(PRIOR * 0.965 / (1 + PRIOR))


def test_a_rows_last_round_picks_its_bins():
    """learn files each row's trials under its kind when it chose (whether it samples, what its
    last round that verified drafts kept), then makes this round its last: a round of no drafts
    leaves it; a row starting in the batch is FRESH again."""
    assert [last_round(a, v, SOME) for a, v in ((0, 0), (0, 3), (1, 3), (3, 3), (2, 2))] == [SOME, MISSED, SOME, ALL, ALL]
    assert len({kind_of(s, last) for s in (0, 1) for last in (FRESH, MISSED, SOME, ALL)}) == KINDS
    batch = DecodeBatch(3, 4, 2, 16, 3, "cpu", 32)
    batch.draft_probs[:3] = torch.tensor([[0.97, 0.97, 0.97], [0.97, 0.55, 0.2], [0.55, 0.55, 0.55]])
    batch.draft_last[:3] = torch.tensor([ALL, FRESH, MISSED])
    seqs = [SimpleNamespace(row=r, params=SamplingParams(temperature=t)) for r, t in ((0, 0.0), (1, 1.0), (2, 0.0))]
    calibration = Calibration()
    learn(calibration, batch, [(3, 3, seqs[0]), (0, 2, seqs[1]), (0, 0, seqs[2])])
    bins = len(EDGES) + 1
    top = sum(e <= 0.97 for e in EDGES)
    assert calibration.trials[kind_of(0, ALL) * bins + top] == 3  # row 0: three trials of its kind's top bin
    assert calibration.trials[kind_of(1, FRESH) * bins + top] == 1  # row 1: draft 1, missed
    assert sum(calibration.trials) == 4 and sum(calibration.hits) == 3
    assert batch.draft_last.tolist() == [ALL, MISSED, MISSED]
    seq = SimpleNamespace(params=SamplingParams(), tokens=[5], prompt=[5], position=1, pages=[0], row=0, matcher=None)
    batch.put(0, seq)
    assert batch.draft_last[0] == FRESH


def scattered_widths(probs: torch.Tensor, budget: torch.Tensor, kinds: torch.Tensor, edges: torch.Tensor,
                     params: torch.Tensor, most: int) -> torch.Tensor:
    """A stand-in for row_widths: each row 1 .. W rows by its drafts' probabilities' bits and its
    place (W: the widest the round's rows may average), within what its budget allows.
    Graph-safe, as the real one."""
    n, D = probs.shape
    widest = most // n + 1
    w = 1 + ((probs.double() * 9973).long().sum(1) + torch.arange(n)) % widest
    return torch.minimum(w, (budget - 1).clamp(0, D) + 1)


@pytest.fixture
def ragged(monkeypatch):
    ragged_rounds(monkeypatch)


def ragged_rounds(monkeypatch) -> None:
    """Auto buckets whose rounds go per row with scattered widths, every round (the schedule's k
    held at the block's, so no round is target-only) and never stop speculating; a failed round
    fails the test (the engine would otherwise redo its sequences one at a time)."""
    monkeypatch.setattr(round_module, "row_widths", scattered_widths)
    monkeypatch.setattr(Schedule, "drafts", lambda self, n: self.block - 1 if self.pinned is None else self.pinned)
    monkeypatch.setattr(Schedule, "time_rounds",
                        lambda self, run: setattr(self, "costs", {s: [1.0] * self.block for s in self.sizes}))
    monkeypatch.setattr(Schedule, "pays_nowhere", lambda self: False)
    monkeypatch.setattr(Schedule, "below_floor", lambda self: False)

    def fail(self, error, *args):
        raise error
    monkeypatch.setattr(Engine, "_recover", fail)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return pair_of_each_family(tmp_path_factory.mktemp("rows"))


def verified_counts(engine: Engine) -> Counter:
    (schedule,) = engine.schedules.values()
    return Counter({int(k): c for k, c in schedule.stats()["drafts_verified"]["per row"].items()})


@pytest.mark.numerics
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_ragged_rounds_decode_as_the_target_alone(pairs, ragged, monkeypatch, family, graphs):
    """Rows verifying scattered numbers of drafts, in one packed verify (eager: exactly the rows
    chosen; captured: the round's fixed n x W rows, the rest masked), decode greedily as the
    target does alone; every count 0 .. 7 shows up, and the stats count them."""
    target, drafter = pairs[family]
    vocab = kimi_pair.VOCAB if family == "kimi" else 8
    prompts = random_prompts([40, 3, 90, 17, 60, 8, 25, 5], vocab=vocab, seed=7)
    want = [c.token_ids for c in run(Engine(target, None, dtype=F64), prompts, bucket(max_num_seqs=4), max_new_tokens=32)]
    options = {}
    if graphs:
        monkeypatch.setattr(engine_module, "RoundGraphs", EmulatedGraphs)
        options = {"cuda_graphs": True, "capture_sizes": [4]}
    engine = Engine(target, drafter, dtype=F64, **options)
    got = run(engine, prompts, bucket(max_num_seqs=4, speculation="auto"), max_new_tokens=32)
    assert [c.token_ids for c in got] == want
    counts = verified_counts(engine)
    assert set(counts) == set(range(8)), counts
    assert sum(counts.values()) == sum(c.spec.rounds for c in got) - len(got)  # less each one's last round
    # The calibration learnt from those rounds: one trial a sequence-round at least (draft 1's).
    (schedule,) = engine.schedules.values()
    assert sum(schedule.calibration.trials) >= sum(counts.values()) - counts[0]
    assert sum(c.spec.accepted for c in got) > 0


@pytest.mark.numerics
def test_ragged_rounds_on_flashinfer_decode_as_the_target_alone(ragged, monkeypatch, tmp_path):
    """flashinfer lays a round out on the host: an eager ragged verify is planned after its draft,
    each row its own query count (its MLA wrapper emulated: tests/fake_flashinfer.py). The tiny
    Kimi-K3 + DFlash2-MLA pair decodes greedily and sampled as the torch backend's target alone."""
    fake_flashinfer.install(monkeypatch)
    from dflash_batch.backends.flashinfer_attention import FlashInferAttention

    # A window of 10: flashinfer's takes no window shorter than the block.
    target, drafter = kimi_pair.load_pair(*kimi_pair.make_kimi_pair(tmp_path, window=10), F64)
    prompts = random_prompts([40, 3, 90, 17, 8], vocab=kimi_pair.VOCAB, seed=5)
    for sampling in (dict(), dict(temperature=1.0, top_p=0.9)):
        want = run(Engine(target, None, dtype=F64), prompts, bucket(max_num_seqs=4), max_new_tokens=24, **sampling)
        engine = Engine(target, drafter, dtype=F64, attention=FlashInferAttention("cpu", workspace_bytes=1024))
        got = run(engine, prompts, bucket(max_num_seqs=4, speculation="auto"), max_new_tokens=24, **sampling)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert len(verified_counts(engine)) >= 5, verified_counts(engine)


@pytest.mark.numerics
@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_ragged_rounds_sample_as_the_target_alone(pairs, ragged, family):
    """Rows of mixed sampling settings (temperatures, top-k/p, min-p, penalties, stop ids) verifying
    scattered counts: each emitted token is the target's seeded sample at its position, so the
    outputs are target-only decoding's at the same seeds (float64)."""
    target, drafter = pairs[family]
    vocab = kimi_pair.VOCAB if family == "kimi" else 8
    settings = [dict(temperature=1.0, repetition_penalty=1.4), dict(frequency_penalty=0.6, presence_penalty=0.9),
                dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8, presence_penalty=0.5),
                dict(temperature=1.5, min_p=0.2, stop_token_ids=(3,)), dict()]
    prompts = random_prompts([5, 31, 12, 2, 47, 9], vocab=vocab, seed=8)
    reqs = [Request((str(i), 0), p, SamplingParams(max_new_tokens=30, seed=900 + i, **s))
            for i, (p, s) in enumerate(zip(prompts, settings))]
    want = {c.key: c.token_ids for c in Engine(target, None, dtype=F64).generate(iter(reqs), bucket(max_num_seqs=4))}
    engine = Engine(target, drafter, dtype=F64)
    got = {c.key: c.token_ids for c in engine.generate(iter(reqs), bucket(max_num_seqs=4, speculation="auto"))}
    assert got == want
    assert len(verified_counts(engine)) >= 5, verified_counts(engine)


@pytest.fixture(scope="module")
def demo_pair():
    """The demo's trained Kimi-K3 pair (jobs/demo/models) in float64: its drafts are mostly accepted,
    so rounds keep whole rows, the case random pairs rarely reach."""
    from dflash_batch.engine.pair import attach_drafter
    from dflash_batch.models.loader import load_model
    from dflash_batch.tokenizer import Tokenizer

    models = Path(__file__).resolve().parent.parent / "jobs/demo/models"
    target, drafter = load_model(models / "target", F64), load_model(models / "drafter", F64)
    attach_drafter(target, drafter)
    tok = Tokenizer(models / "target")
    lines = (models.parent / "prompts.jsonl").read_text().splitlines()[:6]
    prompts = tok.encode_batch([tok.render_chat(json.loads(line)["messages"], {}) for line in lines], False)
    return target, drafter, prompts


@pytest.mark.numerics
@pytest.mark.parametrize("speculation, drafts", [("auto", None), (True, 3)], ids=["per row", "pinned 3"])
def test_rounds_that_keep_whole_rows_decode_as_the_target_alone(demo_pair, ragged, speculation, drafts):
    """The trained pair, where sequences keep every draft they verify: Kimi-K3's recurrent layers
    commit exactly the rows kept (eagerly per row, each sequence only its own; pinned, the round's
    width), so greedy decoding is the target's alone; a fifth of the rounds at least keep every
    draft they verify (two or more)."""
    target, drafter, prompts = demo_pair
    want = [c.token_ids for c in run(Engine(target, None, dtype=F64), prompts, bucket(max_num_seqs=4), max_new_tokens=40)]
    engine = Engine(target, drafter, dtype=F64)
    got = run(engine, prompts, bucket(max_num_seqs=4, speculation=speculation, drafts=drafts), max_new_tokens=40)
    assert [c.token_ids for c in got] == want
    rounds = [(a, v) for c in got for a, v in zip(c.spec.per_round, c.spec.verified)]
    assert sum(a == v >= 2 for a, v in rounds) > len(rounds) / 5, rounds


@pytest.mark.numerics
def test_per_row_off_and_pinned_verify_one_k_for_every_row(pairs, ragged):
    """{per_row: false} (Bucket.per_row False) and {drafts: K} verify one number a round:
    no per-row round, and a pinned bucket's rows each verify K (a sequence's last round cut)."""
    target, drafter = pairs["qwen3"]
    prompts = random_prompts([40, 3, 90, 17], vocab=8, seed=3)
    for spec in (bucket(max_num_seqs=4, speculation="auto"), bucket(max_num_seqs=4, drafts=3)):
        spec = spec.__class__(**{**spec.__dict__, "per_row": False}) if spec.drafts is None else spec
        engine = Engine(target, drafter, dtype=F64)
        run(engine, prompts, spec, max_new_tokens=30)
        stats = next(iter(engine.schedules.values())).stats()
        assert not stats["drafts_verified"]["per row"] and not stats["per_row"]
        if spec.drafts is not None:
            assert set(map(int, stats["drafts_verified"]["one k"])) <= set(range(4))
            assert Counter(stats["drafts_verified"]["one k"]).most_common(1)[0][0] == "3"


def job(pairs_dir: Path, speculation, pp: int = 1, **engine):
    doc = {"input": {"paths": ["x.jsonl"], "prompt_column": "p"},
           "model": {"target": str(pairs_dir / "target"), "drafter": str(pairs_dir / "drafter"),
                     "pipeline_parallel_size": pp, "dtype": "bfloat16"},
           "engine": {"max_model_len": 256, **engine}, "buckets": [{"max_tokens": 256, "speculation": speculation}],
           "output": {"dir": "o"}}
    return parse_job(doc, Path("job.yaml"))


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    """config.json of a Qwen3 target and a DFlash drafter flashinfer takes (what resolve_engine reads)."""
    d = tmp_path_factory.mktemp("pair")
    for name, config in (("target", {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128}),
                         ("drafter", {"architectures": ["DFlashDraftModel"], "head_dim": 128,
                                      "dflash_config": {"block_size": 8}})):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(config))
    return d


def test_the_job_file_forms(pair_dir):
    """auto is per row; {per_row: false} is auto with one k a round; {drafts: K, per_row: ..} is
    refused (a pinned K is every row's); per_row true is refused where rounds cannot be ragged
    (pipeline stages; flashinfer under CUDA graphs, which plans a captured round before its
    drafts exist, but not flashinfer eager), which auto then runs with one k a round, as the
    engine line says."""
    (auto,) = plan_buckets(job(pair_dir, "auto"))
    (one_k,) = plan_buckets(job(pair_dir, {"per_row": False}))
    assert (auto.speculation, auto.per_row) == ("auto", True)
    assert (one_k.speculation, one_k.per_row) == ("auto", False)
    with pytest.raises(JobError, match="speculation"):
        job(pair_dir, {"drafts": 3, "per_row": True})
    assert resolve_engine(job(pair_dir, "auto"), cuda=False).per_row
    eager_flashinfer = resolve_engine(job(pair_dir, "auto", cuda_graphs=False), cuda=True, flashinfer=True, triton=False)
    assert eager_flashinfer.backend == "flashinfer" and eager_flashinfer.per_row
    graphs = resolve_engine(job(pair_dir, "auto"), cuda=True, flashinfer=True, triton=False)
    assert graphs.backend == "flashinfer" and graphs.cuda_graphs and not graphs.per_row
    with pytest.raises(JobError, match=r"per_row: true.*flashinfer lays a captured round"):
        resolve_engine(job(pair_dir, {"per_row": True}), cuda=True, flashinfer=True, triton=False)
    staged = job(pair_dir, "auto", pp=2)
    setup = resolve_engine(staged, cuda=False)
    assert not setup.per_row and "per_row_drafts=off" in setup.describe()
    with pytest.raises(JobError, match=r"per_row: true.*pipeline stages"):
        resolve_engine(job(pair_dir, {"per_row": True}, pp=2), cuda=False)
