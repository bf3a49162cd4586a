"""The turns of conversations not committed yet, one JSON line per turn, so that a killed run
resumes each conversation after its last finished turn: that turn's tokens, the messages it
added (tool results included: their calls are not made again) and the next turn's opening.

A conversation's row is committed (a Parquet part) when it ends; its lines are then only read
for rows not committed. A line is written and flushed once its turn's next step is made, before
the next turn starts: a turn in flight when the run is killed is generated again, and the tool
calls it wrote are made again (at least once); a finished turn never is. A last line cut by the
kill is skipped."""

from __future__ import annotations

import threading
from pathlib import Path

import orjson

from dflash_batch.engine.request import RequestKey

JOURNAL = "turns.jsonl"  # in the shard's directory


class TurnJournal:
    def __init__(self, shard_directory: Path | None, write: bool = True):
        """None: nothing is kept (no output directory); `write`: false where another process
        writes it (tensor-parallel ranks other than 0 only read it)."""
        self.path = shard_directory / JOURNAL if shard_directory is not None else None
        self.write = write
        self._file = None
        self._lock = threading.Lock()  # turns end on the engine's thread and on tool threads

    def read(self) -> dict[RequestKey, list[dict]]:
        """Each conversation's turns so far, in order."""
        entries: dict[RequestKey, list[dict]] = {}
        if self.path is None or not self.path.is_file():
            return entries
        for line in self.path.read_bytes().splitlines():
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # the last line, cut by a kill
            entries.setdefault((entry["row_id"], entry["sample_index"]), []).append(entry)
        return entries

    def add(self, key: RequestKey, entry: dict) -> None:
        if self.path is None or not self.write:
            return
        line = orjson.dumps({"row_id": key[0], "sample_index": key[1], **entry}) + b"\n"
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "ab")
                if self._file.tell() and not self.path.read_bytes().endswith(b"\n"):
                    self._file.write(b"\n")  # after a line cut by a kill: this one stands alone
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
