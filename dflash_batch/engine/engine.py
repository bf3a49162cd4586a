"""The decoding loop: continuous batching inside a bucket, chunked prefill, speculative rounds.

A step is either a prefill step (prompt chunks of newly admitted sequences, under the token
budget) or one round for every decoding sequence:

    verify   the target runs [anchor, d1..d_{B-1}] at positions P..P+B-1 (causal), all logits + taps
    accept   t_j = the token the target chooses after row j; n = longest prefix with d_{j+1} == t_j;
             the round emits d_1..d_n and the bonus t_n
    context  the drafter turns the B rows' taps into context K/V (rows past P+n are rewritten by
             the next block before anything reads them)
    draft    one drafter forward over [bonus, mask x (B-1)] at P+n+1.. -> the next proposal

Target-only decoding is the same round with B = 1: no drafts, the bonus is the next token.
Sampling chooses t_j from the filtered target distribution with the row's own coin; accepting
d_{j+1} iff it equals that sample is exactly the target-only rule for a deterministic proposal
(accept with probability p(d), else sample p without d), so the output law is the target's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

from dflash_batch.engine.cache import PagePool, SeqRows, build_meta
from dflash_batch.engine.request import Completion, Request
from dflash_batch.engine.sampling import choose_tokens
from dflash_batch.engine.sequence import Sequence
from dflash_batch.plan.buckets import Bucket


class Engine:
    def __init__(self, target, drafter=None, decode=None, *, page_size: int = 16,
                 max_num_batched_tokens: int = 8192, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.target, self.drafter = target, drafter
        self.vocab_size: int = target.vocab_size
        # Hybrid targets (KDA) keep per-sequence recurrent state that verify stages and commit picks.
        self.recurrent = hasattr(target, "allocate_state")
        self.decode = decode or (lambda ids: "")
        self.page_size, self.budget = page_size, max_num_batched_tokens
        self.dtype, self.device = dtype, device

    # -- public --------------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request], bucket: Bucket) -> Iterator[Completion]:
        block = self._block_size(bucket)
        pool = PagePool(bucket.max_num_seqs * -(-(bucket.max_tokens + block) // self.page_size),
                        self.page_size)
        for model in (self.target, self.drafter if block > 1 else None):
            if model is not None:
                model.allocate_cache(pool.num_pages * self.page_size, self.dtype, self.device)
        if self.recurrent:
            self.target.allocate_state(bucket.max_num_seqs, block, self.device)
        free_states = list(range(bucket.max_num_seqs))
        pending = iter(requests)
        prefilling: list[Sequence] = []
        running: list[Sequence] = []
        exhausted = False
        with torch.inference_mode():
            while True:
                while not exhausted and len(prefilling) + len(running) < bucket.max_num_seqs:
                    req = next(pending, None)
                    if req is None:
                        exhausted = True
                        break
                    capacity = len(req.prompt_ids) + req.params.max_new_tokens + block
                    slot = free_states.pop()
                    if self.recurrent:
                        self.target.reset_state(slot)  # a freed slot still holds its last sequence's state
                    prefilling.append(Sequence(req, pool.allocate(capacity), block, slot))
                if prefilling:
                    done = self._prefill_step(prefilling, block)
                    prefilling = [s for s in prefilling if s not in done]
                    running += done
                elif running:
                    self._round(running, block)
                else:
                    return
                for seq in [s for s in running if s.finish_reason]:
                    running.remove(seq)
                    pool.release(seq.pages)
                    free_states.append(seq.state_slot)
                    yield seq.completion(self.decode)

    # -- steps ---------------------------------------------------------------------------------
    def _block_size(self, bucket: Bucket) -> int:
        if self.drafter is None or not bucket.speculation:
            return 1
        return bucket.block_size or self.drafter.block_size

    def _prefill_step(self, seqs: list[Sequence], block: int) -> list[Sequence]:
        """Run the next prompt chunk of as many sequences as the token budget allows; returns
        those whose prompt is complete (first token chosen, first block drafted)."""
        rows, chunked, budget = [], [], self.budget
        for seq in seqs:
            if budget == 0:
                break
            n = min(len(seq.prompt) - seq.prefilled, budget)
            rows.append(SeqRows(seq.pages, seq.prefilled, n, seq.prefilled + n))
            chunked.append(seq)
            budget -= n
        ids, last_rows, finishing, row = [], [], [], 0
        for seq, r in zip(chunked, rows):
            ids += seq.prompt[r.start:r.start + r.count]
            row += r.count
            seq.prefilled += r.count
            if seq.prefilled == len(seq.prompt):
                last_rows.append(row - 1)
                finishing.append(seq)
        meta = build_meta(rows, self.page_size, last_rows, self.device, [s.state_slot for s in chunked])
        logits, taps = self.target(self._ids(ids), meta)
        if block > 1:
            self.drafter.write_context(taps, meta)
        if not finishing:
            return []
        firsts = self._choose(logits, finishing, 1)
        for seq, t in zip(finishing, firsts.tolist()):
            seq.t_first = time.monotonic()
            seq.append([t])
            seq.check_stop_strings(self.decode, 1)
        self._draft([s for s in finishing if not s.finish_reason], block)
        return finishing

    def _round(self, seqs: list[Sequence], block: int) -> None:
        """One verify + accept (+ context write + draft) for every decoding sequence."""
        bs = len(seqs)
        rows = [SeqRows(s.pages, s.position, block, s.position + block) for s in seqs]
        ids = [t for s in seqs for t in [s.tokens[-1], *s.drafts]]
        meta = build_meta(rows, self.page_size, None, self.device, [s.state_slot for s in seqs], stage=True)
        logits, taps = self.target(self._ids(ids), meta)
        chosen = self._choose(logits, seqs, block).view(bs, block)
        if block > 1:
            drafts = torch.tensor([s.drafts for s in seqs], dtype=torch.int64)
            accepted = (drafts == chosen[:, :-1]).to(torch.int64).cumprod(-1).sum(-1)
            # Near max_new_tokens the block shrinks to what is left (as the DFlash reference's
            # last rounds do): drafts past it are never accepted.
            cap = torch.tensor([min(block, s.remaining) - 1 for s in seqs])
            accepted = torch.minimum(accepted, cap)
            self.drafter.write_context(taps, meta)
        else:
            accepted = torch.zeros(bs, dtype=torch.int64)
        if self.recurrent:
            # The verify left the recurrent state alone; it moves past the anchor and the n
            # accepted drafts (the bonus is the next anchor, not yet fed).
            self.target.commit([s.state_slot for s in seqs], (accepted + 1).tolist())
        for seq, n, row in zip(seqs, accepted.tolist(), chosen.tolist()):
            before = len(seq.tokens)
            seq.append(seq.drafts[:n] + [row[n]])
            seq.check_stop_strings(self.decode, before + 1)
            if seq.spec is not None:
                # Counted after a stop string's cut too: the round keeps only tokens up to it.
                seq.spec.per_round.append(len(seq.tokens) - before - 1)
        self._draft([s for s in seqs if not s.finish_reason], block)

    def _draft(self, seqs: list[Sequence], block: int) -> None:
        """Propose the next block for each sequence from its anchor (the last token)."""
        if block == 1 or not seqs:
            for s in seqs:
                s.drafts = []
            return
        mask = self.drafter.mask_token_id
        # Keys past the block's usable length stay invisible, so a shortened last block drafts
        # exactly what a shorter block would.
        rows = [SeqRows(s.pages, s.position, block, s.position + min(block, s.remaining)) for s in seqs]
        ids = [t for s in seqs for t in [s.tokens[-1]] + [mask] * (block - 1)]
        meta = build_meta(rows, self.page_size, [], self.device)
        hidden = self.drafter(self._ids(ids), meta, block_size=block)
        anchors = self._ids([s.tokens[-1] for s in seqs])
        drafts = self.drafter.propose(hidden.view(len(seqs), block, -1), anchors)
        for s, d in zip(seqs, drafts.tolist()):
            s.drafts = d

    # -- helpers -------------------------------------------------------------------------------
    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], per_seq: int) -> torch.Tensor:
        """The target's token for each logits row; `per_seq` consecutive rows per sequence."""
        def col(values: list) -> torch.Tensor:
            return torch.tensor(values, device=logits.device).repeat_interleave(per_seq)

        p = [s.params for s in seqs]
        coins = torch.cat([s.coins(per_seq) for s in seqs]).to(logits.device)
        return choose_tokens(logits, col([x.temperature for x in p]).float(), col([x.top_k for x in p]),
                             col([x.top_p for x in p]).float(), coins)
