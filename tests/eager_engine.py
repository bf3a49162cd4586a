"""The oracle for the static round: the engine's rounds as they were before it (eager, with
per-sequence Python bookkeeping and host syncs every round, the draft at the end of a round),
kept as the tests' reference. Prefill and first tokens are the engine's own. It differs from
the old loop in the coins only: the token at position x is sampled at coin(seed, x) (kernels/
coins.py), as the static round does, instead of from a per-sequence generator's stream.

One round for every decoding sequence, with B the block size:
    verify   the target runs [anchor, d1..d_{B-1}] at positions P..P+B-1 (causal), all logits + taps
    accept   t_j = the token the target chooses after row j; n = longest prefix with d_{j+1} == t_j;
             the round emits d_1..d_n and the bonus t_n
    context  the drafter turns the B rows' taps into context K/V
    draft    one drafter forward over [bonus, mask x (B-1)] at P+n+1.. -> the next proposal
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from dflash_batch.engine.cache import SeqRows, build_meta, row_pages
from dflash_batch.engine.engine import Engine
from dflash_batch.engine.heads import HeadPool
from dflash_batch.engine.request import Completion, Request
from dflash_batch.engine.sampling import choose_tokens
from dflash_batch.engine.sequence import Sequence
from dflash_batch.plan.buckets import Bucket


def remaining(seq: Sequence) -> int:
    """Tokens a sequence may still add, the anchor's own position included."""
    return seq.params.max_new_tokens - len(seq.tokens) + 1


class EagerEngine(Engine):
    def generate(self, requests: Iterable[Request], bucket: Bucket) -> Iterator[Completion]:
        block = self._block_size(bucket)
        pages_per_row = -(-(bucket.max_tokens + block) // self.page_size)
        for model in (self.target, self.drafter if block > 1 else None):
            if model is not None:
                model.allocate_cache(bucket.max_num_seqs * pages_per_row * self.page_size, self.dtype, self.device)
        if self.recurrent:
            self.target.allocate_state(bucket.max_num_seqs, bucket.max_num_seqs, block, self.device)
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
                    slot = free_states.pop()
                    if self.recurrent:
                        self.target.reset_state(slot)
                    prefilling.append(Sequence(req, row_pages(slot, pages_per_row), block, slot))
                if prefilling:
                    no_heads = HeadPool({}, 0, 0, self.page_size)
                    done = self._prefill(self._prefill_chunk(prefilling, self.budget, no_heads.stop), block, [],
                                         no_heads)
                    self._draft([s for s in done if not s.finish_reason], block)
                    prefilling = [s for s in prefilling if s not in done]
                    running += done
                elif running:
                    self._eager_round(running, block)
                else:
                    return
                for seq in [s for s in running if s.finish_reason]:
                    running.remove(seq)
                    free_states.append(seq.row)
                    yield seq.completion(self.decode)

    def _eager_round(self, seqs: list[Sequence], block: int) -> None:
        bs = len(seqs)
        rows = [SeqRows(s.pages, s.position, block, s.position + block) for s in seqs]
        ids = [t for s in seqs for t in [s.tokens[-1], *s.drafts]]
        meta = build_meta(rows, self.page_size, None, self.device, [s.row for s in seqs], stage=True)
        logits, taps = self.target(torch.tensor(ids), meta)
        positions = [range(s.position + 1, s.position + 1 + block) for s in seqs]
        chosen = self._choose(logits, seqs, block, positions).view(bs, block)
        if block > 1:
            drafts = torch.tensor([s.drafts for s in seqs], dtype=torch.int64)
            accepted = (drafts == chosen[:, :-1]).to(torch.int64).cumprod(-1).sum(-1)
            # Near max_new_tokens the block shrinks to what is left: drafts past it are never accepted.
            accepted = torch.minimum(accepted, torch.tensor([min(block, remaining(s)) - 1 for s in seqs]))
            self.drafter.write_context(taps, meta)
        else:
            accepted = torch.zeros(bs, dtype=torch.int64)
        if self.recurrent:
            self.target.commit(torch.tensor([s.row for s in seqs]), accepted + 1)
        for seq, n, row in zip(seqs, accepted.tolist(), chosen.tolist()):
            before = len(seq.tokens)
            seq.append(seq.drafts[:n] + [row[n]])
            seq.check_stop_strings(self.decode, before + 1)
            if seq.spec is not None:
                seq.spec.per_round.append(len(seq.tokens) - before - 1)
        self._draft([s for s in seqs if not s.finish_reason], block)

    def _draft(self, seqs: list[Sequence], block: int) -> None:
        """Propose the next block for each sequence from its anchor (the last token)."""
        for s in seqs:
            s.drafts = []
        if block == 1 or not seqs:
            return
        mask = self.drafter.mask_token_id
        # Keys past the block's usable length stay invisible.
        rows = [SeqRows(s.pages, s.position, block, s.position + min(block, remaining(s))) for s in seqs]
        ids = [t for s in seqs for t in [s.tokens[-1]] + [mask] * (block - 1)]
        hidden = self.drafter(torch.tensor(ids), build_meta(rows, self.page_size, []), block_size=block)
        drafts = self.drafter.propose(hidden.view(len(seqs), block, -1), torch.tensor([s.tokens[-1] for s in seqs]))
        for s, d in zip(seqs, drafts.tolist()):
            s.drafts = d

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], per_seq: int, positions: list) -> torch.Tensor:
        """The target's token for each logits row; row j of a sequence chooses the token at positions[seq][j]."""
        def col(values: list) -> torch.Tensor:
            return torch.tensor(values).repeat_interleave(per_seq)

        p = [s.params for s in seqs]
        where = torch.tensor([x for pos in positions for x in pos])
        return choose_tokens(logits, col([x.temperature for x in p]).float(), col([x.top_k for x in p]),
                             col([x.top_p for x in p]).float(), col([x.seed for x in p]), where,
                             min_p=col([x.min_p for x in p]).float())
