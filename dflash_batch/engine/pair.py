"""A drafter and its target: check that they fit, then pair them (the drafter borrows the
target's embedding and head; the target taps the layers the drafter reads)."""

from __future__ import annotations

from dflash_batch import parallel
from dflash_batch.models.dflash import draft_value


def check_pair(target, drafter) -> None:
    """Refuse (ValueError) a drafter whose taps, hidden size or vocabulary do not fit the
    target, before any cache is allocated."""
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
        raise ValueError("the drafter does not fit the target: " + "; ".join(problems))


def attach_drafter(target, drafter) -> None:
    """Pair a loaded drafter with its target: check they fit, lend the drafter the target's
    embedding and head, and make the target tap the drafter's layers on the drafter's stream."""
    check_pair(target, drafter)
    if parallel.last_stage():  # under pipeline stages the drafter runs on the last, beside the head
        drafter.bind_target(target.embed_tokens, target.lm_head)
    target.set_taps(drafter.target_layer_ids, draft_value(drafter.config, "aux_hidden_stream"))
