"""Output rows and the Parquet part writer.

One row per (input row, sample). A part is written to a hidden temporary name, fsynced and
renamed into place, then the directory is fsynced: a part either exists whole or not at all, so
the committed files are the single record of progress.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_batch import __version__
from dflash_batch.job import Job, JobError

# 2: spec_drafts_verified and spec_verified_histogram (v1 rows assumed every round verified the block)
# 3: cached_tokens
SCHEMA_VERSION = 3

# (name, arrow type, nullable, description). Passthrough columns follow sample_index.
COLUMNS: list[tuple[str, pa.DataType, bool, str]] = [
    ("row_id", pa.string(), False, "input.id_column, else a hash of (file, row index)"),
    ("sample_index", pa.int32(), False, "0..n-1"),
    ("response", pa.string(), True, "generated text (special tokens skipped; cut before a stop string); "
     "with output.split_reasoning the answer after the reasoning, null if the reasoning never closed"),
    ("finish_reason", pa.string(), False, "stop | length | error"),
    ("stop_reason", pa.string(), True, "the stop string, or the stop token id, that ended the sample"),
    ("prompt_tokens", pa.int32(), True, "prompt length in tokens (after truncation)"),
    ("cached_tokens", pa.int32(), True, "of prompt_tokens, those taken from a head other rows share or from "
     "another sample's prefill of the prompt, not computed for this sample (OpenAI's usage cached_tokens)"),
    ("completion_tokens", pa.int32(), True, "generated tokens, stop token included"),
    ("prompt_truncated", pa.bool_(), False, "the overflow policy truncated the prompt"),
    ("status", pa.string(), False, "ok | error"),
    ("error_type", pa.string(), True, "machine-readable reason of an error row"),
    ("error", pa.string(), True, "human-readable reason of an error row, naming file/row/column"),
    ("bucket", pa.string(), True, "length bucket, e.g. 2048-8192 (prompt + max_new_tokens)"),
    ("seed", pa.int64(), False, "this sample's seed, from (job seed, row_id, sample_index)"),
    ("spec_block_size", pa.int16(), True, "verify width (anchor + drafts); null without speculation"),
    ("spec_rounds", pa.int32(), True, "verify rounds (null without speculation)"),
    ("spec_accepted", pa.int32(), True, "accepted draft tokens, bonus tokens excluded"),
    ("spec_drafts_verified", pa.int32(), True, "drafts the target verified over the rounds (block_size - 1 "
     "a round, or the k a draft schedule chose; in the last round, those up to the sample's end)"),
    ("spec_histogram", pa.list_(pa.int32()), True, "rounds with 0..block_size-1 accepted drafts"),
    ("spec_verified_histogram", pa.list_(pa.int32()), True, "rounds that verified 0..block_size-1 drafts"),
    ("acc_len", pa.float64(), True, "1 + spec_accepted / spec_rounds"),
    ("proposal_acceptance", pa.float64(), True, "spec_accepted / spec_drafts_verified"),
    ("ttft_s", pa.float64(), True, "admission to first token, seconds"),
    ("latency_s", pa.float64(), True, "admission to finish, seconds"),
    ("shard_index", pa.int32(), False, "the shard that wrote the row"),
    ("config_hash", pa.string(), False, "ties the row to run.json"),
]
OPTIONAL_COLUMNS: dict[str, tuple[pa.DataType, str]] = {
    "response_token_ids": (pa.list_(pa.int32()), "generated token ids (output.include_token_ids)"),
    "rendered_prompt": (pa.string(), "the prompt text after the chat template (output.include_prompt)"),
    "reasoning": (pa.string(), "the thinking before the answer, null if the model did not think "
                  "(output.split_reasoning)"),
    # sampling.logprobs: one entry per generated token (response_token_ids' order)
    "logprobs": (pa.list_(pa.float32()), "each generated token's logprob (sampling.logprobs)"),
    "top_logprob_ids": (pa.list_(pa.list_(pa.int32())), "per generated token, the top-K token ids at its "
                        "position, most likely first"),
    "top_logprobs": (pa.list_(pa.list_(pa.float32())), "their logprobs"),
    # sampling.prompt_logprobs: one entry per prompt token, null at the first
    "prompt_logprobs": (pa.list_(pa.float32()), "each prompt token's logprob given the tokens before it "
                        "(sampling.prompt_logprobs)"),
    "prompt_top_logprob_ids": (pa.list_(pa.list_(pa.int32())), "per prompt token, the top-K token ids"),
    "prompt_top_logprobs": (pa.list_(pa.list_(pa.float32())), "their logprobs"),
    # conversations (input.followups_column, conversation): the row's columns above count every
    # turn's tokens and rounds together; response and finish_reason are the last turn's
    "conversation": (pa.string(), "the whole conversation as JSON messages: the input's, then each assistant "
                     "turn (with its tool_calls), tool result and later user turn"),
    "turn_prompt_tokens": (pa.list_(pa.int32()), "per assistant turn, the prompt tokens the target ran for it "
                           "(the first: the prompt less cached_tokens; later: only the turn's own)"),
    "turn_completion_tokens": (pa.list_(pa.int32()), "per assistant turn, the tokens it generated"),
    "turn_token_ids": (pa.list_(pa.list_(pa.int32())), "per assistant turn, its generated token ids "
                       "(output.include_token_ids)"),
    "turn_finish_reasons": (pa.list_(pa.string()), "per assistant turn, stop | length"),
    "turn_spec_rounds": (pa.list_(pa.int32()), "per assistant turn, its verify rounds (null without speculation)"),
    "turn_spec_accepted": (pa.list_(pa.int32()), "per assistant turn, its accepted drafts: its acc_len is 1 + "
                           "accepted / rounds"),
    "tool_calls": (pa.int32(), "tool calls the conversation made"),
    "tool_errors": (pa.int32(), "of those, calls that failed: an unknown tool, arguments that are not a JSON "
                    "object, an exception or the timeout (the model was told so)"),
    "conversation_end": (pa.string(), "no_followup (no later user turn) | max_turns | context_full (the next turn "
                         "fits no bucket); null in an error row"),
}
CONVERSATION_COLUMNS = ("conversation", "turn_prompt_tokens", "turn_completion_tokens", "turn_finish_reasons",
                        "turn_spec_rounds", "turn_spec_accepted", "tool_calls", "tool_errors", "conversation_end")
RESERVED = {c[0] for c in COLUMNS} | set(OPTIONAL_COLUMNS)
OUTPUT_TYPES = {name: typ for name, typ, _, _ in COLUMNS}


def output_json_schema() -> dict:
    return {
        "title": "dflash-batch output rows",
        "schema_version": SCHEMA_VERSION,
        "note": "Passthrough columns follow sample_index with their input types.",
        "columns": [{"name": n, "type": str(t), "nullable": nl, "description": d} for n, t, nl, d in COLUMNS],
        "optional_columns": [{"name": n, "type": str(t), "nullable": True, "description": d}
                             for n, (t, d) in OPTIONAL_COLUMNS.items()],
    }


def _passthrough_array(values: list[Any]) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        # Mixed JSON types (dicts and strings) share no Arrow type: a text column, its strings as
        # they are (as in a part whose values are all strings) and the other values as JSON text.
        return pa.array([v if v is None or isinstance(v, str) else orjson.dumps(v).decode() for v in values],
                        pa.string())


def output_record(row: dict, passthrough: list[str], optional: list[str]) -> dict:
    """One output row as a dict of its columns, in the Parquet files' order."""
    out = {}
    for i, (name, *_) in enumerate(COLUMNS):
        out[name] = row.get(name)
        if i == 1:
            out.update(zip(passthrough, row["passthrough"]))
    return out | {name: row.get(name) for name in optional}


def rows_to_table(rows: list[dict], passthrough: list[str], optional: list[str],
                  metadata: dict[str, str]) -> pa.Table:
    arrays, fields = [], []
    for i, (name, typ, nullable, _) in enumerate(COLUMNS):
        arrays.append(pa.array([r.get(name) for r in rows], typ))
        fields.append(pa.field(name, typ, nullable))
        if i == 1:  # passthrough columns sit right after the key
            for j, col in enumerate(passthrough):
                arr = _passthrough_array([r["passthrough"][j] for r in rows])
                arrays.append(arr)
                fields.append(pa.field(col, arr.type))
    for name in optional:
        typ = OPTIONAL_COLUMNS[name][0]
        arrays.append(pa.array([r.get(name) for r in rows], typ))
        fields.append(pa.field(name, typ))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=metadata))


def check_writable(out_dir: Path, field: str = "output.dir") -> None:
    """Refuse an output directory this process cannot write, before anything is loaded: a file
    is made and removed in it, or in the nearest directory above it that exists (where it
    would be made). Permission bits say nothing of a read-only mount, nor to root."""
    where = out_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise JobError(f"{field}: {out_dir} cannot be made: {where} is not a directory")
    try:
        tempfile.TemporaryFile(dir=where).close()
    except OSError as e:
        raise JobError(f"{field}: {out_dir} is not writable ({e.strerror or e} creating a file in {where}); "
                       "choose another output.dir or --output-dir") from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CommitError(RuntimeError):
    """Writing an output file failed (a full disk, an I/O error): what was committed before is
    intact, this file is not; the message says which and what to do."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a hidden temporary file, fsync it, rename it into place, fsync the directory:
    the file is whole or absent. A failure removes the temporary file and says which step."""
    tmp = path.with_name(f".{path.name}.tmp")
    step = "writing"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            step = "syncing"
            os.fsync(f.fileno())
        step = "renaming it into place"
        os.replace(tmp, path)
        step = "syncing its directory"
        _fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        what = errno.errorcode.get(e.errno, "OSError")
        raise CommitError(f"{path}: {step} failed: {e.strerror or e} ({what}). Files committed before it are "
                          "intact; fix the disk (free space, check the device) and rerun the same command: "
                          "it resumes from what is committed") from e


def part_metadata(job: Job, config_hash: str) -> dict[str, str]:
    """The key-value metadata every part of a run carries: the version, the run's hash, the job."""
    return {"dflash_batch.version": __version__, "dflash_batch.config_hash": config_hash,
            "dflash_batch.job": job.model_dump_json()}


class PartWriter:
    """Buffers finished rows of one shard and commits them as Parquet parts."""

    def __init__(self, shard_dir: Path, *, passthrough: list[str], optional: list[str],
                 metadata: dict[str, str], rows_per_part: int, flush_seconds: float, compression: str):
        self.dir = shard_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".*.tmp"):  # left by a killed writer; never committed
            stale.unlink()
        existing = [int(p.stem.split("-")[1]) for p in self.dir.glob("part-*.parquet")]
        self.next_part = max(existing, default=-1) + 1
        self.passthrough, self.optional, self.metadata = passthrough, optional, metadata
        self.rows_per_part, self.flush_seconds = rows_per_part, flush_seconds
        self.compression = None if compression == "none" else compression
        self.buffer: list[dict] = []
        self.last_flush = time.monotonic()
        self.committed_rows = 0

    def add(self, rows: list[dict]) -> None:
        """Rows that land in the same part."""
        self.buffer += rows
        if len(self.buffer) >= self.rows_per_part or time.monotonic() - self.last_flush > self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.buffer:
            return
        self.write_part(self.buffer)
        self.buffer = []

    def write_part(self, rows: list[dict]) -> Path:
        """Commit `rows` as the next part; its path."""
        table = rows_to_table(rows, self.passthrough, self.optional, self.metadata)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression=self.compression)
        path = self.dir / f"part-{self.next_part:06d}.parquet"
        atomic_write_bytes(path, sink.getvalue().to_pybytes())
        self.next_part += 1
        self.committed_rows += len(rows)
        return path
