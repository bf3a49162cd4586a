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

# Up to this many bytes of rows are regrouped in memory (a group_by's hash table takes several
# times that); more are spilled.
PART_BYTES = 32 << 20
SPILL_PARTS = 256  # parts at the least, when spilling


def key_hashes(keys: pa.Array | pa.ChunkedArray, parts: int) -> np.ndarray:
    """A stable part number of each key (crc32 of its text; the same in every process)."""
    return np.fromiter((zlib.crc32(str(k).encode()) % parts for k in keys.to_pylist()), np.int64, len(keys))


def by_key(tables: Iterable[pa.Table], key: str, total_bytes: int | None = None,
           spill_dir: Path | None = None) -> Iterator[pa.Table]:
    """Each part of the rows of `tables` (one schema), split by `key`. Rows of at most
    PART_BYTES make one part, in memory; more are spilled to parts of about PART_BYTES each
    (`total_bytes`: their size if known; else SPILL_PARTS parts, under PART_BYTES each up to 8 GiB
    of rows). The spill files (zstd Arrow streams) live in a temporary directory in `spill_dir`
    (default: TMPDIR), removed at the end, however the caller stops."""
    tables = iter(tables)
    head, size = [], 0
    for table in tables:
        head.append(table)
        size += table.nbytes
        if size > PART_BYTES:
            break
    else:  # all of it fits one part
        if head:
            yield pa.concat_tables(head)
        return
    parts = max(SPILL_PARTS, (total_bytes or 0) // PART_BYTES + 1)
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with tempfile.TemporaryDirectory(prefix="dflash-spill-", dir=spill_dir) as tmp:
        # Arrow IPC streams: batches appended as they come, no footer growing with every write.
        files = [Path(tmp) / f"{i}.arrows" for i in range(parts)]
        writers: list[pa.ipc.RecordBatchStreamWriter | None] = [None] * parts
        try:
            for table in chain(head, tables):
                part = key_hashes(table[key], parts)
                order = np.argsort(part, kind="stable")  # one gather, then each part a zero-copy slice
                table, bounds = table.take(pa.array(order)), np.searchsorted(part[order], np.arange(parts + 1))
                for i in np.flatnonzero(np.diff(bounds)):
                    if writers[i] is None:
                        writers[i] = pa.ipc.new_stream(files[i], table.schema, options=options)
                    writers[i].write_table(table.slice(bounds[i], bounds[i + 1] - bounds[i]))
        finally:
            for w in writers:
                if w is not None:
                    w.close()
        del head
        for i, w in enumerate(writers):
            if w is not None:
                with pa.ipc.open_stream(files[i]) as reader:
                    yield reader.read_all()


def duplicates(tables: Iterable[pa.Table], keys: list[str], detail: str | None = None, examples: int = 5,
               spill_dir: Path | None = None) -> dict:
    """{count: keys held by more than one row, rows: the rows holding them, examples: the first
    few keys (each with the list of its rows' `detail` values)}, the rows split by keys[0] into
    spill parts."""
    count = rows = 0
    found: list[dict] = []
    for part in by_key(tables, keys[0], spill_dir=spill_dir):
        counts = part.group_by(keys).aggregate([(keys[0], "count")])
        dup = counts.filter(pc.greater(counts[f"{keys[0]}_count"], 1))
        count, rows = count + dup.num_rows, rows + (pc.sum(dup[f"{keys[0]}_count"]).as_py() or 0)
        shown = dup.select(keys).slice(0, max(0, examples - len(found)))
        if detail is not None and shown.num_rows:
            shown = part.join(shown, keys, join_type="inner").group_by(keys).aggregate([(detail, "list")])
        found += shown.to_pylist()
    return {"count": count, "rows": rows, "examples": found}
