"""A thinking model's output split into its reasoning and its answer (output.split_reasoning).

The split is made on token ids, at the model's own think delimiters: single tokens of its
tokenizer. Delimiters that are special tokens vanish from decoded text (special tokens are
skipped), so the text alone could not be split.

Policy, for the generated ids of one sample:
- an end delimiter among them: the reasoning is what comes before the first one (start
  delimiters left out), the response is what follows it;
- no end delimiter, but the output opened a think block, or the prompt ends inside one (a
  template that starts the thinking for the model): the reasoning never closed; it is all
  reasoning, and the response is null (finish_reason says why: length, or a stop);
- neither: the model did not think; the reasoning is null and everything is the response.
Each part is decoded on its own (special tokens skipped, whitespace kept as generated), so
reasoning + response is the unsplit response without its delimiters; a stop string cuts the
part it ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dflash_batch.job import JobError
from dflash_batch.tokenizer import Tokenizer

# Think delimiters of the thinking models we know, tried in order when none are named.
KNOWN = [("<think>", "</think>"), ("◁think▷", "◁/think▷")]


@dataclass(frozen=True)
class Delimiters:
    start: int
    end: int


def find_delimiters(tokenizer: Tokenizer, names: list[str] | None, where: str) -> Delimiters:
    """The token ids of the named delimiters, or of the first known pair the tokenizer has."""
    if names:
        ids = [tokenizer.token_to_id(n) for n in names]
        missing = [n for n, i in zip(names, ids) if i is None]
        if missing:
            raise JobError(f"output.reasoning_delimiters: {missing} is not a single token of the tokenizer of "
                           f"{where}")
        return Delimiters(*ids)
    for start, end in KNOWN:
        ids = tokenizer.token_to_id(start), tokenizer.token_to_id(end)
        if None not in ids:
            return Delimiters(*ids)
    raise JobError(f"output.split_reasoning: the tokenizer of {where} has none of the think delimiters "
                   f"{', '.join('/'.join(p) for p in KNOWN)} as single tokens; name them with "
                   "output.reasoning_delimiters: [START, END]")


def _inside_think(prompt_ids: list[int], d: Delimiters) -> bool:
    """Whether the prompt ends inside a think block (its last start after its last end)."""
    last = {d.start: -1, d.end: -1}
    for i, t in enumerate(prompt_ids):
        if t in last:
            last[t] = i
    return last[d.start] > last[d.end]


def split_reasoning(prompt_ids: list[int], token_ids: list[int], stop_string: str | None, d: Delimiters,
                    decode: Callable[[list[int]], str]) -> tuple[str | None, str | None]:
    """(reasoning, response) of one sample; `token_ids` without a final stop token;
    `stop_string`: the stop string that ended the sample, if one did."""
    ids = list(token_ids)
    end = ids.index(d.end) if d.end in ids else None
    head = ids if end is None else ids[:end]
    thought = [t for t in head if t != d.start]  # the start delimiter goes wherever it stood
    if end is not None:
        reasoning, response = thought, ids[end + 1:]
    elif len(thought) < len(head) or _inside_think(prompt_ids, d):
        reasoning, response = thought, None
    else:
        reasoning, response = None, ids
    parts = [None if p is None else decode(p) for p in (reasoning, response)]
    last = 1 if parts[1] is not None else 0
    if stop_string and parts[last] is not None and (i := parts[last].find(stop_string)) >= 0:
        parts[last] = parts[last][:i]
    return parts[0], parts[1]
