"""From a job to an engine: which device, attention backend, CUDA graphs and compilation the
job's settings and this host allow (refusing any setting that cannot take effect, with the
reason), then the loaded, paired models. The engine itself knows nothing of jobs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch

from dflash_batch import parallel
from dflash_batch.backends.latent_split import LatentSplit
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.pair import attach_drafter
from dflash_batch.job import AutoSpeculationSpec, Job, JobError
from dflash_batch.kernels import _triton
from dflash_batch.models.dflash import draft_value
from dflash_batch.models.layers.expert_parallel import Placement
from dflash_batch.models.loader import load_config, load_model
from dflash_batch.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
QWEN3, KIMI_K3 = "Qwen3ForCausalLM", "KimiK3ForConditionalGeneration"


@dataclass(frozen=True)
class EngineSetup:
    device: str
    backend: str                    # "torch" | "flashinfer"
    cuda_graphs: bool
    compile: bool
    capture_sizes: list[int] | None
    kernels: str                    # "triton": kernels/' Triton kernels (MoE, AttnRes, ...); "torch": references
    compile_if_it_pays: bool = False  # a bucket of few rounds runs uncompiled (engine.compile absent)
    context_parallel: bool = False  # MLA latents split across the ranks by token (backends/latent_split.py)
    per_row: bool = True  # auto buckets' rows may verify different numbers of drafts (engine/row_drafts.py)
    expert_placement: Placement | None = None  # routed experts sharded whole over every rank by it


    def describe(self) -> str:
        graphs = f"on, sizes {self.capture_sizes}" if self.cuda_graphs else "off"
        padded = f", rounds padded to {self.capture_sizes}" if self.capture_sizes and not self.cuda_graphs else ""
        compiled = ("where it pays" if self.compile_if_it_pays else "on") if self.compile else "off"
        split = " context_parallel=on" if self.context_parallel else ""
        placed = self.expert_placement
        if placed is not None:
            split += f" expert_parallel={placed.ranks} ranks x {placed.slots} slots"
        return (f"engine: device={self.device} backend={self.backend}{split} kernels={self.kernels} "
                f"cuda_graphs={graphs} compile={compiled}{padded} per_row_drafts={'on' if self.per_row else 'off'}")


@dataclass(frozen=True)
class _Checkpoint:
    """What a checkpoint's config.json says that decides what can run it."""

    architecture: str
    attention: str            # the DFlash attention mode: gqa | mla
    head_dim: int | None
    window: int | None        # a drafter's sliding window
    block: int | None         # a drafter's block size
    packed_experts: bool      # routed experts stored as MXFP4 (compressed-tensors)
    latent: tuple[int | None, int | None]  # an MLA model's (kv_lora_rank, qk_rope_head_dim)
    causal: bool              # a drafter's block attends causally
    layers: int | None        # decoder layers (what pipeline stages split)
    experts: int              # routed experts a MoE layer (0: a dense model)

    @classmethod
    def read(cls, path: str, role: str) -> _Checkpoint:
        try:
            config = load_config(path)
        except (OSError, ValueError) as e:
            raise JobError(f"model.{role} {path}: {e}") from None
        text = config.get("text_config", config)
        heads = text.get("num_attention_heads")
        head_dim = text.get("head_dim") or (text["hidden_size"] // heads if heads and "hidden_size" in text else None)
        quant = config.get("quantization_config") or {}
        return cls((config.get("architectures") or ["?"])[0], draft_value(text, "attention_mode", "gqa"), head_dim,
                   text.get("sliding_window") if text.get("layer_types") else None,
                   draft_value(text, "block_size"), quant.get("quant_method") == "compressed-tensors",
                   (text.get("kv_lora_rank"), text.get("qk_rope_head_dim")), bool(text.get("is_causal")),
                   text.get("num_hidden_layers"), text.get("num_experts") or 0)

    @property
    def mla(self) -> bool:
        return self.architecture == KIMI_K3 or self.attention == "mla"


def _why_host_reads(target: _Checkpoint, kernels: str) -> str | None:
    """Why the target's decode round would read tensor values on the host with these `kernels`
    (EngineSetup.kernels; None: it reads none, tests/test_round_host_reads.py, so it can be
    captured as CUDA graphs or compiled; any DFlash drafter reads none)."""
    if target.architecture == QWEN3:
        return None
    if target.architecture != KIMI_K3:
        return f"{target.architecture} reads lengths on the host inside its forward"
    if not target.packed_experts:
        return "Kimi-K3's routed experts, stored unpacked (not MXFP4), are grouped by expert on the host"
    if kernels != "triton":
        return ("Kimi-K3's MXFP4 experts are grouped by expert on the host by the torch path (the Triton "
                "kernel, on CUDA, groups them on the device)")
    return None


def _why_not_flashinfer(job: Job, target: _Checkpoint, drafter: _Checkpoint | None) -> str | None:
    """Why flashinfer cannot run this pair (None: it can)."""
    if target.architecture not in (QWEN3, KIMI_K3):
        return f"it runs Qwen3 and Kimi-K3 targets, not {target.architecture}"
    if job.model.dtype in ("float32", "float64"):
        return "its kernels are half precision (set model.dtype: bfloat16 or float16)"
    models = [c for c in (target, drafter) if c]
    dims = {c.head_dim for c in models if not c.mla}
    if not dims <= {64, 128, 256}:
        return f"its GQA kernels take head_dim 64, 128 or 256, not {sorted(dims - {64, 128, 256})}"
    latents = {c.latent for c in models if c.mla}
    if not latents <= {(512, 64)}:
        other = sorted(latents - {(512, 64)}, key=str)
        return f"its MLA kernels take a 512 + 64 latent (kv_lora_rank + qk_rope_head_dim), not {other}"
    blocks = [b.block_size or (drafter.block if drafter else 1) for b in job.resolved_buckets() if b.speculation]
    if drafter and drafter.window and blocks and drafter.window < max(blocks):
        return (f"the drafter's sliding window ({drafter.window}) is shorter than its block ({max(blocks)}): "
                "flashinfer's window has no right-hand bound inside a non-causal block")
    if drafter and drafter.mla and drafter.window and drafter.causal:
        return "its MLA path takes the drafter's sliding layers non-causal (TokenSpeed's DFlash2), not causal"
    return None


def resolve_engine(job: Job, cuda: bool | None = None, flashinfer: bool | None = None,
                   triton: bool | None = None) -> EngineSetup:
    """The engine settings this job gets on this host (`cuda`, `flashinfer`, `triton`: what the
    host has; None = look). A setting that cannot take effect is a JobError naming it and why."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    flashinfer = importlib.util.find_spec("flashinfer") is not None if flashinfer is None else flashinfer
    triton = _triton.available() if triton is None else triton
    e, tp = job.engine, job.model.tensor_parallel_size
    target_ckpt = _Checkpoint.read(job.model.target, "target")
    drafter_ckpt = _Checkpoint.read(job.model.drafter, "drafter") if job.model.drafter else None

    why_not_flashinfer = (
        "it needs a CUDA device and this host has none" if not cuda else
        "flashinfer is not installed (pip install flashinfer-python)" if not flashinfer else
        _why_not_flashinfer(job, target_ckpt, drafter_ckpt))
    for b in job.resolved_buckets():
        drafts = getattr(b.speculation, "drafts", None)
        block = b.block_size or (drafter_ckpt.block if drafter_ckpt else 1)
        if drafts is not None and drafts >= block:
            raise JobError(f"bucket {b.max_tokens}: speculation drafts {drafts} must be below the block "
                           f"({block}: the anchor and {block - 1} drafts)")
    if e.backend == "flashinfer" and why_not_flashinfer:
        raise JobError(f"engine.backend: flashinfer cannot run here: {why_not_flashinfer}")
    backend = "flashinfer" if e.backend != "torch" and why_not_flashinfer is None else "torch"
    # backend: torch is the CPU reference path, even on a CUDA host.
    device = "cuda" if cuda and e.backend != "torch" else "cpu"
    kernels = "triton" if device == "cuda" and triton else "torch"  # as kernels.ops(device) picks them

    host_reads = _why_host_reads(target_ckpt, kernels)
    # Under tensor parallelism every rank captures the same rounds, NCCL collectives inside them.
    # flashinfer lays a round out whole, so micro-batches run as lanes (engine/lanes.py), eagerly.
    lanes = e.micro_batches > 1 and backend == "flashinfer"
    groups_agree = job.model.expert_parallel and job.model.data_parallel_size > 1
    why_no_graphs = (
        "they need a CUDA device (this host has none, or engine.backend is torch)" if device != "cuda" else
        host_reads or (f"engine.micro_batches {e.micro_batches} on flashinfer runs rounds in lanes, eagerly"
                       if lanes else None)
        or ("model.expert_parallel across data-parallel groups agrees each forward's rows on the host (a "
            "captured round padded to its size instead: not yet)" if groups_agree else None))
    if e.cuda_graphs and why_no_graphs:
        raise JobError(f"engine.cuda_graphs: true cannot take effect: {why_no_graphs}")
    graphs = why_no_graphs is None if e.cuda_graphs is None else e.cuda_graphs

    pp = job.model.pipeline_parallel_size
    if target_ckpt.layers is not None and pp > target_ckpt.layers:
        raise JobError(f"model.pipeline_parallel_size {pp}: the target has {target_ckpt.layers} layers and each "
                       "stage needs one")
    if e.micro_batches > 1 and pp == 1:
        raise JobError(f"engine.micro_batches {e.micro_batches}: there are no pipeline stages to keep busy "
                       "(model.pipeline_parallel_size is 1)")
    why_no_compile = (
        "compilation is the CPU path (on a GPU the round runs under CUDA graphs)" if device != "cpu" else
        host_reads or ("tensor_parallel_size > 1 is not compiled yet" if tp > 1 else None)
        or ("pipeline_parallel_size > 1 is not compiled yet" if pp > 1 else None))
    if e.compile and why_no_compile:
        raise JobError(f"engine.compile: true cannot take effect: {why_no_compile}")
    compiled = why_no_compile is None if e.compile is None else e.compile

    why_no_split = _why_no_split(job, target_ckpt, drafter_ckpt)
    if e.context_parallel and why_no_split:
        raise JobError(f"engine.context_parallel: true cannot take effect: {why_no_split}")

    largest = max(b.max_num_seqs or e.max_num_seqs for b in job.resolved_buckets())
    sizes = e.cudagraph_capture_sizes
    if sizes is not None and not graphs:
        raise JobError("engine.cudagraph_capture_sizes is set but CUDA graphs are off"
                       f" ({why_no_graphs or 'engine.cuda_graphs: false'}); remove it")
    if graphs:
        sizes = sorted(set(sizes or [1 << i for i in range(largest.bit_length()) if 1 << i < largest] + [largest]))
        if sizes[-1] < largest:
            raise JobError(f"engine.cudagraph_capture_sizes {sizes} must reach every bucket's max_num_seqs "
                           f"(the largest is {largest})")
    why_no_per_row = (
        "pipeline stages verify one number of drafts a round" if pp > 1 else
        "flashinfer lays a captured round out on the host before its drafts exist (engine.cuda_graphs: false "
        "runs rounds eagerly, each row its own count)" if backend == "flashinfer" and graphs else None)
    asked = [b.max_tokens for b in job.resolved_buckets() if getattr(b.speculation, "per_row", False)]
    if asked and why_no_per_row:
        raise JobError(f"bucket {asked[0]}: speculation {{per_row: true}} cannot take effect: {why_no_per_row} "
                       "(speculation: auto keeps one number a round here)")
    # engine.context_parallel absent: sizing.fit_job decides it where engine.gpu_memory is set; off here.
    return EngineSetup(device, backend, graphs, compiled, sizes, kernels, compiled and e.compile is None,
                       bool(e.context_parallel), why_no_per_row is None, expert_placement(job, target_ckpt))


def expert_placement(job: Job, target: _Checkpoint) -> Placement | None:
    """Where each rank's routed experts come from under model.expert_parallel (None: cut across the
    tensor-parallel ranks): the job's placement file, checked against the target and the ranks,
    else the balanced default."""
    m = job.model
    if not m.expert_parallel:
        return None
    ranks = m.data_parallel_size * m.tensor_parallel_size
    if not target.experts:
        raise JobError(f"model.expert_parallel: the target {m.target} has no routed experts ({target.architecture})")
    if target.experts % ranks:
        raise JobError(f"model.expert_parallel: the target's {target.experts} routed experts do not split evenly "
                       f"over {ranks} ranks (data_parallel_size {m.data_parallel_size} x tensor_parallel_size "
                       f"{m.tensor_parallel_size})")
    if m.expert_placement is None:
        return Placement(target.experts, ranks, m.redundant_experts, {})
    try:
        placement = Placement.from_json(orjson.loads(Path(m.expert_placement).read_bytes()), m.expert_placement)
    except (OSError, orjson.JSONDecodeError, ValueError) as e:
        raise JobError(f"model.expert_placement: {e}") from None
    wanted = (target.experts, ranks, m.redundant_experts)
    if (placement.experts, placement.ranks, placement.redundant) != wanted:
        raise JobError(f"model.expert_placement {m.expert_placement}: it places {placement.experts} experts on "
                       f"{placement.ranks} ranks with {placement.redundant} replica slots each; this job has "
                       f"{wanted[0]} experts, {ranks} ranks and model.redundant_experts {m.redundant_experts} "
                       "(write it again with `dflash-batch experts place --ranks --redundant`)")
    return placement


def why_no_latent_split(job: Job) -> str | None:
    """Why the MLA latents of this job's pair cannot be split across its ranks (None: they can),
    from the checkpoints' config.json (the plan asks it of what it sizes)."""
    drafter = _Checkpoint.read(job.model.drafter, "drafter") if job.model.drafter else None
    return _why_no_split(job, _Checkpoint.read(job.model.target, "target"), drafter)


def _why_no_split(job: Job, target: _Checkpoint, drafter: _Checkpoint | None) -> str | None:
    """Why the MLA latents cannot be split across this job's ranks (None: they can)."""
    tp, ps = job.model.tensor_parallel_size, job.engine.page_size
    if target.architecture != KIMI_K3:
        return f"it splits MLA latent caches, and {target.architecture} keeps GQA caches (split by head already)"
    if drafter and not drafter.mla:
        return "model.drafter keeps GQA caches (split by head already), not MLA latents"
    if tp == 1:
        return "tensor_parallel_size is 1: there are no ranks to split across"
    if ps % tp:
        return f"engine.page_size {ps} is not a multiple of tensor_parallel_size {tp} (a page splits evenly)"
    return None


def use_compile_cache(job: Job) -> Path:
    """Point torch.compile's and Triton's caches at the job's cache directory (engine.cache_dir,
    else $DFLASH_CACHE_DIR, else OUTPUT_DIR/.compile_cache) unless the environment names them:
    a resume, a rerun and an array's other tasks then load what the first process compiled.
    Both caches write each entry whole and rename it, so concurrent tasks share them safely."""
    root = Path(job.engine.cache_dir or os.environ.get("DFLASH_CACHE_DIR") or Path(job.output.dir) / ".compile_cache")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    return root


def _load(path: str, dtype: torch.dtype, device: str, role: str, expert_placement: Placement | None = None):
    try:
        return load_model(path, dtype, device, expert_placement)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        raise JobError(f"model.{role} {path}: {e}") from None


def _attention(setup: EngineSetup):
    if setup.backend == "flashinfer":
        from dflash_batch.backends.flashinfer_attention import FlashInferAttention

        return FlashInferAttention(setup.device, split=_split(setup))
    from dflash_batch.backends.torch_attention import TORCH, TorchAttention

    return TorchAttention(_split(setup)) if setup.context_parallel else TORCH


def _split(setup: EngineSetup) -> LatentSplit | None:
    return LatentSplit(parallel.world_size(), parallel.rank()) if setup.context_parallel else None


def _stage_line(target, job: Job) -> str:
    """What this rank's stage holds: "rank R of N (stage S of P) on HOST: TP T, target layers a-b of
    L[, the LM head and the drafter][; rounds in M interleaved lanes]"."""
    held, last, micro = target.held, parallel.last_stage(), job.engine.micro_batches
    tail = (", the LM head" + (" and the drafter" if job.model.drafter else "")) if last else ""
    groups = f"; rounds in {micro} interleaved lanes" if micro > 1 else ""
    return (f"{parallel.describe_rank()}: TP{parallel.world_size()}, target layers {held.start}-{held.stop - 1} "
            f"of {target.num_layers}{tail}{groups}")


def build_engine(job: Job, tokenizer: Tokenizer, setup: EngineSetup | None = None) -> Engine:
    """Load the job's target (and drafter), check they fit, and build the engine."""
    setup = setup or resolve_engine(job)
    if setup.compile or setup.device == "cuda":
        use_compile_cache(job)
    dtype = DTYPES[job.model.dtype]
    target = _load(job.model.target, dtype, setup.device, "target", setup.expert_placement)
    if tokenizer.vocab_size > target.vocab_size:
        raise JobError(f"the tokenizer of {job.model.tokenizer or job.model.target} has {tokenizer.vocab_size} "
                       f"tokens but model.target {job.model.target} has a vocabulary of {target.vocab_size}: "
                       "they do not belong together (set model.tokenizer to the target's own)")
    drafter = None
    say = (lambda line: print(line, file=sys.stderr)) if parallel.run_rank() == 0 else (lambda line: None)
    if parallel.stage()[1] > 1 and parallel.rank() == 0:  # the layout, a line from each stage's first rank
        print(_stage_line(target, job), file=sys.stderr)
    if job.model.drafter:
        drafter = _load(job.model.drafter, dtype, setup.device, "drafter")
        try:
            attach_drafter(target, drafter)
        except ValueError as e:
            raise JobError(f"model.drafter {job.model.drafter}: {e}") from None
        say(f"taps: layers={tuple(target.tap_ids)} stream={target.tap_stream}")
    say(setup.describe())
    auto = job.engine.auto_speculation or AutoSpeculationSpec()
    return Engine(target, drafter, tokenizer.decode, page_size=job.engine.page_size,
                  max_num_batched_tokens=job.engine.max_num_batched_tokens, dtype=dtype, device=setup.device,
                  attention=_attention(setup), capture_sizes=setup.capture_sizes, cuda_graphs=setup.cuda_graphs,
                  compile=setup.compile, compile_if_it_pays=setup.compile_if_it_pays,
                  share_prompts=job.engine.share_prompts,
                  shared_head_tokens=job.engine.shared_head_tokens, log=say,
                  auto_speculation=(auto.min_acc_len, auto.rounds), micro_batches=job.engine.micro_batches,
                  per_row=setup.per_row, turn_caches=job.engine.turn_caches)

