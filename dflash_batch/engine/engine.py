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

import time
from collections.abc import Callable, Iterable, Iterator

import torch

from dflash_batch import parallel
from dflash_batch.backends.meta import AttentionBackend, Ring
from dflash_batch.backends.torch_attention import TORCH
from dflash_batch.engine.batch import DecodeBatch
from dflash_batch.engine.cache import NO_RINGS, RowRings, SeqRows, build_meta, row_pages, slots
from dflash_batch.engine.compile_policy import CompileWhenItPays
from dflash_batch.engine.emitted import take_round
from dflash_batch.engine.graphs import RoundGraphs
from dflash_batch.engine.row_drafts import learn, ready_rows
from dflash_batch.engine.lanes import LANES_REPLAN, run_lanes
from dflash_batch.engine.heads import HeadPool, plan_heads, pool_bound
from dflash_batch.engine.queue import Queue
from dflash_batch.engine.request import Completion, Logprobs, Request
from dflash_batch.engine.round import Round, round_kv_lens
from dflash_batch.engine.schedule import NOWHERE, Schedule
from dflash_batch.engine.sampling import (add_bias_, choose_tokens, hold_stops_, log_probs, mask_disallowed_,
                                          penalize_)
from dflash_batch.engine.sequence import Sequence
from dflash_batch.engine.turns import Parked
from dflash_batch.kernels import ops
from dflash_batch.kernels.sample import top1
from dflash_batch.models.layers.dtypes import wide_dtype
from dflash_batch.plan.buckets import Bucket



def is_out_of_memory(error: Exception) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def named_runtime_tensors(models: list[torch.nn.Module]) -> Iterator[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(module, attribute, tensor) for each tensor the models keep as a plain module attribute
    (caches: runtime state, not weights)."""
    return ((module, name, v) for model in models for module in model.modules() for name, v in vars(module).items()
            if isinstance(v, torch.Tensor))


def runtime_tensors(models: list[torch.nn.Module]) -> list[torch.Tensor]:
    """The tensors of named_runtime_tensors."""
    return [v for _, _, v in named_runtime_tensors(models)]


def ring_rows(drafter: torch.nn.Module, ring: Ring | None, seqs: int, page_size: int, ways: int) -> RowRings:
    """The drafter's ring caches of a bucket of `seqs` rows (this rank's share of them, under a
    latent split `ways` ways) and the slots one batch row holds in each."""
    if ring is None:
        return NO_RINGS
    size = ring.slots(seqs, page_size) // ways
    return RowRings([t for t in runtime_tensors([drafter]) if t.shape[0] == size], ring.pages * page_size // ways)


def _split(ways: int) -> dict[str, int]:
    """allocate_cache's latent_split argument where there is a split (Qwen3 takes none)."""
    return {"latent_split": ways} if ways > 1 else {}


def release_caches(model: torch.nn.Module) -> None:
    """Drop the caches a model keeps (its runtime_tensors)."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                setattr(module, name, None)


def slot_caches(models: list[torch.nn.Module], batch: DecodeBatch, latent_split: int = 1) -> list[torch.Tensor]:
    """The caches indexed by the batch's slots (K/V, latents; a split's rows of them): what a
    sequence sharing a prompt copies."""
    return [t for t in runtime_tensors(models) if t.shape[0] == batch.num_slots // latent_split]


class Engine:
    def __init__(self, target, drafter=None, decode=None, *, page_size: int = 16,
                 max_num_batched_tokens: int = 8192, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", attention: AttentionBackend = TORCH,
                 capture_sizes: list[int] | None = None, cuda_graphs: bool = False, compile: bool = False,
                 compile_if_it_pays: bool = False, share_prompts: bool = True, shared_head_tokens: int = 8192,
                 log: Callable[[str], None] | None = None, auto_speculation: tuple[float, int] = (1.5, 1024),
                 micro_batches: int = 1, per_row: bool = True, turn_caches: bool = True):
        """`compile_if_it_pays`: with `compile`, a bucket whose requests fit few rounds runs them
        uncompiled (compile_policy.py); `share_prompts`: samples fork a prompt's prefill, and rows
        share heads of up to `shared_head_tokens` (engine/heads.py); `auto_speculation`:
        (min_acc_len, rounds) of buckets with speculation "auto" (schedule.py); `micro_batches`:
        under pipeline stages, the lanes rounds interleave in (lanes.py), or the groups of sequences
        a captured round or a prefill step goes through the stages in (models/stages.py);
        `per_row`: auto buckets (speculation {per_row: true}, auto's default) verify each row's
        drafts worth it (row_drafts.py) where rounds can be ragged: one stage, and rounds captured
        as graphs only where the backend does not plan them on the host; `turn_caches`: a
        conversation's later turns go on from its row's caches (engine/turns.py)."""
        self.target, self.drafter = target, drafter
        self.per_row = per_row and parallel.stage()[1] == 1 and not (cuda_graphs and attention.plans_on_host)
        self.micro_batches, self.turn_caches = micro_batches, turn_caches
        self.vocab_size: int = target.vocab_size
        # Hybrid targets (KDA) keep per-sequence recurrent state that verify stages and commit picks.
        self.recurrent = hasattr(target, "allocate_state")
        self.decode = decode or (lambda ids: "")
        self.page_size, self.budget = page_size, max_num_batched_tokens
        self.dtype, self.device = dtype, torch.device(device)
        self.attention, self.ops = attention, ops.for_device(device)
        self.split = attention.split  # whose rows of the latent caches this rank keeps (None: all)
        self.latent_ways = self.split.ways if self.split else 1
        if page_size % self.latent_ways:
            raise ValueError(f"page_size {page_size} must be a multiple of the latent split ({self.latent_ways} ranks)")
        # Batch sizes a round runs at (a batch is padded up to the next one); None: exact sizes.
        self.capture_sizes = sorted(capture_sizes) if capture_sizes else None
        if cuda_graphs and not capture_sizes:
            raise ValueError("cuda_graphs needs capture_sizes")
        self.cuda_graphs, self.compile, self.share_prompts = cuda_graphs, compile, share_prompts
        self.shared_head_tokens = shared_head_tokens if share_prompts else 0
        self.compile_if_it_pays = compile_if_it_pays
        self.prefill_tokens = 0  # prompt tokens the target has run (a shared prompt counts once)
        self.log = log or (lambda line: None)
        self.rounds: dict[int, Round] = {}  # by block size: compiled code is kept across buckets
        self.bucket_state: tuple | None = None  # (shape, caches, batch, round, graphs) of the last bucket
        # The drafter's sliding layers' ring geometry in this bucket, and those caches (None,
        # NO_RINGS: whole caches).
        self.ring: Ring | None = None
        self.rings = NO_RINGS
        self.heads: HeadPool | None = None  # the shared heads of the last generate call (engine/heads.py)
        self.auto_speculation = auto_speculation
        self.schedules: dict[str, Schedule] = {}  # by bucket name: drafts verified by batch size (schedule.py)

    # -- public --------------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request], bucket: Bucket) -> Iterator[Completion]:
        """Decode the bucket's requests (read at once: with share_prompts, the heads they share
        are found first, plan/heads.py, and their members admitted together)."""
        requests, heads = plan_heads(list(requests), self.shared_head_tokens)
        block, pages_per_row, models = self._shape(bucket)
        seqs = bucket.max_num_seqs
        shape = (seqs, pages_per_row, block, self._per_row(bucket))
        kept = self.bucket_state
        # Reused while the shape holds and the models still hold these caches (another engine
        # sharing the models may have allocated its own).
        # A batch whose stop-id tensor had to grow is replaced (its graphs read the old one).
        if (kept is None or kept[0] != shape or kept[2].reshaped
                or any(a is not b for a, b in zip(runtime_tensors(models), kept[1]))):
            self.allocate(bucket)
        # Not the state's list of runtime tensors: those an auto bucket replaces (its verify staging,
        # by one-row staging) must go when the state does.
        del kept
        batch, step, graphs = self.bucket_state[2:]
        pays = None  # times the first rounds where compiling may not pay (compile_policy.py)
        if self.compile and self.compile_if_it_pays and not step.compiled:
            step.eager, pays = True, CompileWhenItPays(requests)
            if bucket.speculation == "auto" and block > 1:
                self.log(f"bucket {bucket.name}: rounds run uncompiled (speculation: auto times them so)")
                pays = None
        self._compile_if(not step.eager, models)
        split = self.latent_ways
        caches = slot_caches(models, batch, split)
        self.ring = batch.ring
        self.rings = ring_rows(self.drafter, self.ring, seqs, self.page_size, split)
        batch.clear_all()  # a previous generate that was closed early may have left rows
        schedule = self._schedule(bucket, block, batch, step, graphs) if block > 1 else None
        self.heads = HeadPool(heads, seqs * pages_per_row + 1, batch.head_pages, self.page_size,
                              self.target if self.recurrent else None)
        q = Queue(requests, seqs, self.budget, self.heads)
        parked = Parked(self.recurrent, bucket.max_tokens, self.turn_caches)  # conversations between turns (turns.py)
        # inference_mode dispatches small ops faster; torch.compile wants plain no_grad tensors.
        with torch.no_grad() if self.compile else torch.inference_mode():
            while True:
                yield from parked.ready(q, batch, block)
                while q.room():
                    req, row = q.next_request()
                    if req is None:
                        break
                    if self.recurrent:
                        self.target.reset_state(row)  # the row's slot still holds its last sequence's state
                    q.start(Sequence(req, row_pages(row, pages_per_row), block, row), self.share_prompts)
                if q.prefilling:
                    for seq in q.heads.entering(q.prefilling):
                        q.heads.enter(seq, self._copier(caches), self.rings, self._score)
                    ready = [s for s in q.prefilling if not q.heads.waits(s)]
                    chunks = self._prefill_chunk(ready, q.prefill_budget, q.heads.stop)
                    involved = [seq for seq, _ in chunks]
                else:
                    involved = [s for s in q.running if s is not None]
                    if not involved:
                        if not parked:
                            return
                        parked.wait()
                        continue
                switch = None  # why an auto bucket stops speculating after this step
                laned, ended = False, []  # rounds in pipeline lanes; the sequences they ended (released)
                try:
                    if q.prefilling:
                        finished = self._prefill(chunks, block, caches, q.heads)
                        for seq in finished:
                            q.prefilled(seq)
                        for seq in (s for s in finished if not s.finish_reason):
                            q.decode(seq, batch)
                        finished = [s for s in finished if s.finish_reason]
                    else:
                        size = self.padded(max(i for i, s in enumerate(q.running) if s is not None) + 1)
                        plan = block - 1 if schedule is None else schedule.plan(size)
                        if schedule is not None and schedule.pinned is None:
                            plan = parallel.agreed(plan)  # each rank timed its own rounds
                        k = max(plan, 0)
                        started = time.perf_counter()
                        emitted = sum(len(s.tokens) for s in involved) if pays is not None else 0
                        if laned := self._lanes_fit(q, graphs, size, k + 1, pays):
                            ran = run_lanes(q, batch, step, size, self.micro_batches, k + 1,
                                            all(s.plain_greedy for s in involved), self.decode,
                                            LANES_REPLAN if schedule is not None and schedule.pinned is None else None)
                            ended, finished = ran.ended, []
                            # a round of every lane counts as a round of the batch
                            rounds = [(ran.seconds / len(ran.accepted), accepted) for accepted in ran.accepted]
                        else:
                            accepted, per_row, drafts = self._round(batch, q.running, step, graphs, block, k + 1,
                                                                    schedule)
                            finished = [s for s in involved if s.finish_reason]
                            rounds = [(time.perf_counter() - started, accepted)]
                        if pays is not None:
                            pays.record(time.perf_counter() - started, sum(len(s.tokens) for s in involved) - emitted)
                            if (verdict := pays.verdict()) is not None:
                                self._decided(bucket, step, models, *verdict)
                                pays = None
                        if schedule is not None:
                            for seconds, accepted in rounds:  # a round cut by its sequence's end measures no acceptance
                                kept = [(a, v, seq) for a, v, seq in accepted if not seq.finish_reason]
                                schedule.record(size, k, seconds, [a for a, _, _ in kept], [v for _, v, _ in kept],
                                                not laned and per_row, None if laned else drafts)
                                if not laned and per_row:
                                    learn(schedule.calibration, batch, kept)
                            if schedule.pinned is None:
                                switch = schedule.why_stop(plan == NOWHERE)
                except Exception as error:  # noqa: BLE001 - any failure: decide what it costs
                    # The run cannot go on: a rank is lost (no row is to blame), or lanes failed
                    # with messages between stages in flight.
                    if parallel.lost_rank(error) or laned:
                        raise
                    involved += [f for s in involved for f in s.followers]  # they wait on it
                    finished = self._recover(error, involved, q, batch, bucket)
                finished = [s for s in finished if not parked.park(s, q, batch, self.decode)]
                for seq in finished:
                    q.release(seq, batch)
                for seq in (*finished, *ended):
                    yield seq.completion(self.decode)
                if switch and (one_row := self._stop_speculating(bucket, q, batch, pages_per_row, switch)) is not None:
                    batch, step, graphs = one_row
                    block, schedule = 1, None
                    caches = slot_caches([self.target], batch, split)

    def _lanes_fit(self, q: Queue, graphs: RoundGraphs | None, size: int, width: int,
                   pays: CompileWhenItPays | None) -> bool:
        """Whether this step's rounds run in interleaved pipeline lanes (engine/lanes.py): under
        stages with micro-batches, unless a round is captured (and the backend lets a captured
        round go through the stages in groups), a row follows a grammar, the compile policy is
        timing rounds, or requests restart one at a time after a failure."""
        constrained = any(s is not None and s.matcher is not None for s in q.running)
        captured = graphs is not None and graphs.covers(size, width) and self.attention.splits_rounds
        return (self.micro_batches > 1 and parallel.stage()[1] > 1 and pays is None and not q.suspects
                and not constrained and not captured)

    def _decided(self, bucket: Bucket, step: Round, models: list[torch.nn.Module], compile: bool, why: str) -> None:
        self.log(f"bucket {bucket.name}: {'compiling the round' if compile else 'rounds run uncompiled'}: {why}")
        self._compile_if(compile, models)
        step.eager = not compile

    @staticmethod
    def _compile_if(compile: bool, models: list[torch.nn.Module]) -> None:
        if compile:
            for cache in runtime_tensors(models):
                # Cache lengths change with the bucket: symbolic, or each bucket compiles again.
                torch._dynamo.mark_dynamic(cache, 0)

    def _recover(self, error: Exception, involved: list[Sequence], q: Queue, batch: DecodeBatch,
                 bucket: Bucket) -> list[Sequence]:
        """A step raised. Out of memory: its sequences start over later with half as many at a
        time (and half the prefill budget), and only one that runs out alone fails. Any other
        error: a sequence that was alone fails, naming the error; otherwise its sequences start
        over one at a time, so the one that raises is found and only it fails. A failed
        sequence is an error row; the rest of the bucket goes on (and a resume never meets the
        failing row again)."""
        oom = is_out_of_memory(error)
        alone = len(involved) == 1 and (not oom or q.limit == 1 and q.prefill_budget == q.min_prefill)
        if alone:
            seq = involved[0]
            kind = "out_of_memory" if oom else f"engine_{type(error).__name__}"
            seq.fail(kind, f"{'out of memory even alone' if oom else 'the engine failed on this request'}: "
                           f"{error}".strip()[:2000])
            q.forget(seq, batch)
            return [seq]
        if oom:
            q.limit = max(1, min(q.limit, len(involved)) // 2)
            q.prefill_budget = max(q.min_prefill, q.prefill_budget // 2)
            self.log(f"bucket {bucket.name}: out of memory with {len(involved)} sequences; going on with "
                     f"{q.limit} at a time and prefill chunks of {q.prefill_budget} tokens")
        else:
            q.suspects |= {s.request.key for s in involved}
            self.log(f"bucket {bucket.name}: a step of {len(involved)} sequences failed ({type(error).__name__}: "
                     f"{str(error)[:200]}); they start over one at a time")
        q.requeue(involved, batch)
        return []

    # -- steps ---------------------------------------------------------------------------------
    def allocate(self, bucket: Bucket) -> DecodeBatch:
        """A bucket's caches (with the pool of shared heads' pages, engine/heads.py), state and
        decoding state (on the meta device: what they would take, sizing.py), kept for generate
        while the next bucket has the same shape."""
        block, pages_per_row, models = self._shape(bucket)
        previous = self.bucket_state[2] if self.bucket_state is not None else None
        # The last bucket's graphs and the caches it held go before this one's come (the models
        # replace their caches layer by layer): two buckets are never held at once.
        self.bucket_state = None
        if block == 1 and self.drafter is not None:
            release_caches(self.drafter)  # a bucket without the drafter does not hold its caches
        batch, step, graphs = self._allocate(bucket, block, pages_per_row, models, previous,
                                             pool_bound(self.shared_head_tokens, self.page_size, pages_per_row))
        shape = (bucket.max_num_seqs, pages_per_row, block, self._per_row(bucket))
        self.bucket_state = (shape, runtime_tensors(models), batch, step, graphs)
        return batch

    def _shape(self, bucket: Bucket) -> tuple[int, int, list[torch.nn.Module]]:
        """(block size, pages a row, the models whose caches it reads) of a bucket."""
        block = self._block_size(bucket)
        models = [m for m in (self.target, self.drafter if block > 1 else None) if m is not None]
        return block, -(-(bucket.max_tokens + block) // self.page_size), models

    def _allocate(self, bucket: Bucket, block: int, pages_per_row: int, models: list[torch.nn.Module],
                  previous: DecodeBatch | None, head_pages: int) -> tuple[DecodeBatch, Round, RoundGraphs | None]:
        """Caches, recurrent state, the decoding state and its graphs for buckets of this shape
        (kept while the next bucket has the same one: captured graphs read these tensors)."""
        seqs = bucket.max_num_seqs
        # One page past the rows' pages is scratch: padding rows write there and nothing reads it.
        # Shared heads' pages come after it.
        num_slots = (seqs * pages_per_row + 1 + head_pages) * self.page_size
        split = self.latent_ways  # each rank keeps 1/split of the latent slots
        cache_bytes = self.target.allocate_cache(num_slots, self.dtype, self.device, **_split(split))
        ring = None
        if block > 1:
            # The drafter's sliding layers keep a ring of their window where the backend reads
            # one and the window is shorter than the bucket's rows.
            reads = self.attention.reads_rings(self.drafter.latent)
            ring_pages = self.drafter.ring_pages(block, self.page_size) if reads else None
            ring = Ring(ring_pages) if ring_pages is not None and ring_pages < pages_per_row else None
            cache_bytes += self.drafter.allocate_cache(num_slots, self.dtype, self.device,
                                                       ring.slots(seqs, self.page_size) if ring else None,
                                                       **_split(split))
        rows = self.padded(seqs)
        if self.recurrent:  # a state slot per row; slot `seqs` is the padding rows' scratch
            self.target.allocate_state(seqs + 1, rows, block, self.device)
        # What the last bucket's requests made its batch grow is allocated at once: no second regrowth.
        batch = DecodeBatch(rows, block, pages_per_row, self.page_size, seqs, self.device, self.vocab_size, previous,
                            ring, head_pages, static=self.cuda_graphs)
        rings = f" (the drafter's sliding layers: rings of {ring.pages * self.page_size} slots)" if ring else ""
        self.log(f"bucket {bucket.name}: {seqs} rows of {pages_per_row * self.page_size} slots, block {block}, "
                 f"KV caches {cache_bytes / 2**20:.1f} MiB{rings}")
        if block not in self.rounds:
            self.rounds[block] = Round(self.target, self.drafter, block, self.page_size, self.ops, self.attention,
                                       self.compile, self.micro_batches)
        step = self.rounds[block]
        graphs = None
        if self.cuda_graphs:
            graphs = RoundGraphs(step, batch, self.capture_sizes, pages_per_row * self.page_size,
                                 self._widths(bucket, block), self._per_row(bucket))
        return batch, step, graphs

    @staticmethod
    def _widths(bucket: Bucket, block: int) -> list[int]:
        """The verify widths a bucket's rounds run at (captured as graphs): any, under auto."""
        if block == 1 or bucket.speculation == "auto":
            return list(range(1, block + 1))
        return [block if bucket.drafts is None else bucket.drafts + 1]

    def _per_row(self, bucket: Bucket) -> bool:
        """Whether the bucket's rounds verify each row's drafts worth it (row_drafts.py)."""
        return self.per_row and bucket.speculation == "auto" and bucket.per_row and self._block_size(bucket) > 1

    def _block_size(self, bucket: Bucket) -> int:
        off = bucket.speculation == "auto" and bucket.name in self.schedules and self.schedules[bucket.name].off
        if self.drafter is None or not bucket.speculation or off:
            return 1
        return bucket.block_size or self.drafter.block_size

    def _schedule(self, bucket: Bucket, block: int, batch: DecodeBatch, step: Round,
                  graphs: RoundGraphs | None) -> Schedule:
        """The bucket's schedule; an auto bucket's round costs are timed here the first time (on
        padding rows: every row of the batch is padding now)."""
        pinned = None if bucket.speculation == "auto" else block - 1 if bucket.drafts is None else bucket.drafts
        if pinned is not None and not 0 <= pinned < block:
            raise ValueError(f"bucket {bucket.name}: speculation drafts {pinned} is not in 0..{block - 1} "
                             f"(the block has {block - 1} drafts)")
        schedule = self.schedules.get(bucket.name)
        if schedule is None or (schedule.block, schedule.pinned) != (block, pinned):
            sizes = self._sizes(bucket.max_num_seqs)
            schedule = self.schedules[bucket.name] = Schedule(block, sizes, self.auto_speculation[1], pinned,
                                                                 self.auto_speculation[0], self._per_row(bucket))
        if schedule.pinned is None and not schedule.costs:
            with torch.no_grad() if self.compile else torch.inference_mode():
                schedule.time_rounds(lambda size, width: self._time_round(batch, step, graphs, size, width))
            self.log(f"bucket {bucket.name}: round costs timed at batch sizes {schedule.sizes}, "
                     f"{block} verify widths each")
        return schedule

    def _sizes(self, seqs: int) -> list[int]:
        """The batch sizes rounds run at, as a cost table keeps them: the capture sizes, else powers
        of two and the bucket's max_num_seqs."""
        if self.capture_sizes:
            return sorted({self.padded(s) for s in self.capture_sizes if s <= seqs} | {self.padded(seqs)})
        return sorted({self.padded(min(2 ** i, seqs)) for i in range(seqs.bit_length() + 1)})

    def _time_round(self, batch: DecodeBatch, step: Round, graphs: RoundGraphs | None, size: int,
                    width: int) -> float:
        """Seconds of one round of `size` padding rows verifying `width` rows a sequence (greedy),
        replayed where it is captured."""
        self.attention.plan_round(batch, size, {"draft": [], "verify": []}, graphs is not None, {"verify": width})
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        started = time.perf_counter()
        if graphs is not None and graphs.covers(size, width):
            graphs.replay(size, True, width)
        else:
            step(batch, size, True, batch.block, width)
        sync()
        return time.perf_counter() - started

    def _stop_speculating(self, bucket: Bucket, q: Queue, batch: DecodeBatch, pages_per_row: int,
                          why: str) -> tuple[DecodeBatch, Round, RoundGraphs | None] | None:
        """An auto bucket's acceptance fell below its threshold: the sequences decoding go on
        target-only in the same rows (their pages and recurrent state, which B = 1 rounds read
        as they are), with the speculative rounds they ran counted; those prefilling or not yet
        started run without the drafter. Returns the decoding state of B = 1 rounds, or None
        when it could not be built (the bucket goes on speculating and tries again a window of
        rounds later; no sequence is touched)."""
        running = [seq for seq in q.running if seq is not None]
        try:
            one = DecodeBatch(batch.rows, 1, pages_per_row, self.page_size, bucket.max_num_seqs, self.device,
                              self.vocab_size, batch, head_pages=batch.head_pages, static=self.cuda_graphs)
            if 1 not in self.rounds:
                self.rounds[1] = Round(self.target, None, 1, self.page_size, self.ops, self.attention, self.compile,
                                       self.micro_batches)
            if not self.rounds[1].compiled:  # as the bucket's rounds ran
                self.rounds[1].eager = self.bucket_state[3].eager
            # Captured while every row of the new batch is padding (warm-up rounds run for real).
            graphs = RoundGraphs(self.rounds[1], one, self.capture_sizes, pages_per_row * self.page_size) \
                if self.cuda_graphs else None
            for seq in running:
                one.put(seq.row, seq)
            if self.recurrent:  # one-row verifies: one row of staging
                self.target.allocate_staging(batch.rows, 1, self.device)
        except Exception as error:  # noqa: BLE001 - speculation goes on; nothing of a sequence changed
            if self.recurrent:  # whole again, if the shrink had begun
                self.target.allocate_staging(batch.rows, batch.block, self.device)
            self.schedules[bucket.name].restart()
            self.log(f"bucket {bucket.name}: speculation could not be turned off ({type(error).__name__}: "
                     f"{error}); still speculating, trying again once the acceptance is measured again")
            return None
        for seq in q.prefilling + [f for s in q.prefilling for f in s.followers]:
            seq.spec = None
        for seq in running:
            if not seq.spec.rounds:
                seq.spec = None
        self.schedules[bucket.name].off = True
        self.log(f"bucket {bucket.name}: speculation off (auto): {why}; target-only from here")
        shape = (bucket.max_num_seqs, pages_per_row, 1)
        self.bucket_state = (shape, runtime_tensors([self.target]), one, self.rounds[1], graphs)
        self.ring, self.rings = None, NO_RINGS
        return one, self.rounds[1], graphs

    def padded(self, n: int) -> int:
        """The batch size a round of n sequences runs at: the next capture size, if any fits
        (compiled rounds run at 2 or more: size 1 would be specialised and compiled again)."""
        return next((s for s in self.capture_sizes or () if s >= n), max(n, 2) if self.compile else n)

    @staticmethod
    def _prefill_chunk(prefilling: list[Sequence], budget: int,
                       stop: Callable[[Sequence], int | None]) -> list[tuple[Sequence, int]]:
        """The prompt chunks that run now: (sequence, tokens). A sequence's chunks end at multiples
        of `budget` from its first token, whatever its neighbours, so its prefill splits the same
        way in any batch, shard or resume, and at `stop(seq)` (a shared head's end) where it has
        one; a step takes whole chunks, first fit, up to `budget`."""
        chosen, left = [], budget
        for seq in prefilling:
            n = min(len(seq.prompt) - seq.prefilled, budget - seq.prefilled % budget)
            if (end := stop(seq)) is not None and seq.prefilled < end:
                n = min(n, end - seq.prefilled)
            if n <= left:
                chosen.append((seq, n))
                left -= n
        return chosen

    def _prefill(self, chunks: list[tuple[Sequence, int]], block: int, caches: list[torch.Tensor],
                 heads: HeadPool) -> list[Sequence]:
        """Run these prompt chunks; returns the sequences whose prompt is complete, each with its
        first token (or failed: logits that are not finite), their followers among them. A
        leader whose chunk ends at its shared head's end keeps the head there."""
        seqs = [seq for seq, _ in chunks]
        rows = [SeqRows(seq.pages, seq.prefilled, n, seq.prefilled + n) for seq, n in chunks]
        # Logits are computed for the last prompt row (the first token) and, where prompt
        # logprobs are asked for, for every row of the chunk: `scored[i]` lists seqs[i]'s.
        ids, logit_rows, scored, row = [], [], [], 0
        for seq, r in zip(seqs, rows):
            ids += seq.prompt[r.start:r.start + r.count]
            done = r.start + r.count == len(seq.prompt)
            if seq.prompt_logprobs is not None:
                wanted = range(row, row + r.count)
            else:
                wanted = range(row + r.count - 1, row + r.count) if done else range(0)
            scored.append(range(len(logit_rows), len(logit_rows) + len(wanted)))
            logit_rows += wanted
            row += r.count
        meta = build_meta(rows, self.page_size, logit_rows, self.device, [s.row for s in seqs],
                          backend=self.attention, name="prefill", batch_rows=[s.row for s in seqs], ring=self.ring,
                          micro_batches=self.micro_batches)
        self.attention.plan(meta)
        logits, taps = self.target(torch.tensor(ids, dtype=torch.int64, device=self.device), meta)
        if block > 1 and parallel.last_stage():
            self.drafter.write_context(taps, meta)
        if not parallel.last_stage():  # the last stage's logits rows, for every stage's host to read
            logits = torch.empty((len(logit_rows), self.target.vocab_size), dtype=wide_dtype(self.target.dtype),
                                 device=self.device)
        parallel.from_last_stage(logits)
        for seq, r in zip(seqs, rows):  # only now: a step that raised leaves nothing half-counted
            seq.prefilled += r.count
            seq.computed += r.count
        self.prefill_tokens += len(ids)
        scores = None
        if any(s.prompt_logprobs is not None for s in seqs):
            temperature = [s.params.temperature for s, r in zip(seqs, scored) for _ in r]
            scores = log_probs(logits, torch.tensor(temperature, device=self.device))
            for seq, r, here in zip(seqs, rows, scored):
                if seq.prompt_logprobs is not None:  # row i scores prompt token i + 1
                    nexts = seq.prompt[r.start + 1:r.start + r.count + 1]
                    self._score(seq.prompt_logprobs, scores[here.start:here.start + len(nexts)], nexts,
                                seq.params.prompt_logprobs)
        for seq, here in zip(seqs, scored):
            if heads.stop(seq) == seq.prefilled:  # its last row scores the token after the head
                edge = scores[here[-1]].clone() if seq.prompt_logprobs is not None else None
                heads.keep(seq, self._copier(caches), self.rings, edge)
        finishing, last = [], []  # with the logits row each one's first token comes from
        for seq, here in zip(seqs, scored):
            if seq.prefilled == len(seq.prompt):
                for s in (seq, *self._fork(seq, caches)):
                    finishing.append(s)
                    last.append(here[-1])
        if not finishing:
            return []
        first = logits[last]
        finite = torch.isfinite(first).all(-1).tolist()
        scores = None
        if any(s.logprobs is not None for s in finishing):  # before _first_tokens edits `first`
            scores = log_probs(first, torch.tensor([s.params.temperature for s in finishing], device=self.device))
        for i, (seq, t, ok) in enumerate(zip(finishing, self._first_tokens(first, finishing).tolist(), finite)):
            if not ok:
                seq.fail("non_finite_logits", f"the target's logits after the prompt ({len(seq.prompt)} "
                                              "tokens) are not finite")
                continue
            seq.t_first = time.monotonic()
            seq.append([t])
            if seq.matcher is not None:
                seq.matcher.accept_token(t)
            if seq.logprobs is not None:
                self._score(seq.logprobs, scores[i:i + 1], [t], seq.params.logprobs)
            seq.check_stop_strings(self.decode, 1)
        return finishing

    def _fork(self, leader: Sequence, caches: list[torch.Tensor]) -> list[Sequence]:
        """The followers of a prefilled prompt start where it ends, with its recurrent state."""
        followers, leader.followers = leader.followers, []
        self._copy_prompt(leader, followers, len(leader.prompt), caches)
        for seq in followers:
            if self.recurrent:
                self.target.copy_state(leader.row, seq.row)
            # The leader's ring holds its prompt's last positions.
            for ring, source in zip(self.rings.of(seq.row), self.rings.of(leader.row)):
                ring.copy_(source)
        return followers

    def _copier(self, caches: list[torch.Tensor]) -> Callable[[list[int], list[int]], None]:
        """copy(src, dst): cache slots src -> dst in every slot-indexed cache (under a latent split,
        the positions this rank keeps, at its rows: both hold the same positions, the same owners);
        slots both lists share (a shared head's pages) are left alone."""
        def copy(src: list[int], dst: list[int]) -> None:
            pairs = [(s, d) for s, d in zip(src, dst, strict=True) if s != d]
            if not pairs:
                return
            whole, to = (torch.tensor(x, dtype=torch.int64, device=self.device) for x in zip(*pairs))
            src_rows, dst_rows = self.split.owned_pairs(whole, to) if self.split else (whole, to)
            for cache in caches:
                cache[dst_rows] = cache[src_rows]
        return copy

    def _copy_prompt(self, source: Sequence, seqs: list[Sequence], n: int, caches: list[torch.Tensor]) -> None:
        """`seqs` (sharing `source`'s prompt) take its first n positions' cache slots (the
        target's and the drafter's context) as prefilled; with prompt logprobs (the same K),
        the source's."""
        copy = self._copier(caches)
        for seq in seqs:
            copy(slots(source.pages, range(n), self.page_size), slots(seq.pages, range(n), self.page_size))
            seq.prefilled = seq.cached = n
            if seq.prompt_logprobs is not None:  # the source's are complete: its prefill is done
                # Entries 0..n: the copied rows score prompt tokens 1..n; its own prefill the rest.
                seq.prompt_logprobs = source.prompt_logprobs.cut(min(n + 1, len(seq.prompt)))

    @staticmethod
    def _score(into: Logprobs, scores: torch.Tensor, tokens: list[int], k: int) -> None:
        """Record each token's logprob and the top k of its row of scores (one pass, one read-back)."""
        if not tokens:
            return
        top = scores.topk(min(k, scores.shape[-1]), dim=-1)
        picked = scores.gather(-1, torch.tensor(tokens, device=scores.device)[:, None])[:, 0]
        for row in zip(picked.tolist(), top.indices.tolist(), top.values.tolist()):
            into.add(*row)

    def _first_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The token after each prompt (its coin: the position it takes, the prompt's length)."""
        params = [s.params for s in seqs]
        if all(s.plain_greedy for s in seqs):
            return top1(logits)

        def col(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        def table(lists: list[list], fill, dtype: torch.dtype) -> torch.Tensor:  # ragged -> padded
            width = max(map(len, lists))
            return col([list(x) + [fill] * (width - len(x)) for x in lists], dtype)

        # In place: `logits` were checked for non-finite values before this. The first token is
        # token 0: nothing generated yet (only the prompt is penalised) and a row with min_tokens
        # holds its stop ids.
        add_bias_(logits, table([[t for t, _ in p.logit_bias] for p in params], -1, torch.int64),
                  table([[b for _, b in p.logit_bias] for p in params], 0.0, torch.float32))
        if any(p.penalized for p in params):
            in_prompt = torch.zeros(logits.shape, dtype=torch.bool, device=self.device)
            for i, seq in enumerate(seqs):
                in_prompt[i, seq.prompt] = True
            penalize_(logits, torch.zeros(logits.shape, dtype=torch.int32, device=self.device), in_prompt,
                      col([[]] * len(seqs)), col([p.repetition_penalty for p in params], torch.float32),
                      col([p.frequency_penalty for p in params], torch.float32),
                      col([p.presence_penalty for p in params], torch.float32))
        hold_stops_(logits, table([p.stop_token_ids for p in params], -1, torch.int64),
                    col([p.min_tokens > 0 for p in params], torch.bool))
        if any(s.matcher is not None for s in seqs):
            bits = torch.full((len(seqs), -(-logits.shape[-1] // 32)), -1, dtype=torch.int32)
            for i, seq in enumerate(seqs):
                if seq.matcher is not None:
                    seq.matcher.fill_next_token_bitmask(bits, i)
            mask_disallowed_(logits, bits.to(self.device))
        if all(p.temperature <= 0 for p in params):
            return top1(logits)

        return choose_tokens(logits, col([p.temperature for p in params], torch.float32),
                             col([p.top_k for p in params]), col([p.top_p for p in params], torch.float32),
                             col([p.seed for p in params]), col([len(s.prompt) for s in seqs]), self.ops.sample,
                             col([p.min_p for p in params], torch.float32))

    def _round(self, batch: DecodeBatch, running: list[Sequence | None], step: Round, graphs: RoundGraphs | None,
               block: int, width: int, schedule: Schedule | None = None
               ) -> tuple[list[tuple[int, int, Sequence]], bool, int | None]:
        """One round for rows 0..n-1, n past the last running sequence (rows without one are
        padding), verifying `width` rows a sequence (a per-row bucket's `schedule`: each row the
        drafts worth it, n * (width - 1) at most where captured); extends each sequence with what
        it emitted. Returns the drafts each speculating sequence kept and verified, with it;
        whether the round went per row; and the drafts an eager per-row round verified in all
        (its cost follows them; else None: the cost table's at its width)."""
        n = max(i for i, s in enumerate(running) if s is not None) + 1
        size = self.padded(n)
        greedy = all(s.plain_greedy for s in running[:n] if s is not None)
        constrained = any(s is not None and s.matcher is not None for s in running[:n])
        positions = [s.position if s is not None else 0 for s in running[:n]]
        captured = graphs is not None and graphs.covers(size, width) and not constrained
        per_row = schedule is not None and schedule.calibration is not None and width > 1 and not constrained
        if per_row:
            ready_rows(batch, schedule, size, captured)
            width = width if captured else block  # eager: any row may verify its whole block
        self.attention.plan_round(batch, size, round_kv_lens(running[:n], block, width), captured, {"verify": width})
        if captured:
            graphs.replay(size, greedy, width)
        elif constrained:  # eager, in two halves: the grammars read the drafts in between
            drafted = step.draft(batch, size, max(positions) + block, width)
            self._grammar_masks(batch, running[:n], block)
            step.verify(batch, size, False, drafted, constrained=True)
        else:
            step(batch, size, greedy, max(positions) + block, width, per_row=per_row)
        accepted = take_round(batch, running[:n], block, self.decode)
        return accepted, per_row, None if captured or not per_row else sum(v for _, v, _ in accepted)

    @staticmethod
    def _grammar_masks(batch: DecodeBatch, running: list[Sequence | None], block: int) -> None:
        """Row j of a sequence's verify may take what its grammar allows after the drafts
        d_1..d_j. Past a draft the grammar refuses (or a finished grammar), rows are left open:
        the verify cannot accept that draft, so nothing reads them."""
        bits = batch.grammar_bits
        bits.fill_(-1)  # padding rows too: a fully masked row would have no distribution
        drafts = batch.ids[:len(running), 1:].tolist()
        for i, seq in enumerate(running):
            if seq is None or seq.matcher is None:
                continue
            m, taken = seq.matcher, 0
            for j in range(block):
                r = i * block + j
                m.fill_next_token_bitmask(bits, r)
                d = drafts[i][j] if j < block - 1 else -1
                if d < 0 or not (int(bits[r, d // 32]) >> (d % 32)) & 1 or not m.accept_token(d):
                    break
                taken += 1
                if m.is_terminated():
                    break
            m.rollback(taken)
        batch.allowed_bits.copy_(bits)
