"""One speculative round for the first n rows of a DecodeBatch, as a function of its tensors:

    prepare  positions, cache slots and the draft block [anchor, mask x (B-1)] from the state
    draft    one drafter forward over the block -> d_1..d_{B-1} (greedy proposal)
    verify   the target runs [anchor, d_1..d_{B-1}] at positions P..P+B-1 (causal): logits + taps
    choose   t_j = argmax, or the row's seeded sample of the filtered distribution (after the
             row's logit bias, penalties along the drafted path, and held stop ids)
    (structured output runs draft, lets the host mask each verify row by its grammar's state
     after the drafts before it, then runs the rest: a draft the grammar refuses is never chosen)
    accept   n = longest prefix with d_{j+1} == t_j; emit t_0..t_n (cut by budget and stop
             tokens); the last emitted token is the next anchor; pos and budget advance
    context  the drafter turns the B rows' taps into context K/V (rows past the accepted ones are
             rewritten by the next draft before anything reads them)
    commit   hybrid targets keep the recurrent state after anchor + n accepted drafts

The draft comes first, so a round needs only the previous round's anchor: a sequence leaves
prefill with its first token and is ready. Nothing in a round reads a tensor's value on the
host or branches on one: it can be captured as one CUDA graph per batch size. Target-only
decoding is the same round with B = 1 (no draft, no context).

A round may verify fewer drafts than the block proposes (engine/schedule.py decides how many):
with width W <= B the target runs [anchor, d_1..d_{W-1}] only, the drafts past them are
blanked so none can be accepted, and the drafter's context is written for those W rows (all a
next round can read: it starts at most W positions on). W = 1 runs no draft at all but keeps
the drafter's context current. Each accepted token is still t_j = the target's choice at its
position, so any width gives target-only output. Rows may also verify different numbers
(engine/row_drafts.py): the draft blanks each row's drafts past its own and the verify runs the
rows packed, a ragged forward.

Under pipeline stages (models/stages.py) the drafter drafts on the last stage, where the taps
arrive, and the drafts go to every stage; the verify passes through the stages; the last stage
decides (choose, accept) and the batch's ids, positions, budgets and results (and logprobs) go
back to every stage, whose recurrent layers then commit the same accepted rows.

Sampling is exact: t_j follows the target's filtered law with the coin of position P+j+1, and
accepting d_{j+1} iff it equals t_j is the target-only rule for a deterministic proposal
(accept with probability p(d), else sample p without d). Every emitted token at position x is
the sample of its prefix's law at coin(seed, x), so the output equals target-only sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from dflash_batch import parallel
from dflash_batch.backends.meta import AttentionBackend, AttnMeta, stagger
from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.choice import choose_verified
from dflash_batch.engine.row_drafts import kind_of, packed, ragged_rows, row_widths

ERROR = 3  # a finished code beside kernels.accept's STOP and LENGTH: the logits were not finite


def round_kv_lens(running: list, block: int, width: int) -> dict[str, list[int]]:
    """Each row's key lengths in a round's draft and verify, for backends that plan on the host
    (prepare computes the same on the device); a row without a sequence is padding."""
    positions = [s.position if s is not None else 0 for s in running]
    budgets = [s.params.max_new_tokens - len(s.tokens) if s is not None else 0 for s in running]
    return {"verify": [p + width for p in positions],
            "draft": [p + min(block, b + 1) for p, b in zip(positions, budgets)]}


class Round:
    """`compile`: run the round through torch.compile (inductor fuses it into C++ loops on the
    CPU, ~1.7x there); batch sizes and key lengths are symbolic, so one compilation serves every
    round of every bucket with this block size (a size of 1 would be compiled again: the engine
    pads to 2). `eager`: run this bucket's rounds uncompiled all the same (where compiling would
    not pay: engine/compile_policy.py)."""

    def __init__(self, target, drafter, block: int, page_size: int, ops: SimpleNamespace,
                 attention: AttentionBackend, compile: bool = False, micro_batches: int = 1):
        self.target, self.drafter, self.block = target, drafter if block > 1 else None, block
        self.page_size, self.ops, self.attention = page_size, ops, attention
        self.micro_batches = micro_batches  # the verify's groups of sequences under pipeline stages
        self.recurrent = hasattr(target, "commit")
        self.mask_id = self.drafter.mask_token_id if self.drafter is not None else 0
        # Made on the first compiled call: a process that runs every bucket eagerly never imports
        # torch's compiler (a second at start-up).
        self.step: Callable[..., None] | None = None
        self.eager = not compile
        self.compiled = False  # a compiled round has run: its cost is paid

    def __call__(self, batch: DecodeBatch, n: int, greedy: bool, max_kv: int, width: int | None = None,
                 per_row: bool = False, fixed: bool = False) -> None:
        """Decode one round for rows 0..n-1; the result lands in batch.out[:n]. `greedy`: every
        row has temperature 0 (skips the sampler); `max_kv`: a host-side bound on key lengths;
        `width`: rows verified a sequence (anchor + drafts), default the block; `per_row`,
        `fixed`: see draft (an eager ragged round is not compiled: its layout comes from a host
        read, and every layout would be a graph of its own)."""
        if self.eager or (per_row and not fixed):  # a ragged round reads its rows' counts on the host
            self.run(batch, n, greedy, max_kv, width or self.block, per_row, fixed)
            return
        if self.step is None:
            self.step = torch.compile(self.run, dynamic=True)
        self.step(batch, n, greedy, max_kv, width or self.block, per_row, fixed)
        self.compiled = True

    def run(self, batch: DecodeBatch, n: int, greedy: bool, max_kv: int, width: int, per_row: bool = False,
            fixed: bool = False) -> None:
        self.verify(batch, n, greedy, self.draft(batch, n, max_kv, width, per_row=per_row, fixed=fixed))

    def draft(self, batch: DecodeBatch, n: int, max_kv: int, width: int | None = None, lane: bool = False,
              per_row: bool = False, fixed: bool = False) -> tuple:
        """prepare + draft: batch.ids[:n, 1:] hold the proposal after it (none when `width` is 1).
        Returns what verify reads: its positions, meta and input ids (None: batch.ids), `width`
        rows a sequence. `lane`: a lane's round (engine/lanes.py): the drafts stay on the last
        stage, which posts them itself, and the verify goes through the stages whole.
        `per_row`: each row verifies the drafts worth verifying (engine/row_drafts.py), at most
        n * (width - 1) in all, the rest blanked; the verify runs them packed, in n * width rows
        (`fixed`: a captured round's shape) or exactly the rows chosen (one host read)."""
        B, b, W = self.block, batch, width or self.block
        groups = self.micro_batches if not lane and self.attention.splits_rounds else 1
        ids = b.ids[:n]
        draft_ids, positions, slots, draft_kv, verify_kv = self.ops.prepare(
            ids, b.pos[:n], b.budget[:n], b.tables[:n], self.page_size, self.mask_id)

        def meta(name: str, kv_lens: torch.Tensor, **extra) -> AttnMeta:
            layout = {"positions": positions, "slots": slots, "q_index": b.q_index[:n],
                      "q_positions": positions.view(n, B), "dense": True, **extra}
            return AttnMeta(kv_lens=kv_lens, block_tables=b.tables[:n], page_size=self.page_size, max_kv=max_kv,
                            rows_own_slots=b.rows_own_slots, name=name, backend=self.attention, rows=b.row_ids[:n],
                            ring=b.ring, **layout)

        if self.drafter is not None and W > 1:
            if parallel.last_stage():  # under pipeline stages the drafter runs where the taps arrive
                hidden = self.drafter(draft_ids, meta("draft", draft_kv, logits_rows=b.no_rows), block_size=B)
                if per_row:
                    ids[:, 1:], b.draft_probs[:n] = self.drafter.propose_scored(hidden.view(n, B, -1), ids[:, 0])
                    kinds = kind_of((b.temperature[:n, 0] > 0).long(), b.draft_last[:n])
                    widths = row_widths(b.draft_probs[:n], b.budget[:n], kinds, b.draft_edges, b.draft_params,
                                        n * (W - 1))
                    ids.masked_fill_(torch.arange(B, device=ids.device) >= widths[:, None], -1)
                else:
                    ids[:, 1:] = self.drafter.propose(hidden.view(n, B, -1), ids[:, 0])
            if not lane:  # the first stage embeds the drafts; every stage's host reads them
                parallel.from_last_stage(ids)
        if per_row and W > 1:
            widths = (ids >= 0).sum(1)  # the anchor and the drafts left (row_widths blanked the rest)
            if fixed:  # a captured round's shape: n x W rows, a row up to the block
                tokens, span, steps = n * W, B, None
            else:  # the rows chosen; a recurrent layer runs each sequence's own (meta.stagger)
                counts, starts = torch.stack([widths, b.pos[:n]]).tolist()
                tokens, span, steps = sum(counts), max(counts), stagger(counts, ids.device)
                if self.attention.plans_on_host:  # the verify's layout, now that the counts are known
                    self.attention.plan_round(b, n, {"verify": [p + c for p, c in zip(starts, counts)]}, False,
                                              {"verify": counts})
            live, at, logits_rows = ragged_rows(widths, span, tokens)
            grid = positions.view(n, B)[:, :span]
            verify = meta("verify", verify_kv - (B - widths), positions=packed(grid, at, tokens, 0),
                          slots=packed(slots.view(n, B)[:, :span], at, tokens, -1), q_index=at,
                          q_positions=torch.where(live, grid, -1), dense=False, logits_rows=logits_rows,
                          state_ids=b.state_slot[:n], stage=self.recurrent, first_seq=b.first_row, stagger=steps)
            return grid.reshape(-1), verify, packed(ids[:, :span], at, tokens, 0)
        if W == B:
            return positions, meta("verify", verify_kv, logits_rows=b.q_index[:n].reshape(-1),
                                   state_ids=b.state_slot[:n], stage=self.recurrent, micro_batches=groups,
                                   first_seq=b.first_row), None
        ids[:, W:] = -1  # drafts past the width: no verify row checks them, so none is accepted
        positions = positions.view(n, B)[:, :W].reshape(-1)
        q_index = torch.arange(n * W, device=ids.device).view(n, W)
        verify = AttnMeta(positions=positions, slots=slots.view(n, B)[:, :W].reshape(-1), q_index=q_index,
                          q_positions=positions.view(n, W), kv_lens=verify_kv - (B - W), block_tables=b.tables[:n],
                          page_size=self.page_size, max_kv=max_kv, dense=True, rows_own_slots=b.rows_own_slots,
                          name="verify",
                          backend=self.attention, rows=b.row_ids[:n], ring=b.ring, logits_rows=q_index.reshape(-1),
                          state_ids=b.state_slot[:n], stage=self.recurrent, micro_batches=groups,
                          first_seq=b.first_row)
        return positions, verify, None

    def verify(self, batch: DecodeBatch, n: int, greedy: bool, drafted: tuple, constrained: bool = False) -> None:
        """verify -> choose -> accept -> context -> commit. `constrained`: mask each verify row's
        logits with batch.allowed_bits (structured output; the host filled them after draft)."""
        b = batch
        accepted = self.check(b, n, greedy, drafted, constrained)
        # Budgets stay behind: only the drafter and accept read them, on the last stage.
        parallel.from_last_stage(*self.decided(b, n, accepted))
        self.settle(b, n, accepted, drafted[1])

    def check(self, batch: DecodeBatch, n: int, greedy: bool, drafted: tuple, constrained: bool = False) -> torch.Tensor:
        """verify -> choose -> accept -> context: the target's part of this stage, and on the last
        stage the decision; returns the drafts each sequence accepted (zeros before the last stage,
        which takes the last stage's: `decided`)."""
        b = batch
        positions, verify, inputs = drafted
        W = verify.q_index.shape[1]  # rows verified a sequence (per row: at most)
        # Each rank keeps its slice of the vocabulary: greedy rounds without logprobs send only each
        # row's best (3 values a row); the others gather whole rows a group at a time (choice.py).
        verify.gather_logits = False
        logits, taps = self.target(b.ids[:n, :W].reshape(-1) if inputs is None else inputs, verify)
        if not parallel.last_stage():  # a stage before the last has no logits: it takes what the last decided
            return torch.zeros(n, dtype=torch.int64, device=b.ids.device)
        accepted = self.decide(b, n, W, logits, positions, greedy, constrained)
        if self.drafter is not None:
            self.drafter.write_context(taps, verify)
        return accepted

    @staticmethod
    def decided(b: DecodeBatch, n: int, accepted: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the last stage's decision changed for rows 0..n-1, which every stage takes."""
        scored = (b.token_logprob[:n], b.top_logprob_ids[:n], b.top_logprobs[:n]) if b.token_logprob is not None else ()
        return b.ids[:n], b.pos[:n], b.out[:n], accepted, *scored

    def settle(self, b: DecodeBatch, n: int, accepted: torch.Tensor, verify: AttnMeta | None = None) -> None:
        """After the decision: count what rows emitted (penalties) and commit recurrent states
        over the rows `verify` ran (default the block)."""
        B = self.block
        if b.counts is not None:  # what the rows emitted is generated now
            emitted = b.out[:n, :B]
            b.counts[:n].scatter_add_(-1, emitted.clamp_min(0), (emitted >= 0).to(b.counts.dtype))
        if self.recurrent:
            # The verify left the recurrent state alone; it moves past the anchor and the
            # accepted drafts (the bonus is the next anchor, not yet fed), up to the last token a
            # row kept where a stop token or its budget cut the round short: the state is then
            # the sequence's own, which a conversation's next turn goes on from (engine/turns.py).
            # An eager ragged round has read the host already: each sequence replays only what it kept.
            kept = torch.minimum(accepted + 1, b.out[:n, B].clamp_min(1))
            rows = verify.q_index.shape[1] if verify is not None else None
            steps = stagger(kept.tolist(), kept.device) if verify is not None and verify.stagger is not None else None
            self.target.commit(b.state_slot[:n], kept, b.first_row, rows, steps)

    def decide(self, b: DecodeBatch, n: int, W: int, logits: torch.Tensor, positions: torch.Tensor, greedy: bool,
               constrained: bool) -> torch.Tensor:
        """choose -> accept from the target's logits (this rank's vocabulary slice): the batch's
        ids, positions, budgets and results advance; returns the accepted drafts a sequence."""
        B = self.block
        if greedy and b.token_logprob is None:
            chosen, finite = parallel.sharded_top1(logits)
        else:
            chosen, finite = choose_verified(b, n, W, logits, positions, greedy, constrained, self.ops.sample)
        finite = finite.view(n, W).all(-1)
        chosen = chosen.view(n, W)
        if W < B:  # the rows not verified choose nothing (-2 matches no draft and is never kept)
            chosen = torch.nn.functional.pad(chosen, (0, B - W), value=-2)
        accepted = self.ops.accept(b.ids[:n], chosen, b.pos[:n], b.budget[:n], b.stop_ids[:n], b.out[:n])
        b.out[:n, B + 1] = torch.where(finite, b.out[:n, B + 1], ERROR)
        return accepted
