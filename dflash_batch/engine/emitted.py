"""What a round's rows emitted, taken by their sequences on the host: tokens, logprobs, the
drafts each kept, and the end of those that are done (a stop token, the budget, a stop string,
logits that are not finite, a grammar's refusal)."""

from __future__ import annotations

from collections.abc import Callable

from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.round import ERROR
from dflash_batch.engine.sequence import Sequence
from dflash_batch.kernels.accept import STOP


def take_round(batch: DecodeBatch, running: list[Sequence | None], block: int,
               decode: Callable[[list[int]], str]) -> list[tuple[int, int, Sequence]]:
    """After a round of batch rows 0..n-1 (n = len(running)): each sequence takes what its row
    emitted, and ends if it is done (`decode`: for stop strings). Returns the drafts each
    speculating sequence kept and the drafts it verified (its row's drafts not blanked), with it."""
    n = len(running)
    scored = any(s is not None and s.logprobs is not None for s in running)
    if scored:
        logprobs = zip(batch.token_logprob[:n].tolist(), batch.top_logprob_ids[:n].tolist(),
                       batch.top_logprobs[:n].tolist())
    accepted = []
    drafts = batch.ids[:n, 1:].tolist() if block > 1 else None  # -1 past the drafts a row verified
    for i, (seq, row) in enumerate(zip(running, batch.out[:n].tolist())):
        lps = next(logprobs) if scored else None
        if seq is None:
            continue
        if row[block + 1] == ERROR:
            seq.fail("non_finite_logits", f"the target's logits at positions {seq.position}.."
                                          f"{seq.position + block - 1} are not finite")
            continue
        before, kept = len(seq.tokens), row[block]
        seq.tokens += row[:kept]
        if seq.matcher is not None and not all(map(seq.matcher.accept_token, row[:kept])):
            seq.fail("grammar_error", f"the grammar refused a token it had allowed at position {seq.position}")
            continue
        if seq.logprobs is not None:
            k = seq.params.logprobs
            for token, ids, top in list(zip(*lps))[:kept]:
                seq.logprobs.add(token, ids[:k], top[:k])
        if row[block + 1]:
            seq.finish_reason = "stop" if row[block + 1] == STOP else "length"
            seq.stop_reason = str(seq.tokens[-1]) if row[block + 1] == STOP else None
        seq.check_stop_strings(decode, before + 1)
        if seq.spec is not None and block > 1:
            # Counted after a stop string's cut too: the round keeps only tokens up to it.
            kept_drafts = len(seq.tokens) - before - 1
            verified = sum(d >= 0 for d in drafts[i])
            if seq.finish_reason and kept_drafts < verified:
                # The round that ends a sequence counts the drafts up to its last token, the
                # last one included only if the target rejected it (the last token is then
                # the target's own). A draft accepted as the last token counts as the
                # round's token of its own, as in acc_len; drafts past the end never could.
                verified = kept_drafts + (seq.tokens[-1] != drafts[i][kept_drafts])
            seq.spec.add(kept_drafts, verified)
            accepted.append((kept_drafts, verified, seq))
    return accepted
