"""Build the engine for a job: load target and drafter, check that they fit."""

from __future__ import annotations

import sys

import torch

from dflash_batch import parallel
from dflash_batch.engine.engine import Engine
from dflash_batch.job import Job, JobError
from dflash_batch.models.dflash import draft_value
from dflash_batch.models.loader import load_model
from dflash_batch.plan.tokenize import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load(path: str, dtype: torch.dtype, device: str, role: str):
    try:
        return load_model(path, dtype, device)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        raise JobError(f"model.{role} {path}: {e}") from None


def check_pair(target, drafter) -> None:
    """Refuse a drafter whose taps, hidden size or vocabulary do not fit the target, before any
    cache is allocated."""
    problems = []
    if drafter.config["hidden_size"] != target.hidden_size:
        problems.append(f"hidden_size {drafter.config['hidden_size']} != target's {target.hidden_size}")
    if drafter.config["vocab_size"] != target.vocab_size:
        problems.append(f"vocab_size {drafter.config['vocab_size']} != target's {target.vocab_size}")
    layers = target.config.get("num_hidden_layers")
    ids = drafter.target_layer_ids
    if len(set(ids)) != len(ids) or any(not 0 <= i < layers for i in ids):
        problems.append(f"target_layer_ids {ids} are not unique ids in [0, {layers})")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {drafter.mask_token_id} is outside the vocabulary")
    if problems:
        raise JobError("the drafter does not fit the target: " + "; ".join(problems))


def attach_drafter(target, drafter) -> None:
    """Pair a loaded drafter with its target: check they fit, lend the drafter the target's
    embedding and head, and make the target tap the drafter's layers on the drafter's stream."""
    check_pair(target, drafter)
    drafter.bind_target(target.embed_tokens, target.lm_head)
    try:
        target.set_taps(drafter.target_layer_ids, draft_value(drafter.config, "aux_hidden_stream"))
    except ValueError as e:
        raise JobError(str(e)) from None


def build_engine(job: Job, tokenizer: Tokenizer) -> Engine:
    """Load the job's target (and drafter), check they fit, and build the engine."""
    device = "cuda" if torch.cuda.is_available() and job.engine.backend != "torch" else "cpu"
    dtype = DTYPES[job.model.dtype]
    target = _load(job.model.target, dtype, device, "target")
    drafter = None
    if job.model.drafter:
        drafter = _load(job.model.drafter, dtype, device, "drafter")
        try:
            attach_drafter(target, drafter)
        except JobError as e:
            raise JobError(f"model.drafter {job.model.drafter}: {e}") from None
        if parallel.rank() == 0:
            print(f"taps: layers={tuple(target.tap_ids)} stream={target.tap_stream}", file=sys.stderr)
    return Engine(target, drafter, tokenizer.decode, page_size=job.engine.page_size,
                  max_num_batched_tokens=job.engine.max_num_batched_tokens, dtype=dtype, device=device)
