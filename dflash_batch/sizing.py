"""What a job needs of each GPU: the memory plan, computed by the engine's own code on the meta device.

The plan is for a CUDA GPU with the gpu extra installed (GPU_HOST): the attention backend, kernels,
CUDA graphs and capture sizes build.py picks there for the job, whatever the planning host has,
so a login node and a GPU node give the same plan. The target and drafter are built from their
config.json alone, as rank 0 of the job's tensor-parallel group holds them (parallel.planned), on
the meta device: no weight is read and no byte allocated. Their parameters are the weights a rank
keeps (MXFP4 experts packed, the rest in the job's dtype); each bucket's caches, recurrent state,
drafter rings, verify staging and decoding state are what Engine.allocate makes of them, the same
calls a run makes. Activations are the
bound of models/activations.py for a prefill chunk and for the round at the bucket's largest
capture size; with CUDA graphs every captured round shares one pool, the largest round's.
The reserve stands for what no tensor shows: the CUDA context, NCCL's buffers, the caching
allocator's fragmentation; beside it the job may keep a share of the GPU free
(engine.gpu_memory_headroom) for what a plan from config.json cannot see. One inequality (`fits`)
decides what fits, for the plan, run and validate (fit_job) and smallest_tp. tests/test_sizing.py
checks weights and caches to the byte against the CPU allocator on the tiny models, and the
activations' bound against its peaks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_batch import parallel
from dflash_batch.backends.latent_split import LatentSplit
from dflash_batch.backends.torch_attention import TorchAttention
from dflash_batch.build import DTYPES, EngineSetup, resolve_engine, why_no_latent_split
from dflash_batch.engine import choice
from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.engine import Engine, named_runtime_tensors, ring_rows
from dflash_batch.engine.heads import LIVE_HEADS
from dflash_batch.engine.pair import attach_drafter
from dflash_batch.grammar import asks_for_grammar
from dflash_batch.job import Job, JobError, gpu_bytes
from dflash_batch.models import activations
from dflash_batch.models.layers.expert_parallel import Placement
from dflash_batch.models.loader import build_model, load_config
from dflash_batch.plan.buckets import Bucket, plan_buckets
from dflash_batch.plan.roofline import memory_read
from dflash_batch.plan.work import Work, round_work

GB = 10**9
TP_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
FLASHINFER_WORKSPACE = 256 << 20  # backends/flashinfer_attention.py's default
# The host a plan is for, whatever the planning host has installed: a CUDA GPU with the gpu extra
# (flashinfer, Triton, fla-core), so a login node and a GPU node give the same plan.
GPU_HOST = dict(cuda=True, flashinfer=True, triton=True)
PACKED = "uint8 (MXFP4 packed)"  # the routed experts' weights as a rank holds them
ROUTED = f"target weights {PACKED}"  # their key in Sizer.weights


def gb(size: int) -> str:
    """Bytes as GB, to four figures (a GPU of 0.5 GB is not 'a GPU of 0 GB')."""
    return f"{size / GB:.4g}"


def default_reserve(gpu: int) -> int:
    """Memory no tensor accounts for: 6% of the GPU, at least 8 GB."""
    return max(8 * GB, int(0.06 * gpu))


def config_dir(path: str, job_dir: Path) -> tuple[str, str | None]:
    """The checkpoint directory whose config.json sizes `path`: the checkpoint itself, or where it
    is not on this host, the config the repository ships beside the job files (jobs/models/ORG/NAME)
    with a line saying so."""
    if (Path(path) / "config.json").exists():
        return path, None
    shipped = job_dir / "models" / Path(path).parent.name / Path(path).name
    if (shipped / "config.json").exists():
        return str(shipped), f"{path} is not on this host: sized from {shipped}/config.json"
    raise JobError(f"{path} has no config.json here, and {shipped} holds none either")


@dataclass(frozen=True)
class BucketNeed:
    bucket: Bucket
    caches: int         # the models' caches, recurrent state, rings and staging
    batch: int          # the decoding state's tensors
    prefill: int        # a prefill chunk's activations
    round: int          # the round's activations at the bucket's largest padded size
    graphs: bool        # the round's memory is a CUDA-graph pool held for the bucket
    parts: dict[str, int] = dataclasses.field(default_factory=dict)  # the caches by component
    block: int = 1      # tokens a sequence verifies a round

    @property
    def total(self) -> int:
        held = self.prefill + self.round if self.graphs else max(self.prefill, self.round)
        return self.caches + self.batch + held


@dataclass(frozen=True)
class Layout:
    """The buckets with the MLA latents whole on every rank (`ways` 1) or split `ways` ways across
    them by token (engine.context_parallel): each bucket's needs at its max_num_seqs and the
    largest max_num_seqs that fits; `sizer` holds the models it was sized with (the roofline
    counts their rounds: throughput.py)."""

    ways: int
    needs: list[BucketNeed]
    largest: list[int]
    sizer: Sizer | None = dataclasses.field(repr=False, compare=False, default=None)

    @property
    def name(self) -> str:
        return f"with the MLA latents split {self.ways} ways" if self.ways > 1 else "without the MLA latents split"


@dataclass(frozen=True)
class Plan:
    tp: int
    gpu: int
    weights: dict[str, int]      # by model and dtype held: "target weights bfloat16", ...
    fixed: dict[str, int]        # workspace, reserve, headroom
    whole: Layout                # the MLA latents (if any) whole on every rank
    notes: list[str]
    split: Layout | None = None  # split across the ranks (None: not asked, or the pair or TP size cannot)
    setting: bool | None = None  # engine.context_parallel (None: absent)
    decides: bool = True         # with the setting absent, the plan decides the split (engine.gpu_memory set)
    at_stage: tuple[int, int] = (0, 1)  # the pipeline stage whose rank it sizes (index, stages)

    @property
    def base(self) -> int:
        return held_besides_buckets(self.weights, self.fixed)

    def holds(self, need: BucketNeed) -> bool:
        return fits(self.base, need, self.gpu)

    def holds_all(self, layout: Layout) -> bool:
        return all(map(self.holds, layout.needs))

    @property
    def uses_split(self) -> bool:
        """Whether the job runs with the latents split (what run and validate do, sizing.fit_job):
        as engine.context_parallel says, or where it is absent and engine.gpu_memory set, when the
        buckets as written do not fit without it (the split costs two collectives a layer: it pays
        where it holds the batch)."""
        if self.split is None:
            return False
        return (self.decides and not self.holds_all(self.whole)) if self.setting is None else self.setting

    @property
    def runs(self) -> Layout:
        """The layout the job runs."""
        return self.split if self.uses_split else self.whole

    @property
    def fits(self) -> bool:
        """The buckets as written fit, in the layout the job runs."""
        return self.holds_all(self.runs)

    def layout(self) -> str:
        """The layout the job runs and why ("": the latents cannot split, or the plan was not asked
        and the job does not say)."""
        if self.split is None and self.setting is not False:
            return ""
        if self.setting is not None:
            why = f"engine.context_parallel: {str(self.setting).lower()}"
        elif not self.decides:
            why = "engine.context_parallel absent and engine.gpu_memory unset: off"
        elif self.uses_split:
            why = "engine.context_parallel absent, so on: the buckets as written need it"
        else:
            why = "engine.context_parallel absent, so off: the buckets as written fit without it"
        return f"{self.runs.name} ({why})"

    def table(self) -> str:
        """The plan in the layout the job runs, then each bucket in the other (where the latents can
        split)."""
        layout = f", {self.layout()}" if self.layout() else ""
        index, stages = self.at_stage
        where = f"TP{self.tp}, stage {index} of {stages} (the fullest)" if stages > 1 else f"TP{self.tp}"
        lines = [*self.notes, f"per rank, {where}, on a GPU of {gb(self.gpu)} GB{layout}:"]
        lines += [f"  {name:<40} {size / GB:>8.2f} GB" for name, size in {**self.weights, **self.fixed}.items()]
        lines.append(f"  {'weights and fixed':<40} {self.base / GB:>8.2f} GB")
        if self.base > self.gpu:
            lines.append(f"  weights and fixed alone exceed the GPU's {gb(self.gpu)} GB: not one sequence fits")
        lines.append(f"  {'bucket':<14} {'seqs':>5} {'largest':>7} {'fits':>5} {'caches':>8} {'batch':>7} "
                     f"{'prefill':>8} {'round':>8} {'total':>8}   (seqs: max_num_seqs; largest: the most that fit; "
                     "GB; round: a CUDA-graph pool where graphs are on)")
        for need, largest in zip(self.runs.needs, self.runs.largest):
            lines.append(f"  {need.bucket.name:<14} {need.bucket.max_num_seqs:>5} {largest:>7} "
                         f"{'yes' if self.holds(need) else 'NO':>5} {need.caches / GB:>8.2f} {need.batch / GB:>7.3f} "
                         f"{need.prefill / GB:>8.2f} {need.round / GB:>8.2f} {(self.base + need.total) / GB:>8.2f}")
            lines.append("    caches: " + _parts(need))
        for i, need in enumerate(self.runs.needs):
            if more := self._beside(i):
                lines += [f"  bucket {need.bucket.name}:", *more]
        return "\n".join(lines)

    @property
    def other(self) -> Layout | None:
        """The layout the job does not run, where the latents can split."""
        return self.whole if self.runs is self.split else self.split

    def _beside(self, i: int) -> list[str]:
        """Bucket i in the layout the job does not run (where there is one)."""
        if self.other is None:
            return []
        need = self.other.needs[i]
        return [f"    {self.other.name}: caches {need.caches / GB:.2f} at {need.bucket.max_num_seqs} seqs, total "
                f"{(self.base + need.total) / GB:.2f}, fits {'yes' if self.holds(need) else 'NO'}; "
                f"largest seqs {self.other.largest[i]}"]


def held_besides_buckets(weights: dict[str, int], fixed: dict[str, int]) -> int:
    """What a rank holds whatever its bucket: weights, the attention workspace, the reserve and
    the headroom."""
    return sum(weights.values()) + sum(fixed.values())


def fits(base: int, need: BucketNeed, gpu: int) -> bool:
    """Whether a bucket fits a GPU of `gpu` bytes beside `base` (held_besides_buckets): the one fit
    test of the plan, fit_job and smallest_tp."""
    return base + need.total <= gpu


def _parts(need: BucketNeed) -> str:
    return ", ".join(f"{name} {size / GB:.2f}" for name, size in need.parts.items())


def cache_parts(models: dict[str, torch.nn.Module | None]) -> dict[str, int]:
    """The caches the models hold (engine.named_runtime_tensors), by component: "target MLA
    latent", "target KDA state", "target KDA verify staging", "drafter latent and rings", ... (the
    layer's class and attribute where _COMPONENTS names none), largest first."""
    parts: dict[str, int] = {}
    for role, model in models.items():
        for module, attr, t in named_runtime_tensors([model] if model is not None else []):
            layer = type(module).__name__
            name = f"{role} {_COMPONENTS.get((layer, attr.split('_')[0]), f'{layer} {attr}')}"
            parts[name] = parts.get(name, 0) + t.nbytes
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]))


# (layer class, attribute's first word) -> component
_COMPONENTS = {("GatedMLA", "cache"): "MLA latent", ("KDA", "state"): "KDA state", ("KDA", "conv"): "KDA state",
               ("KDA", "staged"): "KDA verify staging", ("DFlashMLAAttention", "cache"): "latent and rings",
               **{(layer, kv): "K/V" for layer in ("Qwen3Attention", "DFlashAttention") for kv in ("k", "v")}}


class Sizer:
    """The job's models on the meta device at one tensor-parallel size, and an engine over them."""

    def __init__(self, job: Job, job_dir: Path, tp: int, setup: EngineSetup | None, latent_split: bool = False,
                 at_stage: tuple[int, int] = (0, 1), groups: int | None = None, expert_parallel: bool | None = None):
        """`latent_split`: size the MLA latents split across the ranks by token (engine.context_parallel);
        `at_stage`: (index, stages): a rank of that pipeline stage (its layers, models/stages.py);
        `groups`, `expert_parallel`: a rank of data-parallel groups of `tp` ranks, the routed experts
        sharded whole over all of them (default: the job's model.data_parallel_size, expert_parallel)."""
        self.job, self.tp, self.split, self.at_stage = job, tp, tp if latent_split else 1, at_stage
        self.groups = job.model.data_parallel_size if groups is None else groups
        self.expert_parallel = job.model.expert_parallel if expert_parallel is None else expert_parallel
        self.notes: list[str] = []
        paths = {}
        for role in ("target", "drafter"):
            path = getattr(job.model, role)
            if path:
                paths[role], note = config_dir(path, job_dir)
                self.notes += [note] if note else []
        # What the GPU host runs (its backend, kernels, graphs and capture sizes), not this host.
        sized = job.model_copy(update={"model": job.model.model_copy(update=paths)})
        self.sized = sized  # the job, its checkpoints those sized here
        self.setup = setup or resolve_engine(sized, **GPU_HOST)
        self.notes.append(("sized for a CUDA GPU with the gpu extra (flashinfer, Triton, fla-core), whatever this "
                           "host has installed: " if setup is None else "sized for: ")
                          + self.setup.describe().removeprefix("engine: "))
        dtype = DTYPES[job.model.dtype]
        self.dtype_bytes = torch.empty(0, dtype=dtype).element_size()
        placement = None
        if self.expert_parallel:  # which experts a rank holds changes nothing of its size: the default
            experts = load_config(paths["target"]).get("text_config", {}).get("num_experts", 0)
            placement = Placement(experts, self.groups * tp, job.model.redundant_experts, {})
        with self.planned():
            self.target = _build(paths["target"], dtype, placement)
            self.drafter = _build(paths["drafter"], dtype) if "drafter" in paths else None
            if self.drafter is not None:
                attach_drafter(self.target, self.drafter)
        self.engine = Engine(self.target, self.drafter, page_size=job.engine.page_size,
                             max_num_batched_tokens=job.engine.max_num_batched_tokens, dtype=dtype, device="meta",
                             attention=_Planned(self.setup.backend, self.split),
                             capture_sizes=self.setup.capture_sizes, share_prompts=job.engine.share_prompts,
                             shared_head_tokens=job.engine.shared_head_tokens)
        with self.planned():
            torch_kernels = self.setup.kernels == "torch"
            self.widths = {m: activations.widths(m, self.dtype_bytes, torch_kernels)
                           for m in (self.target, self.drafter) if m}

    def planned(self):
        """parallel.planned for a rank of this layout."""
        return parallel.planned(self.tp, self.at_stage, self.groups)

    def can_split(self) -> bool:
        """Whether the pair's MLA latents split across this size's ranks (build.py's rules)."""
        model = self.sized.model.model_copy(update={"tensor_parallel_size": self.tp})
        return why_no_latent_split(self.sized.model_copy(update={"model": model})) is None

    def fixed(self, gpu: int, reserve: int | None) -> dict[str, int]:
        """What a rank holds besides weights and buckets: the attention workspace, the reserve, and
        the headroom the job keeps free (engine.gpu_memory_headroom of the GPU)."""
        share = self.job.engine.gpu_memory_headroom
        return {"attention workspace": FLASHINFER_WORKSPACE if self.setup.backend == "flashinfer" else 0,
                "reserve (context, NCCL, fragmentation)": default_reserve(gpu) if reserve is None else reserve,
                f"headroom (gpu_memory_headroom {share:g})": round(share * gpu)}

    def base(self, gpu: int, reserve: int | None) -> int:
        return held_besides_buckets(self.weights(), self.fixed(gpu, reserve))

    def weights(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for role, model in (("target", self.target), ("drafter", self.drafter)):
            for t in [*model.parameters(), *model.buffers()] if model else []:
                kind = PACKED if t.dtype == torch.uint8 else str(t.dtype).removeprefix("torch.")
                out[f"{role} weights {kind}"] = out.get(f"{role} weights {kind}", 0) + t.nbytes
        return out

    @property
    def config(self) -> dict:
        """The target's (text) config."""
        return self.target.config.get("text_config", self.target.config)

    def sampled(self) -> bool:
        """Whether the job's rounds choose tokens by sampling (a row may ask to), not greedily."""
        return self.job.sampling.temperature > 0 or self.job.input.rows_may_set("temperature")

    def work(self, bucket: Bucket, width: int) -> Work:
        """One round's work for one sequence of the bucket at its longest, verifying `width` rows,
        with what the job's rows ask of the batch (logprobs, penalties, bias, sampling), counted on
        the torch backend with this layout's latent split (plan/work.py; rounds of n rows do n times
        this: tests/test_work.py)."""
        one = dataclasses.replace(bucket, max_num_seqs=1)
        with self.planned():
            batch = self.engine.allocate(one)
            self._grow(batch)
            step = self.engine.rounds[batch.block]
            planned, step.attention = step.attention, TorchAttention(self.engine.split)
            try:
                return round_work(self.target, self.drafter, step, batch, 1, bucket.max_tokens,
                                  min(width, batch.block), not self.sampled())
            finally:
                step.attention = planned

    def read(self, bucket: Bucket, seqs: int, tokens: int) -> int:
        """Bytes a rank reads in a round of `seqs` sequences of the bucket with `tokens` target rows
        (padding rows included): its weights (of the routed experts, the share those rows touch)
        and its caches."""
        weights = self.weights()
        routed = weights.get(ROUTED, 0)
        experts = (self.config.get("num_experts", 0), self.config.get("num_experts_per_token", 0)) if routed else (0, 0)
        caches = self.need(dataclasses.replace(bucket, max_num_seqs=seqs)).caches
        # Whole experts serve every group's tokens (dispatch): those touch this rank's experts.
        routing = tokens * self.groups if self.expert_parallel else tokens
        return memory_read(routing, sum(weights.values()) - routed, routed, caches, *experts)

    def need(self, bucket: Bucket) -> BucketNeed:
        with self.planned():
            batch = self.engine.allocate(bucket)  # its caches hold the shared heads' pool (engine/heads.py)
            self._grow(batch)
            block, keys = batch.block, bucket.max_tokens + batch.block
            parts = cache_parts({"target": self.target, "drafter": self.drafter})
            if batch.head_pages:
                parts["kept head states"] = self._kept_heads(batch)
            caches = sum(parts.values())
            state = _bytes(batch) + self._grammar(batch)
            round_ = self._round(batch.rows, block, keys)
            if bucket.speculation == "auto" and block > 1:
                # Turning speculation off builds the one-row batch (and its graphs) beside this one.
                one = DecodeBatch(batch.rows, 1, batch.tables.shape[1], self.engine.page_size, bucket.max_num_seqs,
                                  "meta", self.engine.vocab_size, batch)
                state += _bytes(one) + self._grammar(one)
                round_ += self._round(batch.rows, 1, keys) if self.setup.cuda_graphs else 0
            return BucketNeed(bucket, caches, state, self._prefill(bucket, block), round_, self.setup.cuda_graphs,
                              parts, block)

    def _kept_heads(self, batch: DecodeBatch) -> int:
        """What the live shared heads keep beside their pages: a sequence's recurrent state and
        the drafter's ring of one row, for each (engine/heads.py)."""
        state = sum(t.nbytes // t.shape[0] for t in self.target.state_pools()) if self.engine.recurrent else 0
        rings = ring_rows(self.drafter, batch.ring, batch.scratch_state, self.engine.page_size, self.split)
        return LIVE_HEADS * (state + sum(t.nbytes // t.shape[0] * rings.row_slots for t in rings.caches))

    def _grow(self, batch: DecodeBatch) -> None:
        """What the job's rows may ask for that the batch keeps for every row (the job's sampling,
        or a row's own where its input may set it)."""
        s, may = self.job.sampling, self.job.input.rows_may_set
        penalties = s.repetition_penalty != 1 or bool(s.frequency_penalty) or bool(s.presence_penalty) or any(
            may(f) for f in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
        batch.allocate_for(bool(s.logit_bias) or may("logit_bias"), penalties, s.logprobs is not None or may("logprobs"))

    def _grammar(self, batch: DecodeBatch) -> int:
        """The device copy of the grammar masks (a bit a token, a verify row), where a row may use one."""
        return batch.rows * batch.block * -(-self.engine.vocab_size // 32) * 4 if asks_for_grammar(self.job) else 0

    def _prefill(self, bucket: Bucket, block: int) -> int:
        tokens = min(self.job.engine.max_num_batched_tokens, bucket.max_num_seqs * bucket.max_tokens)
        scored = tokens if self.job.sampling.prompt_logprobs is not None else min(tokens, bucket.max_num_seqs)
        torch_attention = self.setup.backend == "torch"
        widths = self.widths[self.target]
        need = widths.chunk + activations.forward_bytes(widths, tokens, scored, scored, bucket.max_num_seqs,
                                                        bucket.max_tokens, torch_attention)
        if block > 1:  # the drafter writes the chunk's context from its taps
            need += tokens * self.widths[self.drafter].layer
        return need + self._split_bytes(self.target, tokens)

    def _split_bytes(self, model: torch.nn.Module, tokens: int) -> int:
        """A split MLA layer's gathered heads and merge (none without a split)."""
        if self.split == 1:
            return 0
        with self.planned():
            return activations.latent_split_bytes(model, self.dtype_bytes, tokens)

    def _round(self, rows: int, block: int, keys: int) -> int:
        # Under CUDA graphs the sampled rounds are captured too (one pool for both), whatever the job.
        tokens = rows * block
        sampled = self.job.sampling.temperature > 0 or self.setup.cuda_graphs or self.job.input.rows_may_set(
            "temperature")
        torch_attention = self.setup.backend == "torch"
        # A sampled verify gathers and samples its rows a group of sequences at a time (choice.py).
        group = min(tokens, max(block, choice.group_rows(self.engine.vocab_size))) if sampled else 0
        verify = activations.forward_bytes(self.widths[self.target], tokens, tokens, group, rows, keys,
                                           torch_attention)
        verify += activations.sampling_bytes(self.widths[self.target], group) + self._split_bytes(self.target, tokens)
        if block == 1:
            return verify
        draft = activations.forward_bytes(self.widths[self.drafter], tokens, rows * (block - 1), 0, rows,
                                          keys, torch_attention) + self._split_bytes(self.drafter, tokens)
        return max(verify, draft)


class _Planned:
    """The attention backend's answer to what the engine asks while allocating (rings or whole
    caches), without its kernels."""

    def __init__(self, backend: str, latent_split: int = 1):
        self.name = backend
        self.split = LatentSplit(latent_split, 0) if latent_split > 1 else None  # rank 0's rows
        self.plans_on_host = backend == "flashinfer"

    def reads_rings(self, latent: bool) -> bool:
        return latent or self.name == "torch"


def _build(path: str, dtype: torch.dtype, expert_placement: Placement | None = None) -> torch.nn.Module:
    try:
        return build_model(path, dtype, "meta", expert_placement)
    except ValueError as e:  # a width that does not split over the ranks
        raise JobError(f"{path}: {e}") from None


def _bytes(batch: DecodeBatch) -> int:
    return sum(t.nbytes for t in vars(batch).values() if isinstance(t, torch.Tensor))


def plan_job(job: Job, job_dir: Path, gpu: int, tp: int | None = None, reserve: int | None = None,
             setup: EngineSetup | None = None, with_split: bool = False) -> Plan:
    """The job's memory per rank at `tp` ranks (default: the job's), and the largest max_num_seqs
    per bucket that fits a GPU of `gpu` bytes with `reserve` (default: default_reserve) and the
    job's headroom kept free; `with_split`: also with the MLA latents split across the ranks, where
    the pair and TP size allow. `setup`: the engine settings to size (default: what a CUDA host
    with the gpu extra runs, GPU_HOST)."""
    tp = job.model.tensor_parallel_size if tp is None else tp
    if tp < 1:
        raise JobError(f"a tensor-parallel size of {tp}: give 1 or more ranks")
    stages = job.model.pipeline_parallel_size
    plans = [_stage_plan(job, job_dir, gpu, tp, reserve, setup, with_split, (i, stages)) for i in range(stages)]
    if stages == 1:
        return plans[0]
    # Every stage must hold its buckets: the plan shown is the fullest stage's, each bucket's
    # largest batch the least any stage holds, and a line a stage.
    fullest = max(plans, key=lambda p: p.base + sum(n.total for n in p.runs.needs))
    least = {name: [min(getattr(p, name).largest[i] for p in plans) for i in range(len(fullest.runs.needs))]
             for name in ("whole", "split") if getattr(fullest, name) is not None}
    notes = [*fullest.notes, *(f"stage {p.at_stage[0]} of {stages}: {_held(p)}, weights and fixed "
                               f"{p.base / GB:.2f} GB, with bucket {p.runs.needs[0].bucket.name} "
                               f"{(p.base + p.runs.needs[0].total) / GB:.2f} GB" for p in plans)]
    return dataclasses.replace(fullest, notes=notes,
                               **{name: dataclasses.replace(getattr(fullest, name), largest=largest)
                                  for name, largest in least.items()})


def _held(plan: Plan) -> str:
    """"layers a-b[, the head and drafter]" of the stage a plan sizes."""
    target = plan.whole.sizer.target
    last = " and the LM head" + (" and drafter" if plan.whole.sizer.drafter else "") \
        if target.held.stop == target.num_layers else ""
    return f"target layers {target.held.start}-{target.held.stop - 1}{last}"


def _stage_plan(job: Job, job_dir: Path, gpu: int, tp: int, reserve: int | None, setup: EngineSetup | None,
                with_split: bool, at_stage: tuple[int, int]) -> Plan:
    """plan_job for a rank of one pipeline stage."""
    sizer = Sizer(job, job_dir, tp, setup, at_stage=at_stage)
    weights, fixed = sizer.weights(), sizer.fixed(gpu, reserve)
    base, buckets = held_besides_buckets(weights, fixed), plan_buckets(job)

    def layout(s: Sizer) -> Layout:
        return Layout(s.split, [s.need(b) for b in buckets], [largest_fitting(base, s, b, gpu) for b in buckets], s)

    split = None
    if with_split and sizer.can_split():
        split = layout(Sizer(job, job_dir, tp, sizer.setup, latent_split=True, at_stage=at_stage))
    notes = sizer.notes + ([f"a rank of data-parallel group 0 of {sizer.groups}, TP{tp} inside each"
                            + (f", the routed experts whole over all {sizer.groups * tp} ranks" if sizer.expert_parallel
                               else "")] if sizer.groups > 1 or sizer.expert_parallel else [])
    return Plan(tp, gpu, weights, fixed, layout(sizer), notes, split, job.engine.context_parallel,
                job.engine.gpu_memory is not None, at_stage)


def largest_fitting(base: int, sizer: Sizer, bucket: Bucket, gpu: int) -> int:
    """The most sequences of `bucket` a rank of `sizer`'s layout holds beside `base` (0: none)."""
    return _largest(lambda n: fits(base, sizer.need(dataclasses.replace(bucket, max_num_seqs=n)), gpu))


def _largest(fits, limit: int = 1 << 14) -> int:
    """The largest s in 1..limit with fits(s) (fits is monotone), 0 if none."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def smallest_tp(job: Job, job_dir: Path, gpu: int, reserve: int | None = None, above: int = 0,
                as_written: bool = False) -> int | None:
    """The fewest ranks, more than `above`, at which one sequence of every bucket fits, or with
    `as_written` each bucket's own max_num_seqs (None: not up to 64); with the MLA latents split
    where engine.context_parallel is true, or absent and the split holds what the whole does not."""
    setting = job.engine.context_parallel
    for tp in (t for t in TP_SIZES if t > above):
        try:
            whole = Sizer(job, job_dir, tp, None)
            sizers = [] if setting is True else [whole]
            if setting is not False and whole.can_split():
                sizers.append(Sizer(job, job_dir, tp, whole.setup, latent_split=True))
        except JobError:  # a width that does not split over tp ranks
            continue
        buckets = [b if as_written else dataclasses.replace(b, max_num_seqs=1) for b in plan_buckets(job)]
        for sizer in sizers:
            base = sizer.base(gpu, reserve)
            if all(fits(base, sizer.need(b), gpu) for b in buckets):
                return tp
    return None


def fit_job(job: Job, job_dir: Path) -> Job:
    """The job as it runs where engine.gpu_memory is set: engine.context_parallel decided where it
    is absent (Plan.uses_split), and refused, with the plan's numbers and what would make it fit
    (fewer sequences where one of every bucket fits, more ranks where more would), if its buckets
    do not fit with the reserve and engine.gpu_memory_headroom kept free. Without
    engine.gpu_memory: as written (the split off unless asked)."""
    if job.engine.gpu_memory is None:
        return job
    gpu = gpu_bytes(job.engine.gpu_memory)
    setting = job.engine.context_parallel
    plan = plan_job(job, job_dir, gpu, with_split=setting is not False)
    if setting is None:
        engine = job.engine.model_copy(update={"context_parallel": plan.uses_split})
        job = job.model_copy(update={"engine": engine})
    if plan.fits:
        return job
    ways = ["lower the buckets' max_num_seqs to their 'largest'"] if all(plan.runs.largest) else []
    if tp := smallest_tp(job, job_dir, gpu, above=plan.tp, as_written=True):
        ways.append(f"use more ranks: tensor_parallel_size {tp} fits the job as written")
    elif not ways and (tp := smallest_tp(job, job_dir, gpu, above=plan.tp)):
        ways.append(f"use more ranks: tensor_parallel_size {tp} fits one sequence a bucket")
    advice = ", or ".join(ways) or "no tensor_parallel_size up to 64 fits one sequence a bucket"
    split = " with the MLA latents split" if plan.uses_split else ""
    raise JobError(f"engine.gpu_memory {job.engine.gpu_memory}: the job does not fit at TP{plan.tp}{split} "
                   f"({advice}):\n" + plan.table())
