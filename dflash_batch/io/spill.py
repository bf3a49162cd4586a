"""Rows regrouped by key with memory bounded by a part, not by the whole: duplicate ids, the
samples of one prompt (OpenAI export), a parent run and its retries (merge).

`by_key` writes the rows it is given into `parts` spill files by a hash of the key column, then
reads them back one at a time: every row of a key lies in one part, so a question about one
key (how many rows hold it, which of them wins) is answered part by part.
"""

from __future__ import annotations

import tempfile
import zlib
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

PART_ROWS = 500_000  # up to this many rows are regrouped in memory; more are spilled to parts
SPILL_PARTS = 256


def key_hashes(keys: pa.Array | pa.ChunkedArray, parts: int) -> np.ndarray:
    """A stable part number of each key (crc32 of its text; the same in every process)."""
    return np.fromiter((zlib.crc32(str(k).encode()) % parts for k in keys.to_pylist()), np.int64, len(keys))


def by_key(tables: Iterable[pa.Table], key: str, parts: int | None = None) -> Iterator[pa.Table]:
    """Each part of the rows of `tables` (one schema), split by `key`. `parts` None: one part,
    in memory, when the rows are at most PART_ROWS, else SPILL_PARTS (a stream's length is not
    known ahead): a part then holds under PART_ROWS rows up to SPILL_PARTS * PART_ROWS rows (128M).
    The spill files live in a temporary directory removed at the end."""
    tables = iter(tables)
    if parts is None:
        head, rows = [], 0
        for table in tables:
            head.append(table)
            rows += table.num_rows
            if rows > PART_ROWS:
                break
        else:  # all of it fits one part
            if head:
                yield pa.concat_tables(head)
            return
        tables, parts = chain(head, tables), SPILL_PARTS
    elif parts == 1:
        tables = list(tables)
        if tables:
            yield pa.concat_tables(tables)
        return
    with tempfile.TemporaryDirectory(prefix="dflash-spill-") as tmp:
        # Arrow IPC streams: batches appended as they come, no footer growing with every write.
        files = [Path(tmp) / f"{i}.arrows" for i in range(parts)]
        writers: list[pa.ipc.RecordBatchStreamWriter | None] = [None] * parts
        try:
            for table in tables:
                part = key_hashes(table[key], parts)
                for i in np.unique(part):
                    if writers[i] is None:
                        writers[i] = pa.ipc.new_stream(files[i], table.schema)
                    writers[i].write_table(table.filter(pa.array(part == i)))
        finally:
            for w in writers:
                if w is not None:
                    w.close()
        for i, w in enumerate(writers):
            if w is not None:
                with pa.ipc.open_stream(files[i]) as reader:
                    yield reader.read_all()


def duplicates(tables: Iterable[pa.Table], keys: list[str], detail: str | None = None, examples: int = 5) -> dict:
    """{count: keys held by more than one row, rows: the rows holding them, examples: the first
    few keys (each with the list of its rows' `detail` values)}, the rows split by keys[0] into
    spill parts."""
    count = rows = 0
    found: list[dict] = []
    for part in by_key(tables, keys[0]):
        counts = part.group_by(keys).aggregate([(keys[0], "count")])
        dup = counts.filter(pc.greater(counts[f"{keys[0]}_count"], 1))
        count, rows = count + dup.num_rows, rows + (pc.sum(dup[f"{keys[0]}_count"]).as_py() or 0)
        shown = dup.select(keys).slice(0, max(0, examples - len(found)))
        if detail is not None and shown.num_rows:
            shown = part.join(shown, keys, join_type="inner").group_by(keys).aggregate([(detail, "list")])
        found += shown.to_pylist()
    return {"count": count, "rows": rows, "examples": found}
