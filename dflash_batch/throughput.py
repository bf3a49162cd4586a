"""What a job's rounds can reach on a named GPU: each bucket's three floors (plan/roofline.py) in
the layout the job runs, for every number of drafts a round may verify, the one that binds, and
the draft count that gives the most tokens per second per GPU; beside it, the other layouts.

Each round's work is counted once for one sequence at each verify width (sizing.Sizer.work: the
engine's own round on the meta device) and scaled by the sequences. Layouts side by side, at the
best draft count of the one run: the job's tensor-parallel group with the MLA latents whole and
split (where they split), and pipeline stages across NVLink domains with tensor parallelism
inside each: each stage's part of the round counted on its own layers (models/stages.py), its
NIC carrying what it hands on (the rows' hidden states, Kimi-K3's attention-residual blocks and
the drafter's taps so far) and the last stage's results back; with one micro-batch (the stages
taking turns) and with as many micro-batches as stages (engine.micro_batches: groups of a
captured round, or interleaved lanes), the sequences assumed to fit as they do in the group; one
tensor-parallel group over all the job's GPUs where the job runs data-parallel groups; and
data-parallel groups a domain each with the routed experts whole over every GPU (DP x TP + EP:
each group's own rows, the dispatch's NIC bytes, a rank's routed FLOPs its share of every group's
routes times the hottest rank's imbalance), at the most sequences a group holds. Each row beside
the one run names a GPU's weights, caches and buffers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pathlib import Path

from dflash_batch.job import Job, JobError
from dflash_batch.plan.buckets import Bucket
from dflash_batch.plan.hardware import Hardware
from dflash_batch.plan.roofline import Floors, expected_tokens, floors, tokens_per_gpu
from dflash_batch.plan.work import Work
from dflash_batch.sizing import GB, Layout, Plan, Sizer, held_besides_buckets, largest_fitting

BOUND = ("floors a round, a rank's (ms): memory = bytes read / HBM peak, compute = FLOPs / dense peak, "
         "network = the longer of NVLink's and the NIC's collective bytes / bandwidth (ring algorithms: NCCL's "
         "NVLS moves about half NVLink's); a bound, not a prediction: the floors may overlap, and kernels run "
         "below their peaks")


@dataclass(frozen=True)
class RoundAt:
    """A round of `seqs` sequences verifying `k` drafts each, on one layout."""

    seqs: int
    k: int
    tokens: float     # a sequence's expected tokens a round
    floors: Floors
    per_gpu: float    # tokens/s a GPU, at the largest floor

    def row(self) -> str:
        f = self.floors
        return (f"{self.tokens:>7.2f} {1e3 * f.memory:>8.1f} {1e3 * f.compute:>8.1f} {1e3 * f.nvlink:>7.1f} "
                f"{1e3 * f.nic:>6.1f}  {f.binding:<8} {self.per_gpu:>10,.0f}")


ROUTED_FLOPS = "target routed experts"  # plan/work.py's component of the routed experts' FLOPs
# The hottest expert rank's tokens over the mean where no run's counts say: TRT-LLM's DeepSeek-R1 at
# EP32 after EPLB (../shared/reference/expert_parallel.md section 4: (max - mean) / mean 1.56 -> 0.11).
ASSUMED_IMBALANCE = 1.11
BETWEEN_STAGES = ("hand_off", "from_last_stage")  # parallel.py's traffic between pipeline stages: the NIC's
COLUMNS = f"{'tokens':>7} {'memory':>8} {'compute':>8} {'NVLink':>7} {'NIC':>6}  {'binds':<8} {'tok/s/GPU':>10}"


class Roofline:
    """The plan's roofline on `hw`, sequences accepting drafts as `alpha` says (alpha_1..), a
    group `per_domain` GPUs to an NVLink domain."""

    def __init__(self, plan: Plan, job: Job, job_dir: Path, hw: Hardware, alpha: list[float], per_domain: int,
                 imbalance: float = ASSUMED_IMBALANCE):
        self.plan, self.job, self.job_dir, self.hw, self.alpha = plan, job, job_dir, hw, alpha
        self.per_domain, self.dtype, self.imbalance = per_domain, job.model.dtype, imbalance
        self.works: dict[tuple[int, int, int], Work] = {}  # (sizer id, bucket index, width) -> one row's
        self.stage_sizers: list[Sizer] | None = None  # each pipeline stage's models at its TP size (staged)
        self.others: dict[str, Layout] = {}  # the layouts the job does not run, sized on the job's GPUs
        self.gpus = plan.tp * plan.runs.sizer.groups  # the GPUs of one of the job's tasks
        hw.peak(self.dtype)  # a GPU without a figure for the dtype: refused before any counting

    def _work(self, sizer: Sizer, i: int, bucket: Bucket, width: int) -> Work:
        """One row's round (the sizers live as long as the plan: their ids key the cache)."""
        key = (id(sizer), i, width)
        if key not in self.works:
            self.works[key] = sizer.work(bucket, width)
        return self.works[key]

    def on(self, layout: Layout, i: int, seqs: int, k: int) -> RoundAt:
        """Bucket i's round of `seqs` sequences verifying k drafts on the job's tensor-parallel group
        in `layout` (the rows a round pads to, its capture size, work as sequences do)."""
        bucket, sizer, tp = layout.needs[i].bucket, layout.sizer, layout.sizer.tp
        rows, width = sizer.engine.padded(seqs), k + 1
        work = self._work(sizer, i, bucket, width).times(rows)
        if sizer.expert_parallel:  # the hottest rank's experts bound the round
            work = Work({c: f * (self.imbalance if c == ROUTED_FLOPS else 1) for c, f in work.flops.items()},
                        work.collectives)
        at = floors(sizer.read(bucket, seqs, rows * width), work, self.hw, self.dtype, tp, self.per_domain,
                    sizer.groups)
        tokens = expected_tokens(self.alpha, k)
        return RoundAt(seqs, k, tokens, at, tokens_per_gpu(seqs, tokens, at, tp))

    def by_k(self, layout: Layout, i: int, seqs: int) -> list[RoundAt]:
        """Bucket i's round at each number of drafts its block may verify."""
        return [self.on(layout, i, seqs, k) for k in range(layout.needs[i].block)]

    def staged(self, i: int, seqs: int, k: int) -> list[tuple[str, RoundAt]]:
        """Bucket i's round with pipeline stages across NVLink domains, TP inside each ([]: one
        domain holds the group, or its ranks do not split evenly into them): with one micro-batch
        (the stages take turns: a round is the sum of their floors) and with as many micro-batches
        as stages (engine.micro_batches), each a stages-th of the sequences: a captured round goes
        through in that many groups, the pipe filling and draining every round (the last stage
        decides once every group is through: 2 x stages - 1 of the busiest stage's turns), while
        uncaptured rounds run in as many lanes whose rounds interleave (engine/lanes.py: a round
        of every lane is `stages` turns). The drafter is counted in the last stage's share."""
        tp, g = self.gpus, self.per_domain
        if tp <= g or tp % g:
            return []
        stages = tp // g
        try:
            sizers = self._stage_sizers(stages)
        except JobError:  # a width that does not split over a domain's ranks: no such layout
            return []
        tokens = expected_tokens(self.alpha, k)
        turns = [self._stage_floors(s, i, seqs, k) for s in sizers]
        run = Floors(*(sum(getattr(f, name) for f in turns) for name in ("memory", "compute", "nvlink", "nic")))
        micro = -(-seqs // stages)
        busiest = max((self._stage_floors(s, i, micro, k) for s in sizers), key=lambda f: f.seconds)
        rows = [(f"{stages} stages x TP{g}, one micro-batch (they take turns)", run)]
        for ticks, how in ((2 * stages - 1, f"{stages} micro-batches (captured: fill, drain)"),
                           (stages, f"{stages} lanes (interleaved, eager)")):
            rows.append((f"{stages} stages x TP{g}, {how}",
                         Floors(*(ticks * getattr(busiest, name) for name in ("memory", "compute", "nvlink", "nic")))))
        return [(name, RoundAt(seqs, k, tokens, at, tokens_per_gpu(seqs, tokens, at, tp))) for name, at in rows]

    def _stage_floors(self, sizer: Sizer, i: int, seqs: int, k: int) -> Floors:
        """A stage's floors for its part of a round of `seqs` sequences (counted on its own layers):
        its collectives inside its domain, what it hands on and takes back over the NIC."""
        bucket, width = self.plan.runs.needs[i].bucket, k + 1
        rows = sizer.engine.padded(seqs)
        work = self._work(sizer, i, bucket, width).times(rows)
        across = sum(work.collectives.get(kind, 0) for kind in BETWEEN_STAGES)
        inside = Work(work.flops, {kind: b for kind, b in work.collectives.items() if kind not in BETWEEN_STAGES})
        at = floors(sizer.read(bucket, seqs, rows * width), inside, self.hw, self.dtype, self.per_domain,
                    self.per_domain)
        return dataclasses.replace(at, nic=across / (self.hw.nic_gbps * 1e9))

    def _stage_sizers(self, stages: int) -> list[Sizer]:
        """The models as each stage's TP group holds them (its layers: models/stages.py), the latents
        split where the job splits them and the domain's ranks can; built once."""
        if self.stage_sizers is None:
            runs, g = self.plan.runs, self.per_domain

            def sized(split: bool) -> list[Sizer]:
                return [Sizer(self.job, self.job_dir, g, runs.sizer.setup, latent_split=split, at_stage=(s, stages),
                              groups=1, expert_parallel=False) for s in range(stages)]

            self.stage_sizers = sized(runs.ways > 1)
            if runs.ways > 1 and not self.stage_sizers[0].can_split():  # the domain's ranks cannot split them
                self.stage_sizers = sized(False)
        return self.stage_sizers

    def table(self) -> str:
        """Each bucket's round by k in the layout run, at the job's sequences, its best k there and at
        the largest that fits, and the layouts side by side at that k."""
        plan, runs = self.plan, self.plan.runs
        label = f", {plan.layout()}" if plan.layout() else ""
        lines = [f"roofline on {self.hw.name}, TP{plan.tp} ({self.per_domain} GPUs an NVLink domain){label}:",
                 f"  {BOUND}", f"  tokens: a sequence's expected tokens a round verifying k drafts "
                 f"(1 + alpha_1 + .. + alpha_k, alpha = {', '.join(f'{a:.2f}' for a in self.alpha)})"]
        for i, need in enumerate(runs.needs):
            bucket = need.bucket
            lines.append(f"  bucket {bucket.name}, {bucket.max_num_seqs} seqs (the job's), every one at "
                         f"{bucket.max_tokens} tokens:")
            lines.append(f"    {'k':>5} {COLUMNS}")
            rows = self.by_k(runs, i, bucket.max_num_seqs)
            lines += [f"    {r.k:>5} {r.row()}" for r in rows]
            best = max(rows, key=lambda r: (r.per_gpu, -r.k))
            lines.append(f"    best k = {best.k}: {best.per_gpu:,.0f} tokens/s per GPU ({best.floors.binding} binds)")
            largest = runs.largest[i]
            if largest and largest != bucket.max_num_seqs:
                top = max(self.by_k(runs, i, largest), key=lambda r: (r.per_gpu, -r.k))
                lines.append(f"    at the largest that fits, {largest} seqs: best k = {top.k}, {top.per_gpu:,.0f} "
                             f"tokens/s per GPU ({top.floors.binding} binds)")
            lines += self._layouts(i, best.k)
        return "\n".join(lines)

    def _layouts(self, i: int, k: int) -> list[str]:
        """Bucket i on each layout at k drafts: the one run and stages at the job's sequences, the
        other tensor-parallel one at the largest batch it holds."""
        plan = self.plan
        seqs = plan.runs.needs[i].bucket.max_num_seqs
        sizer = plan.runs.sizer
        name = (f"DP{sizer.groups} x TP{plan.tp} + EP{self.gpus}" if sizer.expert_parallel
                else f"DP{sizer.groups} x TP{plan.tp}" if sizer.groups > 1 else f"TP{plan.tp}")
        rows: list[tuple[str, RoundAt | None]] = [
            (f"{name}, {plan.runs.name} (as run; {self.memory(sizer, i, seqs)})", self.on(plan.runs, i, seqs, k))]
        other = plan.other
        if other is not None and other.largest[i]:
            rows.append((f"TP{plan.tp}, {other.name}", self.on(other, i, other.largest[i], k)))
        if plan.runs.sizer.groups > 1 or plan.runs.sizer.expert_parallel:
            rows += self._other(i, k, f"TP{self.gpus}", self.gpus, 1, False)
        rows += self.staged(i, seqs, k)
        g = self.per_domain
        experts = plan.runs.sizer.config.get("num_experts", 0)
        if not plan.runs.sizer.expert_parallel and experts and self.gpus > g and self.gpus % g == 0:
            rows += self._other(i, k, f"DP{self.gpus // g} x TP{g} + EP{self.gpus}", g, self.gpus // g, True)
        out = [f"    {f'layouts at k = {k}:':<76} {'seqs':>4} {COLUMNS}"]
        return out + [f"      {name:<74} {r.seqs:>4} {r.row()}" if r else f"      {name:<74}    0  does not hold "
                      "one sequence" for name, r in rows]

    def _other(self, i: int, k: int, name: str, tp: int, groups: int,
               expert_parallel: bool) -> list[tuple[str, RoundAt | None]]:
        """Bucket i at k drafts on a layout of the job's GPUs it does not run ([]: its widths do not
        split over its ranks; None: it holds no sequence): `groups` data-parallel groups of `tp`
        ranks, the routed experts whole over all of them or cut across each group's, at the most
        sequences a group holds (the latents split where the job splits them and the ranks can)."""
        if name not in self.others:
            runs = self.plan.runs
            try:
                sizer = Sizer(self.job, self.job_dir, tp, runs.sizer.setup, latent_split=runs.ways > 1, groups=groups,
                              expert_parallel=expert_parallel)
                if runs.ways > 1 and not sizer.can_split():
                    sizer = Sizer(self.job, self.job_dir, tp, runs.sizer.setup, groups=groups,
                                  expert_parallel=expert_parallel)
            except JobError:
                return []
            base = held_besides_buckets(sizer.weights(), self.plan.fixed)
            needs = [sizer.need(n.bucket) for n in runs.needs]
            largest = [largest_fitting(base, sizer, n.bucket, self.plan.gpu) for n in runs.needs]
            self.others[name] = Layout(sizer.split, needs, largest, sizer)
        layout = self.others[name]
        if not layout.largest[i]:
            return [(f"{name} (weights {sum(layout.sizer.weights().values()) / GB:.0f} GB a GPU)", None)]
        memory = self.memory(layout.sizer, i, layout.largest[i])
        return [(f"{name} ({memory})", self.on(layout, i, layout.largest[i], k))]

    def memory(self, sizer: Sizer, i: int, seqs: int) -> str:
        """"w+c+b GB": a GPU's weights, caches and buffers (batch state, prefill and round activations)
        for `seqs` sequences of bucket i on the sizer's layout."""
        need = sizer.need(dataclasses.replace(self.plan.runs.needs[i].bucket, max_num_seqs=seqs))
        weights = sum(sizer.weights().values())
        return f"{weights / GB:.0f}+{need.caches / GB:.0f}+{(need.total - need.caches) / GB:.0f} GB"


def roofline(plan: Plan, job: Job, job_dir: Path, hw: Hardware, alpha: list[float], per_domain: int,
             imbalance: float = ASSUMED_IMBALANCE) -> str:
    """The roofline tables of `plan` (plan_job with_split) on `hw`, an expert-parallel layout's hottest
    rank at `imbalance` times the mean."""
    return Roofline(plan, job, job_dir, hw, alpha, per_domain, imbalance).table()
