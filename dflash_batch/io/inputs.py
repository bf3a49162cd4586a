"""Streaming readers for Parquet and JSONL inputs, local or remote.

Inputs are read in batches of records so a 10M-row file is never held whole. A path with a
protocol (`hf://`, `s3://`, `gs://`, `memory://`, ...) is read through fsspec, streamed the same
way (Parquet by row groups, JSONL line by line), never downloaded whole first. A JSONL line that
does not parse is not fatal: it comes out as a record with `error` set (file and line, in words)
and becomes an error row. A missing file, one without rows, one without a column the job names,
or one whose prompt column holds another kind of value than the job reads there (a Parquet
column of JSON text where chat messages belong) is a job-level error: it stops the run before
any work, naming the file and the column (check_inputs).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import chain
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_batch.io.spill import duplicates
from dflash_batch.job import InputSpec, JobError

_EXT_FORMAT = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
               ".json": "jsonl"}
SCHEMA_LINES = 100  # a JSONL file's columns: the keys of its first this many non-empty lines


@dataclass(slots=True)
class Record:
    source: str            # file name relative to the common root of all inputs (stable ids)
    index: int             # 0-based row (Parquet) or line (JSONL) number in that file
    data: dict | None      # column -> value; None when the line could not be parsed
    error: str | None = None


InputFile = Path | str  # a local path, or a remote one as a URL


def _remote(p: str) -> tuple | None:
    """(filesystem, path) of a URL, through fsspec; None for a local path."""
    if "://" not in p:
        return None
    try:
        import fsspec
    except ImportError:
        raise JobError(f"input.paths: {p!r} is remote: reading it needs fsspec (pip install "
                       "'dflash-batch[remote]')") from None
    try:
        return fsspec.core.url_to_fs(p)
    except (ImportError, ValueError) as e:  # fsspec names the package a protocol needs
        raise JobError(f"input.paths: {p!r}: {e}") from None


def _remote_files(p: str) -> list[str]:
    fs, path = _remote(p)
    protocol = p.split("://", 1)[0]
    if any(ch in path for ch in "*?["):
        found = sorted(fs.glob(path))
        if not found:
            raise JobError(f"input.paths: {p!r} matches no file")
    elif fs.isdir(path):
        found = sorted(f for f in fs.find(path) if os.path.splitext(f)[1] in _EXT_FORMAT)
        if not found:
            raise JobError(f"input.paths: directory {p!r} holds no .parquet/.jsonl file")
    elif fs.isfile(path):
        found = [path]
    else:
        raise JobError(f"input.paths: {p!r} does not exist")
    return [f"{protocol}://{f.removeprefix('/') if protocol == 'memory' else f}" for f in found]


def _open(path: InputFile):
    if isinstance(path, str):
        fs, inner = _remote(path)
        return fs.open(inner, "rb")
    return open(path, "rb")


def expand_paths(paths: list[str], fmt: str) -> list[tuple[InputFile, str]]:
    """Files named by paths/globs/directories, in a stable order, each with its format."""
    files: list[InputFile] = []
    for p in paths:
        if "://" in p:
            files += _remote_files(p)
        elif any(ch in p for ch in "*?["):
            matched = sorted(glob.glob(p, recursive=True))
            if not matched:
                raise JobError(f"input.paths: {p!r} matches no file")
            files += [Path(m) for m in matched if Path(m).is_file()]
        elif Path(p).is_dir():
            found = sorted(f for f in Path(p).rglob("*") if f.is_file() and f.suffix in _EXT_FORMAT)
            if not found:
                raise JobError(f"input.paths: directory {p!r} holds no .parquet/.jsonl file")
            files += found
        elif Path(p).is_file():
            files.append(Path(p))
        else:
            raise JobError(f"input.paths: {p!r} does not exist")
    out = []
    for f in dict.fromkeys(files):
        kind = fmt if fmt != "auto" else _EXT_FORMAT.get(os.path.splitext(str(f))[1].lower())
        if kind is None:
            raise JobError(f"input.paths: cannot tell the format of {f} from its extension; "
                           "set input.format to jsonl or parquet")
        out.append((f, kind))
    return out


def source_names(files: list[InputFile]) -> list[str]:
    full = [f.split("://", 1)[1] if isinstance(f, str) else str(f.resolve()) for f in files]
    if len(files) == 1:
        return [os.path.basename(full[0])]
    root = os.path.commonpath(full)
    return [os.path.relpath(f, root) for f in full]


def needed_columns(spec: InputSpec) -> list[str]:
    cols = [spec.id_column, spec.prompt_column, spec.messages_column, spec.input_ids_column, spec.tools_column,
            spec.followups_column,
            *spec.passthrough_columns, *spec.sampling_columns.values()]
    return list(dict.fromkeys(c for c in cols if c))


def _require_columns(path: InputFile, names: list[str], columns: list[str], has: str = "the file has") -> None:
    missing = [c for c in columns if c not in names]
    if missing:
        raise JobError(f"{path}: column(s) {missing} not found; {has} {names}")


@dataclass(frozen=True, slots=True)
class _Holds:
    """What a prompt (or tools) column's values must be: any other kind makes every row an error
    row (plan/rows.py), so an input whose column holds another kind is refused before any work."""

    words: str                            # the values wanted, as the message says them
    arrow: Callable[[pa.DataType], bool]  # a Parquet column of this type holds them
    python: type                          # a JSONL value of this type is one


def _list_of(item: Callable[[pa.DataType], bool]) -> Callable[[pa.DataType], bool]:
    return lambda t: ((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
                      and item(t.value_type))


_OBJECTS = _list_of(lambda t: pa.types.is_struct(t) or pa.types.is_map(t))
_TEXT = _Holds("strings", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)
               or pa.types.is_string_view(t), str)
_MESSAGES = _Holds("lists of {role, content} messages", _OBJECTS, list)
_IDS = _Holds("lists of token ids", _list_of(pa.types.is_integer), list)
_TOOLS = _Holds("lists of tool objects", lambda t: pa.types.is_null(t) or _OBJECTS(t), list)  # null: no tools


def _prompt_columns(spec: InputSpec) -> dict[str, _Holds]:
    wanted = {spec.prompt_column: _TEXT, spec.messages_column: _MESSAGES, spec.input_ids_column: _IDS,
              spec.tools_column: _TOOLS}
    return {column: holds for column, holds in wanted.items() if column}


def _wrong_kind(path: InputFile, column: str, holds: _Holds, found: str, example: object,
                rows: str = "every row") -> JobError:
    text = repr(example)
    shown = "" if example is None else f" (e.g. {text[:60]}{'...' * (len(text) > 60)})"
    json_text = isinstance(example, str) and holds.python is list and example.lstrip().startswith(("[", "{"))
    hint = ": JSON text? Decode each value (json.loads) and write the column as lists" if json_text else ""
    return JobError(f"{path}: column {column!r} holds {found}{shown}, not {holds.words}, so {rows} would be "
                    f"an error row{hint}")


def _check_parquet_kinds(path: InputFile, pf: pq.ParquetFile, wanted: dict[str, _Holds]) -> None:
    for column, holds in wanted.items():
        kind = pf.schema_arrow.field(column).type
        if not holds.arrow(kind.value_type if pa.types.is_dictionary(kind) else kind):  # pandas' categoricals
            first = next(pf.iter_batches(batch_size=SCHEMA_LINES, columns=[column]), None)
            example = next((v for v in first.column(0).to_pylist() if v is not None), None) if first else None
            raise _wrong_kind(path, column, holds, f"{kind} values", example)


def _check_jsonl_kinds(path: InputFile, objects: list[dict], lines: int, wanted: dict[str, _Holds]) -> None:
    """Refused only when no line of the head holds the kind wanted: a few odd rows are error rows."""
    for column, holds in wanted.items():
        values = [d[column] for d in objects if d.get(column) is not None]
        if values and not any(isinstance(v, holds.python) for v in values):
            kinds = "/".join(sorted({type(v).__name__ for v in values}))
            raise _wrong_kind(path, column, holds, f"{kinds} values in each of its first {lines} non-empty "
                              "line(s) that sets it", values[0], "each of those rows")


def _jsonl_record(source: str, index: int, line: bytes) -> Record:
    """One JSONL line; a bad one says why in words (orjson calls a stray byte "surrogates not
    allowed", and counts lines and columns within the line)."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        try:
            line.decode()
        except UnicodeDecodeError as bad:
            why = f"is not valid UTF-8 (byte 0x{line[bad.start]:02x} at position {bad.start})"
        else:
            why = f"is not valid JSON ({e.msg} at position {e.pos})"
        return Record(source, index, None, f"line {index + 1} {why}")
    if not isinstance(data, dict):
        return Record(source, index, None, f"line {index + 1} is JSON {type(data).__name__}, not an object")
    return Record(source, index, data)


def _jsonl_records(source: str, lines: list[tuple[int, bytes]]) -> list[Record]:
    return [_jsonl_record(source, index, line) for index, line in lines]


def _jsonl_batches(path: InputFile, source: str, batch_rows: int) -> Iterator[Callable[[], list[Record]]]:
    batch: list[tuple[int, bytes]] = []
    with _open(path) as f:
        for index, line in enumerate(f):
            if line.strip():
                batch.append((index, line))
                if len(batch) >= batch_rows:
                    yield partial(_jsonl_records, source, batch)
                    batch = []
    if batch:
        yield partial(_jsonl_records, source, batch)


def _parquet_records(source: str, start: int, rb: pa.RecordBatch) -> list[Record]:
    return [Record(source, start + i, row) for i, row in enumerate(rb.to_pylist())]


def _parquet_batches(path: InputFile, source: str, columns: list[str],
                     batch_rows: int) -> Iterator[Callable[[], list[Record]]]:
    with _open(path) as f:
        pf = pq.ParquetFile(f)
        _require_columns(path, pf.schema_arrow.names, columns)
        start = 0
        for rb in pf.iter_batches(batch_size=batch_rows, columns=columns):
            yield partial(_parquet_records, source, start, rb)
            start += rb.num_rows


def read_records(spec: InputSpec, part: tuple[int, int] = (0, 1),
                 files: list[tuple[InputFile, str]] | None = None) -> Iterator[list[Record]]:
    """Input records, batch by batch, file after file (`files`: expand_paths' answer, if known).
    With part=(k, count) only batches k, k + count, k + 2 * count, ... are parsed and returned
    (one worker's share)."""
    files = expand_paths(spec.paths, spec.format) if files is None else files
    names = source_names([f for f, _ in files])
    columns = needed_columns(spec)
    k, count = part
    batches = chain.from_iterable(
        _parquet_batches(path, source, columns, spec.batch_rows) if kind == "parquet"
        else _jsonl_batches(path, source, spec.batch_rows)
        for (path, kind), source in zip(files, names))
    for i, records in enumerate(batches):
        if i % count == k:  # the others are read but never parsed
            yield records()


def _jsonl_head(path: InputFile) -> list[Record]:
    """The first SCHEMA_LINES non-empty lines of a JSONL file, parsed."""
    batches = _jsonl_batches(path, str(path), SCHEMA_LINES)
    try:
        first = next(batches, None)
        return first() if first else []
    finally:
        batches.close()


def check_inputs(spec: InputSpec) -> None:
    """Refuse, before any work, inputs that would stop the run or make every row an error row:
    missing files, files without rows (unless input.allow_empty), files without a column the job
    names, and prompt columns of another kind than the job reads (Parquet: its footer's schema;
    JSONL: its first SCHEMA_LINES non-empty lines). A request line's fields are checked per row
    (io/openai_batch.py)."""
    openai = spec.format == "openai_batch"
    columns, wanted = ([], {}) if openai else (needed_columns(spec), _prompt_columns(spec))
    for path, kind in expand_paths(spec.paths, spec.format):
        if kind == "parquet":
            with _open(path) as f:
                pf = pq.ParquetFile(f)
                _require_columns(path, pf.schema_arrow.names, columns)
                rows = pf.metadata.num_rows
                if rows:
                    _check_parquet_kinds(path, pf, wanted)
        else:
            head = _jsonl_head(path)
            rows = len(head)
            objects = [r.data for r in head if r.data is not None]
            if rows and columns and not objects:
                raise JobError(f"{path}: none of its first {rows} non-empty line(s) is a JSON object "
                               f"({head[0].error}): not a JSONL file of rows?")
            if rows:
                _require_columns(path, list(dict.fromkeys(k for d in objects for k in d)), columns,
                                 f"its first {rows} non-empty line(s) have")
                _check_jsonl_kinds(path, objects, rows, wanted)
        if not rows and not spec.allow_empty:
            raise JobError(f"{path}: no rows ({_why_no_rows(path, kind)}); set input.allow_empty: true if that "
                           "is expected")


def _why_no_rows(path: InputFile, kind: str) -> str:
    """In words: a file of blank lines holds no rows, but it is not empty."""
    if kind == "parquet":
        return "a Parquet file of 0 rows"
    with _open(path) as f:
        return "only blank lines" if f.read(1) else "an empty file"


def duplicate_ids(spec: InputSpec) -> dict:
    """Ids held by more than one input row (input.id_column, or a request line's custom_id),
    found through spill parts (memory bounded by a part): spill.duplicates' answer, each
    example with where its rows are (file#index)."""
    column = "custom_id" if spec.format == "openai_batch" else spec.id_column

    def ids() -> Iterator[pa.Table]:
        for records in read_records(spec):
            found = [(str(v), f"{r.source}#{r.index}") for r in records
                     if isinstance(v := (r.data or {}).get(column), str | int) and not isinstance(v, bool) and v != ""]
            yield pa.table({"row_id": pa.array([i for i, _ in found], pa.string()),
                            "where": pa.array([w for _, w in found], pa.string())})

    return duplicates(ids(), ["row_id"], "where") if column else {"count": 0, "rows": 0, "examples": []}
