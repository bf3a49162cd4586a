"""The decoding loop: continuous batching inside a bucket, chunked prefill, speculative rounds.

A step is either a prefill step (prompt chunks of newly admitted sequences, under the token
budget; a sequence whose prompt completes gets its first token) or one round (round.py) for
every decoding sequence. Rounds run on a DecodeBatch, state allocated once per bucket, where
each sequence keeps one row (and the row's pages) for its life: the round is a function of its
tensors, over rows 0..n-1 padded to the next capture size, and CUDA graphs replay it where
they are on. After a round the host reads back one small tensor (the emitted tokens, how
many were kept, and why a row finished) to extend each sequence, check stop strings, retire
finished sequences and admit new ones into the freed rows.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Iterator

import torch

import kernels
from dflash_batch.backends.meta import AttentionBackend
from dflash_batch.backends.torch_attention import TORCH
from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.cache import SeqRows, build_meta, row_pages
from dflash_batch.engine.graphs import RoundGraphs
from dflash_batch.engine.request import Completion, Request
from dflash_batch.engine.round import Round
from dflash_batch.engine.sampling import choose_tokens
from dflash_batch.engine.sequence import Sequence
from dflash_batch.plan.buckets import Bucket
from kernels.sample import top1

STOP = 1  # kernels.accept's finished code for a stop token (2: the budget is spent)


def runtime_tensors(models: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Tensors the models keep as plain module attributes (caches: runtime state, not weights)."""
    return [v for model in models for module in model.modules() for v in vars(module).values()
            if isinstance(v, torch.Tensor)]


class Engine:
    def __init__(self, target, drafter=None, decode=None, *, page_size: int = 16,
                 max_num_batched_tokens: int = 8192, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", attention: AttentionBackend = TORCH,
                 capture_sizes: list[int] | None = None, cuda_graphs: bool = False, compile: bool = False,
                 log: Callable[[str], None] | None = None):
        self.target, self.drafter = target, drafter
        self.vocab_size: int = target.vocab_size
        # Hybrid targets (KDA) keep per-sequence recurrent state that verify stages and commit picks.
        self.recurrent = hasattr(target, "allocate_state")
        self.decode = decode or (lambda ids: "")
        self.page_size, self.budget = page_size, max_num_batched_tokens
        self.dtype, self.device = dtype, torch.device(device)
        self.attention, self.ops = attention, kernels.ops(device)
        # Batch sizes a round runs at (a batch is padded up to the next one); None: exact sizes.
        self.capture_sizes = sorted(capture_sizes) if capture_sizes else None
        if cuda_graphs and not capture_sizes:
            raise ValueError("cuda_graphs needs capture_sizes")
        self.cuda_graphs, self.compile = cuda_graphs, compile
        self.log = log or (lambda line: None)
        self.rounds: dict[int, Round] = {}  # by block size: compiled code is kept across buckets
        self.bucket_state: tuple | None = None  # (shape, caches, batch, round, graphs) of the last bucket
        self.stop_width = 4  # stop ids a row can hold; grows with the requests (batch.py)

    # -- public --------------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request], bucket: Bucket) -> Iterator[Completion]:
        block = self._block_size(bucket)
        seqs = bucket.max_num_seqs
        pages_per_row = -(-(bucket.max_tokens + block) // self.page_size)
        models = [m for m in (self.target, self.drafter if block > 1 else None) if m is not None]
        shape = (seqs, pages_per_row, block)
        kept = self.bucket_state
        # Reused while the shape holds and the models still hold these caches (another engine
        # sharing the models may have allocated its own).
        # A batch whose stop-id tensor had to grow is replaced (its graphs read the old one).
        if (kept is None or kept[0] != shape or kept[2].reshaped
                or any(a is not b for a, b in zip(runtime_tensors(models), kept[1]))):
            batch, step, graphs = self._allocate(bucket, block, pages_per_row, models)
            self.bucket_state = (shape, runtime_tensors(models), batch, step, graphs)
        _, _, batch, step, graphs = self.bucket_state
        batch.clear_all()  # a previous generate that was closed early may have left rows
        free_rows = list(range(seqs))  # a heap: new sequences take the lowest row
        pending = iter(requests)
        prefilling: list[Sequence] = []
        running: list[Sequence | None] = [None] * seqs  # the sequence decoding in each row
        exhausted = False
        # inference_mode dispatches small ops faster; torch.compile wants plain no_grad tensors.
        with torch.no_grad() if self.compile else torch.inference_mode():
            while True:
                while not exhausted and free_rows:
                    req = next(pending, None)
                    if req is None:
                        exhausted = True
                        break
                    row = heapq.heappop(free_rows)
                    if self.recurrent:
                        self.target.reset_state(row)  # the row's slot still holds its last sequence's state
                    prefilling.append(Sequence(req, row_pages(row, pages_per_row), block, row))
                finished: list[Sequence] = []
                if prefilling:
                    for seq in self._prefill_step(prefilling, block):
                        prefilling.remove(seq)
                        if seq.finish_reason:
                            finished.append(seq)
                        else:
                            batch.put(seq.row, seq)
                            running[seq.row] = seq
                elif any(running):
                    self._round(batch, running, step, graphs, block)
                    finished = [s for s in running if s is not None and s.finish_reason]
                else:
                    return
                for seq in finished:
                    if running[seq.row] is seq:
                        running[seq.row] = None
                        batch.clear(seq.row)
                    heapq.heappush(free_rows, seq.row)
                    yield seq.completion(self.decode)

    # -- steps ---------------------------------------------------------------------------------
    def _allocate(self, bucket: Bucket, block: int, pages_per_row: int,
                  models: list[torch.nn.Module]) -> tuple[DecodeBatch, Round, RoundGraphs | None]:
        """Caches, recurrent state, the decoding state and its graphs for buckets of this shape
        (kept while the next bucket has the same one: captured graphs read these tensors)."""
        seqs = bucket.max_num_seqs
        # One page past the rows' pages is scratch: padding rows write there and nothing reads it.
        num_slots = (seqs * pages_per_row + 1) * self.page_size
        cache_bytes = sum(model.allocate_cache(num_slots, self.dtype, self.device) for model in models)
        if self.compile:
            for cache in runtime_tensors(models):
                # Cache lengths change with the bucket: symbolic, or each bucket compiles again.
                torch._dynamo.mark_dynamic(cache, 0)
        rows = self._padded(seqs)
        if self.recurrent:  # a state slot per row; slot `seqs` is the padding rows' scratch
            self.target.allocate_state(seqs + 1, rows, block, self.device)
        if self.bucket_state is not None:  # keep the widest stop list seen: no second regrowth
            self.stop_width = max(self.stop_width, self.bucket_state[2].stop_ids.shape[1])
        batch = DecodeBatch(rows, block, pages_per_row, self.page_size, seqs, self.device, self.stop_width)
        self.log(f"bucket {bucket.name}: {seqs} rows of {pages_per_row * self.page_size} slots, block {block}, "
                 f"KV caches {cache_bytes / 2**20:.1f} MiB")
        if block not in self.rounds:
            self.rounds[block] = Round(self.target, self.drafter, block, self.page_size, self.ops, self.attention,
                                       self.compile)
        step = self.rounds[block]
        graphs = None
        if self.cuda_graphs:
            graphs = RoundGraphs(step, batch, self.capture_sizes, pages_per_row * self.page_size)
        return batch, step, graphs

    def _block_size(self, bucket: Bucket) -> int:
        if self.drafter is None or not bucket.speculation:
            return 1
        return bucket.block_size or self.drafter.block_size

    def _padded(self, n: int) -> int:
        """The batch size a round of n sequences runs at: the next capture size, if any fits
        (compiled rounds run at 2 or more: size 1 would be specialised and compiled again)."""
        return next((s for s in self.capture_sizes or () if s >= n), max(n, 2) if self.compile else n)

    def _prefill_step(self, seqs: list[Sequence], block: int) -> list[Sequence]:
        """Run the next prompt chunk of as many sequences as the token budget allows; returns
        those whose prompt is complete, each with its first token."""
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
        meta = build_meta(rows, self.page_size, last_rows, self.device, [s.row for s in chunked],
                          backend=self.attention, name="prefill")
        self.attention.plan(meta)
        logits, taps = self.target(torch.tensor(ids, dtype=torch.int64, device=self.device), meta)
        if block > 1:
            self.drafter.write_context(taps, meta)
        if not finishing:
            return []
        for seq, t in zip(finishing, self._first_tokens(logits, finishing).tolist()):
            seq.t_first = time.monotonic()
            seq.append([t])
            seq.check_stop_strings(self.decode, 1)
        return finishing

    def _first_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The token after each prompt (its coin: the position it takes, the prompt's length)."""
        params = [s.params for s in seqs]
        if all(p.temperature <= 0 for p in params):
            return top1(logits)

        def col(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        return choose_tokens(logits, col([p.temperature for p in params], torch.float32),
                             col([p.top_k for p in params]), col([p.top_p for p in params], torch.float32),
                             col([p.seed for p in params]), col([len(s.prompt) for s in seqs]), self.ops.sample)

    def _round(self, batch: DecodeBatch, running: list[Sequence | None], step: Round,
               graphs: RoundGraphs | None, block: int) -> None:
        """One round for rows 0..n-1, n past the last running sequence (rows without one are
        padding); extends each sequence with what it emitted."""
        n = max(i for i, s in enumerate(running) if s is not None) + 1
        size = self._padded(n)
        greedy = all(s.params.temperature <= 0 for s in running[:n] if s is not None)
        positions = [s.position if s is not None else 0 for s in running[:n]]
        # Key lengths for backends that plan on the host (round.py's prepare computes the same
        # on the device); a row without a sequence is padding.
        budgets = [s.params.max_new_tokens - len(s.tokens) if s is not None else 0 for s in running[:n]]
        kv_lens = {"verify": [p + block for p in positions],
                   "draft": [p + min(block, b + 1) for p, b in zip(positions, budgets)]}
        captured = graphs is not None and graphs.covers(size)
        self.attention.plan_round(batch, size, kv_lens, captured)
        if captured:
            graphs.replay(size, greedy)
        else:
            step(batch, size, greedy, max(positions) + block)
        for seq, row in zip(running[:n], batch.out[:n].tolist()):
            if seq is None:
                continue
            before, kept = len(seq.tokens), row[block]
            seq.tokens += row[:kept]
            if row[block + 1]:
                seq.finish_reason = "stop" if row[block + 1] == STOP else "length"
                seq.stop_reason = str(seq.tokens[-1]) if row[block + 1] == STOP else None
            seq.check_stop_strings(self.decode, before + 1)
            if seq.spec is not None:
                # Counted after a stop string's cut too: the round keeps only tokens up to it.
                seq.spec.per_round.append(len(seq.tokens) - before - 1)
