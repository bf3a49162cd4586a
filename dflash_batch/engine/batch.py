"""A bucket's decoding state: every tensor a round touches, allocated once.

A sequence decodes in one row for its whole life (the row's pages and recurrent-state slot
are its own); rows without a sequence are padding, made inert: no pages (slot -1, never
written), budget 0 (nothing emitted, nothing counted), the scratch recurrent-state slot.
Per-token sampling settings are stored expanded to the block ([rows, B]) so a round reads them
as they lie. The host writes a row when its sequence starts decoding and clears it when the
sequence retires.
"""

from __future__ import annotations

import copy

import torch

from dflash_batch.backends.meta import Ring
from dflash_batch.engine.row_drafts import EDGES, FRESH, KINDS
from dflash_batch.engine.sequence import Sequence
from dflash_batch.limits import MAX_LOGIT_BIAS, MAX_LOGPROBS


# The tensors with a row per batch row (a lane takes its rows' views of them).
PER_ROW = ("ids", "pos", "budget", "tables", "temperature", "top_k", "top_p", "min_p", "min_stop_pos", "bias_ids",
           "bias", "repetition", "frequency", "presence", "counts", "in_prompt", "token_logprob", "top_logprob_ids",
           "top_logprobs", "seed", "stop_ids", "state_slot", "out", "row_ids", "draft_probs", "draft_last")


class DecodeBatch:
    def __init__(self, rows: int, block: int, max_pages: int, page_size: int, sequences: int,
                 device: torch.device | str, vocab_size: int, like: DecodeBatch | None = None,
                 ring: Ring | None = None, head_pages: int = 0, static: bool = False):
        """`rows` (>= `sequences`, padded up to a capture size); the first `sequences` state slots
        and `sequences * max_pages` pages belong to the rows that can run one; the next slot and
        page are scratch for padding rows (the engine allocates them). `like`: the previous
        bucket's batch; what its requests made it grow (stop ids, bias, counts, logprobs) is
        allocated now, so this batch's graphs cover it. `ring`: the geometry of the drafter's ring
        caches, if it keeps any. `head_pages`: the pool of shared heads' pages past the scratch
        page (engine/heads.py): a row that reads a head's pages no longer owns every slot it
        reads (`static`: rounds are captured, so take it that none does while there is a pool)."""
        def full(shape, value, dtype=torch.int64):
            return torch.full(shape, value, dtype=dtype, device=device)

        self.rows, self.block, self.page_size, self.device, self.ring = rows, block, page_size, device, ring
        self.first_row = 0  # the row of the batch this one's row 0 is (a lane's: `lane`)
        self.scratch_state, self.scratch_page = sequences, sequences * max_pages
        self.head_pages, self.static = head_pages, static
        self.num_slots = (self.scratch_page + 1 + head_pages) * page_size  # the rows' pages, scratch, heads
        self.shared_rows: set[int] = set()  # rows whose sequence reads a shared head's pages
        # What backends that plan on the host read: each batch row's pages (host_pages). A lane
        # shares its batch's list, so that a row cleared in the batch is cleared in the lane.
        self.host_tables: list[list[int]] = [[] for _ in range(rows)]
        self.ids = full((rows, block), 0)             # [anchor, d_1..d_{B-1}] of the next verify
        self.pos = full((rows,), 0)                   # anchor position
        self.budget = full((rows,), 0)                # tokens the row may still emit
        self.tables = full((rows, max_pages), -1)     # page ids (-1: none)
        self.temperature = full((rows, block), 0.0, torch.float32)
        self.top_k = full((rows, block), -1)
        self.top_p = full((rows, block), 1.0, torch.float32)
        self.min_p = full((rows, block), 0.0, torch.float32)
        self.min_stop_pos = full((rows,), 0)           # first position where a stop id may come
        # logit_bias: token ids (-1: none) and biases, only for buckets whose requests use it
        self.bias_ids: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.repetition = full((rows,), 1.0, torch.float32)  # penalties (engine/sampling.py's penalize_)
        self.frequency = full((rows,), 0.0, torch.float32)
        self.presence = full((rows,), 0.0, torch.float32)
        # Per row and token: times generated, and whether in the prompt ([rows, vocab] each, so
        # only allocated for buckets whose requests use penalties).
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        # A round's logprobs, per verify row: the chosen token's and the top ones (all rows'
        # distributions are scored once any row asks; the host keeps what each row asked for).
        self.token_logprob: torch.Tensor | None = None
        self.top_logprob_ids: torch.Tensor | None = None
        self.top_logprobs: torch.Tensor | None = None
        # Structured output: per verify row, the tokens its sample's grammar allows after the
        # drafts before it (bits, xgrammar's layout; all set for rows without a grammar). The
        # host fills `grammar_bits` (CPU, as grammar matchers write) between draft and verify.
        self.grammar_bits: torch.Tensor | None = None
        self.allowed_bits: torch.Tensor | None = None
        self.seed = full((rows, block), 0)
        self.stop_ids = full((rows, like.stop_ids.shape[1] if like else 4), -1)  # stop token ids (-1: none)
        self.state_slot = full((rows,), sequences)  # recurrent-state slot (hybrid targets)
        self.out = full((rows, block + 2), 0)          # a round's result: emitted | kept | finished
        # Per-row draft counts (engine/row_drafts.py): the drafter's probability of each draft of
        # a round, and what the round's choice reads (the calibration's rates, the cost curve).
        self.draft_probs = full((rows, block - 1), 0.0, torch.float32)
        self.draft_last = full((rows,), FRESH)  # what each row's last round kept (row_drafts.last_round)
        self.draft_edges = torch.tensor(EDGES, dtype=torch.float32, device=device)
        self.draft_params = full((KINDS * (len(EDGES) + 1) + block,), 0.0, torch.float64)  # row_drafts.round_params
        self.q_index = torch.arange(rows * block, device=device).view(rows, block)
        self.row_ids = torch.arange(rows, device=device)  # a round's sequence b runs in row b
        self.no_rows = full((0,), 0)
        self.vocab_size = vocab_size
        # Set when the stop ids had to grow or the bias, counts or logprobs appeared: graphs
        # captured before no longer cover this batch (rounds run eagerly until the engine
        # replaces it at the next bucket).
        self.reshaped = False
        if like is not None:
            for grown, allocate in ((like.bias, self._allocate_bias), (like.counts, self._allocate_counts),
                                    (like.token_logprob, self._allocate_logprobs)):
                if grown is not None:
                    allocate()

    def put(self, row: int, seq: Sequence) -> None:
        """Start decoding `seq` in `row`: its anchor, position, budget, pages and settings."""
        p = seq.params
        stops = list(p.stop_token_ids)
        if len(stops) > self.stop_ids.shape[1]:
            self._grow_stops(len(stops))
        if self.allocate_for(bool(p.logit_bias), p.penalized, p.logprobs is not None):
            self.reshaped = True
        if seq.matcher is not None and self.grammar_bits is None:
            width = -(-self.vocab_size // 32)
            self.grammar_bits = torch.full((self.rows * self.block, width), -1, dtype=torch.int32)
            self.allowed_bits = self.grammar_bits.to(self.device)
        host = {self.pos: seq.position, self.budget: p.max_new_tokens - len(seq.tokens),
                self.temperature: p.temperature, self.top_k: p.top_k, self.top_p: p.top_p, self.min_p: p.min_p,
                self.seed: p.seed, self.state_slot: seq.row, self.draft_last: FRESH,
                self.min_stop_pos: len(seq.prompt) + p.min_tokens, self.repetition: p.repetition_penalty,
                self.frequency: p.frequency_penalty, self.presence: p.presence_penalty}
        for tensor, value in host.items():
            tensor[row] = value
        self.ids[row, 0] = seq.tokens[-1]
        self.tables[row] = -1
        self.tables[row, :len(seq.pages)] = torch.tensor(seq.pages, device=self.device)
        self.host_tables[row] = list(seq.pages)
        if max(seq.pages) > self.scratch_page:  # a shared head's pages (engine/heads.py)
            self.shared_rows.add(row)
        else:
            self.shared_rows.discard(row)
        self.stop_ids[row] = -1
        if self.bias is not None:
            self.bias_ids[row], self.bias[row] = -1, 0.0
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            self.bias_ids[row, :len(ids)] = torch.tensor(ids, device=self.device)
            self.bias[row, :len(ids)] = torch.tensor(bias, device=self.device)
        if stops:
            self.stop_ids[row, :len(stops)] = torch.tensor(stops, device=self.device)
        if self.counts is not None:  # kept for every row once there: a round adds what it emits
            self.counts[row] = torch.bincount(self._ids(seq.tokens), minlength=self.vocab_size)
            self.in_prompt[row] = False
            self.in_prompt[row, self._ids(seq.prompt)] = True

    def allocate_for(self, logit_bias: bool, penalties: bool, logprobs: bool) -> bool:
        """Allocate what rows with these settings read, where not yet there; whether any was new."""
        new = False
        for wanted, have, allocate in ((logit_bias, self.bias, self._allocate_bias),
                                       (penalties, self.counts, self._allocate_counts),
                                       (logprobs, self.token_logprob, self._allocate_logprobs)):
            if wanted and have is None:
                allocate()
                new = True
        return new

    @property
    def rows_own_slots(self) -> bool:
        """AttnMeta.rows_own_slots of its rounds: no row reads pages past its own (and row b's
        slots are the b-th: not so in a lane past the first row)."""
        return self.first_row == 0 and (not self.head_pages or not (self.static or self.shared_rows))

    def host_pages(self, row: int) -> list[int]:
        """The pages of this batch's row `row` (none: padding), as the host keeps them."""
        return self.host_tables[self.first_row + row]

    def lane(self, a: int, b: int) -> DecodeBatch:
        """Rows a..b-1 as a batch of their own, every per-row tensor a view of this batch's (a
        pipeline lane, engine/lanes.py): a round of it is the round of those rows."""
        view = copy.copy(self)
        for name in PER_ROW:
            if (t := getattr(self, name)) is not None:
                setattr(view, name, t[a:b])
        for name in ("grammar_bits", "allowed_bits"):  # a row per verify row
            if (t := getattr(self, name)) is not None:
                setattr(view, name, t[a * self.block:b * self.block])
        view.rows, view.first_row = b - a, self.first_row + a
        view.q_index = torch.arange((b - a) * self.block, device=self.device).view(b - a, self.block)
        return view

    def clear(self, row: int) -> None:
        """Make a row padding."""
        self.shared_rows.discard(row)
        self.tables[row] = -1
        self.host_tables[row] = []
        self.budget[row] = 0
        self.pos[row] = 0
        self.state_slot[row] = self.scratch_state

    def clear_all(self) -> None:
        for row in range(self.rows):
            if self.host_tables[row]:
                self.clear(row)

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _allocate_bias(self) -> None:
        self.bias_ids = torch.full((self.rows, MAX_LOGIT_BIAS), -1, dtype=torch.int64, device=self.device)
        self.bias = torch.zeros((self.rows, MAX_LOGIT_BIAS), dtype=torch.float32, device=self.device)

    def _allocate_counts(self) -> None:
        self.counts = torch.zeros((self.rows, self.vocab_size), dtype=torch.int32, device=self.device)
        self.in_prompt = torch.zeros((self.rows, self.vocab_size), dtype=torch.bool, device=self.device)

    def _allocate_logprobs(self) -> None:
        width = min(MAX_LOGPROBS, self.vocab_size)
        self.token_logprob = torch.zeros((self.rows, self.block), dtype=torch.float32, device=self.device)
        self.top_logprob_ids = torch.zeros((self.rows, self.block, width), dtype=torch.int64, device=self.device)
        self.top_logprobs = torch.zeros((self.rows, self.block, width), dtype=torch.float32, device=self.device)

    def _grow_stops(self, width: int) -> None:
        grown = torch.full((self.rows, width), -1, dtype=torch.int64, device=self.device)
        grown[:, :self.stop_ids.shape[1]] = self.stop_ids
        self.stop_ids = grown
        self.reshaped = True
