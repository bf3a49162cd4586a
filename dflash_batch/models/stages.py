"""Pipeline stages of a target: which decoder layers a stage holds, and its part of a forward.

A stage holds a contiguous range of the layers. The ranges are chosen so that the stages' weights
(what a round reads; a layer's FLOPs a token follow its weights too) are as even as contiguous
ranges allow: Kimi-K3's KDA, MLA and dense layers weigh differently. The first stage also embeds
the tokens; the last holds the final norm and the LM head (and the drafter, which borrows the
target's embedding and head, so the last stage keeps an embedding too).

A forward (a captured round's verify, a prefill step's chunks) may go through the stages in
micro-batches, groups of its sequences: a stage runs group m while the next runs group m - 1,
and the last stage joins the groups' carries before its head. Rows are independent in a forward (attention within a
sequence, recurrent states per sequence, everything else per row), so the groups compute what
the whole does.

Between stages goes the carry: the rows' residual stream, what the model keeps beside it
(Kimi-K3's attention-residual blocks) and the drafter's taps taken so far, each [T, hidden],
stacked. Its depth is a function of the boundary alone, so the next stage knows what to receive.

A target taking part implements `held: range` (its layers), `num_layers`, `dtype`,
`embed(input_ids)`, `run_layers(carry, meta)`, `carry_depth(boundary)` and `head(carry, meta)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_batch import parallel


def balanced_spans(costs: list[float], stages: int, first: float = 0.0, last: float = 0.0) -> list[range]:
    """`stages` contiguous, non-empty ranges covering layers 0..len(costs)-1 whose largest cost
    (a range's layers, plus `first` on the first range and `last` on the last) is least; among
    equal ones, the one whose earlier stages end first."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"{n} layers do not split into {stages} pipeline stages (each needs a layer)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, a: int, b: int) -> float:  # stage s holding layers a..b-1
        return prefix[b] - prefix[a] + (first if s == 0 else 0.0) + (last if s == stages - 1 else 0.0)

    # best[s][b]: the least largest cost of stages 0..s holding layers 0..b-1, and where stage s starts
    best = [{b: (cost(0, 0, b), 0) for b in range(1, n - stages + 2)}]
    for s in range(1, stages):
        best.append({b: min((max(best[s - 1][a][0], cost(s, a, b)), a) for a in range(s, b))
                     for b in range(s + 1, n - stages + s + 2)})
    spans, end = [], n
    for s in range(stages - 1, -1, -1):
        start = best[s][end][1]
        spans.append(range(start, end))
        end = start
    return spans[::-1]


def held_layers(num_layers: int, sizes: Callable[[], tuple[list[int], int, int]]) -> range:
    """The layers this rank's stage holds (all of them without stages), balanced by their bytes:
    `sizes()` gives each layer's, the embedding's and the head's (asked only under stages)."""
    index, count = parallel.stage()
    if count == 1:
        return range(num_layers)
    layers, embed, head = sizes()
    return balanced_spans([float(b) for b in layers], count, embed, embed + head)[index]


def module_bytes(build: Callable[[], torch.nn.Module]) -> int:
    """The parameter bytes of a module `build` makes, made on the meta device (nothing allocated)."""
    with torch.device("meta"):
        module = build()
    return sum(p.numel() * p.element_size() for p in module.parameters())


def staged_forward(model, input_ids: torch.Tensor, meta) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The model's part of a forward: embed (first stage) or receive the carry, run the held
    layers, then hand the carry on, or (last stage) return (logits, taps) as a whole model does.
    A stage other than the last returns (None, None). A forward of `meta.micro_batches` groups
    goes through a group at a time: a stage runs group m while the next runs m - 1."""
    held = model.held
    last = held.stop == model.num_layers
    carries, groups = [], micro_batches(meta)
    for rows, part in groups:
        if len(groups) > 1:  # a backend that plans on the host plans each group (a prefill step's)
            part.backend.plan(part)
        if held.start == 0:
            carry = model.embed(input_ids[rows])
        else:
            shape = (model.carry_depth(held.start), part.num_rows, model.hidden_size)
            carry = list(parallel.recv_prev(shape, model.dtype, input_ids.device).unbind(0))
        carry = model.run_layers(carry, part)
        if last:
            carries.append(carry)
        else:
            parallel.send_next(torch.stack(carry))
    if not last:
        return None, None
    return model.head(carries[0] if len(carries) == 1 else [torch.cat(ts) for ts in zip(*carries)], meta)


def micro_batches(meta) -> list[tuple[slice, object]]:
    """(rows, meta) of each group of sequences a forward goes through the stages in: the forward
    whole, unless it is split over stages and asks for several; then as many groups (at most one
    a sequence) of whole sequences as its rows divide most evenly into."""
    n = meta.q_index.shape[0]
    groups = min(meta.micro_batches, n)
    if groups <= 1 or parallel.stage()[1] == 1:
        return [(slice(None), meta)]
    if meta.dense:
        starts = [i * meta.q_index.shape[1] for i in range(n + 1)]  # sequence i's first row
        bounds = even_bounds(n, groups)
    else:  # a prefill's chunks: each group ends at the sequence boundary nearest its share of rows
        starts = [0]
        for count in (meta.q_positions >= 0).sum(1).tolist():
            starts.append(starts[-1] + count)
        bounds = [0]
        for g in range(1, groups):
            share = meta.num_rows * g / groups
            bounds.append(min(range(bounds[-1] + 1, n - groups + g + 1), key=lambda b: abs(starts[b] - share)))
        bounds.append(n)
    return [(slice(starts[a], starts[b]), meta.sequences(a, b, slice(starts[a], starts[b])))
            for a, b in zip(bounds, bounds[1:])]


def even_bounds(n: int, groups: int) -> list[int]:
    """The bounds of `groups` contiguous ranges of 0..n-1 as even as they divide (a range may be
    empty where there are fewer items than groups)."""
    return [n * g // groups for g in range(groups + 1)]


def stage_name(name: str, held: range, num_layers: int, head: tuple[str, ...]) -> str | None:
    """A checkpoint tensor's name on a stage holding layers `held`: a layer's renumbered from the
    stage's first (model.layers.{i} -> model.layers.{i - held.start}); None for what another
    stage holds (its layers; the embedding, which the first and last stages hold; the tensors
    named by a prefix in `head`, which the last stage holds); other names as they are."""
    if held == range(num_layers):
        return name
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        i = int(parts[2])
        return ".".join([*parts[:2], str(i - held.start), *parts[3:]]) if i in held else None
    last = held.stop == num_layers
    if name.startswith("model.embed_tokens.") and not (held.start == 0 or last):
        return None
    return None if name.startswith(head) and not last else name
