"""What a job's rounds can reach on a named GPU: each bucket's three floors (plan/roofline.py) in
the layout the job runs, for every number of drafts a round may verify, the one that binds, and
the draft count that gives the most tokens per second per GPU; beside it, the other layouts.

Each round's work is counted once for one sequence at each verify width (sizing.Sizer.work: the
engine's own round on the meta device) and scaled by the sequences. Layouts side by side, at the
best draft count of the one run: the job's tensor-parallel group with the MLA latents whole and
split (where they split), and pipeline stages across NVLink domains with tensor parallelism
inside each, sized before the project runs them: the stages' layers balanced, as many
micro-batches as stages, each stage reading its weights once a micro-batch, its NIC carrying one
hand-off a micro-batch (the hidden rows, Kimi-K3's attention-residual blocks and the drafter's
taps so far), and the sequences assumed to fit as they do in the group (a GPU holds 1/GPUs of
the layers either way).
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
from dflash_batch.sizing import Layout, Plan, Sizer

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


COLUMNS = f"{'tokens':>7} {'memory':>8} {'compute':>8} {'NVLink':>7} {'NIC':>6}  {'binds':<8} {'tok/s/GPU':>10}"


class Roofline:
    """The plan's roofline on `hw`, sequences accepting drafts as `alpha` says (alpha_1..), a
    group `per_domain` GPUs to an NVLink domain."""

    def __init__(self, plan: Plan, job: Job, job_dir: Path, hw: Hardware, alpha: list[float], per_domain: int):
        self.plan, self.job, self.job_dir, self.hw, self.alpha = plan, job, job_dir, hw, alpha
        self.per_domain, self.dtype = per_domain, job.model.dtype
        self.works: dict[tuple[int, int, int], Work] = {}  # (sizer id, bucket index, width) -> one row's
        self.stage_sizer: Sizer | None = None  # the models at a pipeline stage's TP size (staged)
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
        bucket, sizer, tp = layout.needs[i].bucket, layout.sizer, self.plan.tp
        rows, width = sizer.engine.padded(seqs), k + 1
        work = self._work(sizer, i, bucket, width).times(rows)
        at = floors(sizer.read(bucket, seqs, rows * width), work, self.hw, self.dtype, tp, self.per_domain)
        tokens = expected_tokens(self.alpha, k)
        return RoundAt(seqs, k, tokens, at, tokens_per_gpu(seqs, tokens, at, tp))

    def by_k(self, layout: Layout, i: int, seqs: int) -> list[RoundAt]:
        """Bucket i's round at each number of drafts its block may verify."""
        return [self.on(layout, i, seqs, k) for k in range(layout.needs[i].block)]

    def staged(self, i: int, seqs: int, k: int) -> tuple[str, RoundAt] | None:
        """Bucket i's round with pipeline stages across NVLink domains (None: one domain holds the
        group, or its ranks do not split evenly into them)."""
        tp, g = self.plan.tp, self.per_domain
        if tp <= g or tp % g:
            return None
        stages, runs = tp // g, self.plan.runs
        try:
            sizer = self._stage_sizer()
        except JobError:  # a width that does not split over a domain's ranks: no such layout
            return None
        bucket, width = runs.needs[i].bucket, k + 1
        micro = -(-seqs // stages)  # sequences a micro-batch: as many micro-batches as stages
        work = self._work(sizer, i, bucket, width).times(micro / stages)
        caches = sizer.need(dataclasses.replace(bucket, max_num_seqs=micro)).caches
        weights = sizer.read(bucket, micro, micro * width) - caches  # the touched experts of a micro-batch
        read = weights / stages + sizer.need(dataclasses.replace(bucket, max_num_seqs=seqs)).caches / stages / stages
        inside = floors(int(read), work, self.hw, self.dtype, g, g)
        hand_off = micro * width * self._hand_off_row(sizer, stages) / g  # each rank of a stage sends its share
        per_micro = dataclasses.replace(inside, nic=hand_off / (self.hw.nic_gbps * 1e9))
        at = Floors(*(stages * t for t in (per_micro.memory, per_micro.compute, per_micro.nvlink, per_micro.nic)))
        tokens = expected_tokens(self.alpha, k)
        name = f"{stages} stages x TP{g} ({stages} micro-batches; sized, not run yet)"
        return name, RoundAt(seqs, k, tokens, at, tokens_per_gpu(seqs, tokens, at, tp))

    def _stage_sizer(self) -> Sizer:
        """The models as a stage's TP group holds them (every layer: a stage holds 1/stages of them),
        the latents split where the job splits them and the domain's ranks can; built once."""
        if self.stage_sizer is None:
            runs, g = self.plan.runs, self.per_domain
            sizer = Sizer(self.job, self.job_dir, g, runs.sizer.setup, latent_split=runs.ways > 1)
            if runs.ways > 1 and not sizer.can_split():
                sizer = Sizer(self.job, self.job_dir, g, runs.sizer.setup)
            self.stage_sizer = sizer
        return self.stage_sizer

    def _hand_off_row(self, sizer: Sizer, stages: int) -> int:
        """Bytes a stage boundary passes on a target row: its hidden state, the attention-residual
        blocks written before it (Kimi-K3: one every attn_res_block_size layers, from layer 0) and
        the drafter's taps before it, at the last boundary (the most of them)."""
        config = sizer.config
        boundary = config["num_hidden_layers"] * (stages - 1) // stages
        blocks = -(-boundary // config["attn_res_block_size"]) if "attn_res_block_size" in config else 0
        taps = sum(t < boundary for t in getattr(sizer.target, "tap_ids", []))
        return config["hidden_size"] * sizer.dtype_bytes * (1 + blocks + taps)

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
        rows = [(f"TP{plan.tp}, {plan.runs.name} (as run)", self.on(plan.runs, i, seqs, k))]
        other = plan.other
        if other is not None and other.largest[i]:
            rows.append((f"TP{plan.tp}, {other.name}", self.on(other, i, other.largest[i], k)))
        if (staged := self.staged(i, seqs, k)) is not None:
            rows.append(staged)
        out = [f"    {f'layouts at k = {k}:':<64} {'seqs':>4} {COLUMNS}"]
        return out + [f"      {name:<62} {r.seqs:>4} {r.row()}" for name, r in rows]


def roofline(plan: Plan, job: Job, job_dir: Path, hw: Hardware, alpha: list[float], per_domain: int) -> str:
    """The roofline tables of `plan` (plan_job with_split) on `hw`."""
    return Roofline(plan, job, job_dir, hw, alpha, per_domain).table()
