"""`dflash-batch export OUT_DIR DEST`: a push-ready Hugging Face dataset, or an OpenAI Batch API
output file, from a run's parts and those of the runs it retries (`dflash-batch retry`).

The committed rows are streamed (one part in memory at a time) into split files named by the
Hub's convention, `data/train-00000-of-0000N.parquet`, beside a dataset card with the job, the
model, the sampling and the acceptance summary. A retry's rows replace its parent's, and an
OpenAI line gathers the samples of one request: both regroup rows by id through spill parts
(io/spill.py), so memory stays bounded by a part. `messages`: an SFT column, the prompt's chat (a
passthrough column holding messages, or a text column as one user turn) followed by the
assistant's turn, its reasoning as `reasoning_content` where the run split it.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import groupby
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_batch.io.card import dataset_card
from dflash_batch.io.ledger import array_spec, once_a_request, part_files, unfinished_shards
from dflash_batch.io.openai_batch import CHAT_URL, COMPLETIONS_URL, RequestError, response_line
from dflash_batch.io.spill import by_key
from dflash_batch.job import Job, JobError
from dflash_batch.tokenizer import Tokenizer

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
# A run of conversations: its messages may call tools and answer them.
TOOL_CALL = pa.struct([("id", pa.string()), ("type", pa.string()),
                       ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
CONVERSATION_MESSAGE = pa.struct([*MESSAGE, ("tool_calls", pa.list_(TOOL_CALL)), ("tool_call_id", pa.string())])


def lineage(out_dir: Path) -> list[tuple[Path, dict]]:
    """(directory, run.json) of a run and of the runs it retries, the first run first."""
    chain: list[tuple[Path, dict]] = []
    expected = None
    while out_dir is not None:
        run_file = out_dir / "run.json"
        if not run_file.exists():
            raise JobError(f"{out_dir}: no run.json; not a dflash-batch output directory")
        record = orjson.loads(run_file.read_bytes())
        if expected is not None and record["config_hash"] != expected:
            raise JobError(f"{out_dir}: its config_hash is {record['config_hash']}, but the retry "
                           f"{chain[-1][0]} was made from {expected}: not the run it retries")
        chain.append((out_dir, record))
        retry = record["job"].get("retry")
        out_dir, expected = (Path(retry["parent"]), retry["parent_hash"]) if retry else (None, None)
        if len(chain) > 1000:
            raise JobError(f"{chain[0][0]}: its retries' parents form a loop")
    return chain[::-1]


def unfinished(chain: list[tuple[Path, dict]], partial: bool) -> str:
    """Refuse a run (or a run it retries) with shards not finished, unless `partial`; then the
    line a card says it with ("" when every shard is finished)."""
    gaps = [(d, todo, record["num_shards"]) for d, record in chain
            if (todo := unfinished_shards(d, record["num_shards"]))]
    if not gaps:
        return ""
    where = "; ".join(f"{d}: shard(s) {array_spec(todo)} of {count}" for d, todo, count in gaps)
    if not partial:
        raise JobError(f"not finished ({where}): finish the run (`dflash-batch status {gaps[0][0]}` says how), "
                       "or export the rows committed so far with --partial")
    return (f"\n**Partial**: exported before the run finished ({where} had not): these are the rows committed "
            "by then, not the run's whole output.\n")


def _bytes(path: Path) -> int:
    """A Parquet file's rows' size in memory (uncompressed), from its footer."""
    meta = pq.ParquetFile(path).metadata
    return sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))


def _merged_schema(paths: list[Path]) -> pa.Schema:
    """The parts' columns. A column whose types do not unify (a passthrough column the writer
    kept as JSON text in some parts, outputs.py) is read as text in all of them."""
    fields: dict[str, list[pa.Field]] = {}
    for p in paths:
        for f in pq.read_schema(p).remove_metadata():
            fields.setdefault(f.name, []).append(f)
    out = []
    for name, found in fields.items():
        try:
            typ = pa.unify_schemas([pa.schema([f]) for f in found], promote_options="permissive").field(0).type
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            typ = pa.string()
        out.append(pa.field(name, typ))
    return pa.schema(out)


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` in `schema`'s columns and order; a column it lacks comes out null."""
    arrays = []
    for f in schema:
        if f.name not in table.column_names:
            arrays.append(pa.nulls(table.num_rows, f.type))
            continue
        column = table[f.name]
        if f.type == pa.string() and not pa.types.is_string(column.type):  # JSON text, as outputs.py writes mixed values
            column = pa.array([None if v is None else orjson.dumps(v).decode() for v in column.to_pylist()], pa.string())
        arrays.append(column.cast(f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def merged_rows(chain: list[tuple[Path, dict]], grouped: bool, columns: list[str] | None = None,
                spill_dir: Path | None = None) -> Iterator[pa.Table]:
    """The rows of a run and its retries, each (row_id, sample_index) once: the latest run's
    row, unless it is an error and an earlier run's is not (a retry that failed where its parent
    had a partial answer keeps the answer). Streamed part by part when there is nothing to merge
    or group; else in spill parts by row_id (the samples of a row together, sorted), memory
    bounded by a part. `columns`: only these (default all)."""
    parts = [(gen, p) for gen, (d, _) in enumerate(chain) for p in part_files(d)]
    if len(chain) == 1 and not grouped:
        for _, p in parts:
            yield pq.read_table(p, columns=columns)
        return
    schema = _merged_schema([p for _, p in parts])
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in dict.fromkeys(["row_id", "sample_index", "status", *columns])])
    schema = schema.append(pa.field("_rank", pa.int64()))

    def tagged(gen: int, path: Path) -> pa.Table:
        table = pq.read_table(path, columns=[c for c in schema.names if c in pq.read_schema(path).names])
        rank = pc.subtract(pc.multiply(pc.cast(pc.not_equal(table["status"], "ok"), pa.int64()), 1 << 32), gen)
        return _conform(table.append_column("_rank", rank), schema)

    for table in by_key((tagged(gen, p) for gen, p in parts), "row_id", sum(_bytes(p) for _, p in parts), spill_dir):
        table = table.sort_by([("row_id", "ascending"), ("sample_index", "ascending"), ("_rank", "ascending")])
        ids, samples = table["row_id"].to_numpy(zero_copy_only=False), table["sample_index"].to_numpy()
        first = np.ones(table.num_rows, bool)  # each key's winner sorts first
        first[1:] = (ids[1:] != ids[:-1]) | (samples[1:] != samples[:-1])
        table = table.filter(pa.array(first)).drop_columns(["_rank"])
        yield table if columns is None else table.select(columns)


def _retry_line(index: int, record: dict) -> str:
    """A retry in the chain and the settings it changed: its rows replace its parent's, so the
    card must not claim the first run's settings for them."""
    changes = ", ".join(f"{k} {v}" for k, v in record["job"]["retry"]["changes"].items()) or "no setting changed"
    return f"- retry {index} (its rows replace those of the run before it): {changes}\n"


def export_dataset(out_dir: Path, dest: Path, rows_per_file: int = 100_000, messages: str | None = None,
                   partial: bool = False) -> int:
    """Write the dataset (a run's rows merged with its retries'); returns the rows written.
    `partial`: of a run not finished yet, the rows committed so far (the card says so)."""
    chain = lineage(out_dir)
    partial_line = unfinished(chain, partial)
    job = Job.model_validate(chain[0][1]["job"])  # the card's settings: the first run's, then each retry's changes
    total = sum(pq.ParquetFile(p).metadata.num_rows for d, _ in chain for p in part_files(d))  # an upper bound
    files = max(1, -(-total // rows_per_file))
    (dest / "data").mkdir(parents=True, exist_ok=True)
    if any((dest / "data").iterdir()):
        raise JobError(f"{dest / 'data'} is not empty: export into a new directory")
    writer, index, in_file, written, names = None, 0, 0, 0, []
    ok = rounds = accepted = verified = 0
    prompted = cached = 0  # prompt tokens once a request, and of them those cached (the stats' basis)
    unrecorded = False  # some rows predate the record of cached tokens (output schema v3)
    whole_block = False  # some rows predate the record of drafts verified (output schema v1)
    spans: dict[str, tuple[int, int]] = {}  # column -> (min, max) over the rows written
    for table in merged_rows(chain, grouped=False, spill_dir=dest):
        if messages is not None:
            table = table.append_column("messages", _messages(table, messages))
        ok += pc.sum(pc.equal(table["status"], "ok")).as_py() or 0
        rounds += pc.sum(table["spec_rounds"]).as_py() or 0
        accepted += pc.sum(table["spec_accepted"]).as_py() or 0
        assumed = pc.multiply(pc.subtract(pc.cast(table["spec_block_size"], pa.int64()), 1), table["spec_rounds"])
        if "spec_drafts_verified" in table.column_names:
            recorded = pc.cast(table["spec_drafts_verified"], pa.int64())
            whole_block |= bool(pc.any(pc.and_(pc.is_null(recorded), pc.is_valid(assumed))).as_py())
            assumed = pc.coalesce(recorded, assumed)
        else:
            whole_block |= bool(pc.any(pc.is_valid(assumed)).as_py())
        verified += pc.sum(assumed).as_py() or 0
        counted = table.filter(once_a_request(table))
        prompted += pc.sum(counted["prompt_tokens"]).as_py() or 0
        took = counted["cached_tokens"] if "cached_tokens" in counted.column_names else pa.nulls(counted.num_rows)
        cached += pc.sum(took).as_py() or 0
        unrecorded |= took.null_count > 0
        for column in ("prompt_tokens", "completion_tokens"):
            lo, hi = pc.min_max(table[column]).values()
            if lo.is_valid:
                old = spans.get(column, (lo.as_py(), hi.as_py()))
                spans[column] = (min(old[0], lo.as_py()), max(old[1], hi.as_py()))
        while table.num_rows:
            if writer is None:
                names.append(dest / "data" / f"train-{index:05d}-of-{files:05d}.parquet")
                writer = pq.ParquetWriter(names[-1], table.schema)
            take = table.slice(0, rows_per_file - in_file)
            writer.write_table(take)
            table, in_file, written = table.slice(take.num_rows), in_file + take.num_rows, written + take.num_rows
            if in_file == rows_per_file:
                writer.close()
                writer, index, in_file = None, index + 1, 0
    if writer is not None:
        writer.close()
    for name in names:  # merged retries replace rows: fewer files than the bound, renamed to say so
        name.rename(name.with_name(name.name.replace(f"-of-{files:05d}", f"-of-{len(names):05d}")))
    acc = f"{1 + accepted / rounds:.2f}" if rounds else "n/a (no speculation)"
    if verified:
        acc += (f", proposal acceptance (accepted / drafts verified, pooled) {accepted / verified:.3f}"
                + (" (rows written before outputs recorded the drafts verified count every round as verifying "
                   "the whole block)" if whole_block else ""))
    ranges = "; ".join(f"{c.replace('_', ' ')} {lo}-{hi}" for c, (lo, hi) in spans.items())
    summary = (f"- rows: {ranges}\n" if ranges else "") + "".join(_retry_line(i, record) for i, (_, record) in enumerate(chain) if i)
    summary += _cached_line(prompted, cached, unrecorded)
    summary += (f"\n{written} rows: {ok} ok, {written - ok} error; acceptance length (1 + accepted / rounds, "
                f"pooled) {acc}.\n") + partial_line
    (dest / "README.md").write_text(dataset_card(job, "data/train-*.parquet", summary))
    return written


def _cached_line(prompted: int, cached: int, unrecorded: bool) -> str:
    """The card's cached share, on the basis of the run's tables and the OpenAI export's usage."""
    if not prompted:
        return ""
    share = f"{cached} ({cached / prompted:.0%})" + (" (rows written before outputs recorded cached tokens count "
                                                       "none)" if unrecorded else "")
    return (f"- prompt tokens, each request's once (its sample 0): {prompted}; of them cached, taken from a head "
            f"another request computed (engine.share_prompts): {share}\n")


def export_openai_batch(out_dir: Path, dest: Path, partial: bool = False) -> int:
    """Write one OpenAI Batch API output line per request (a run's rows merged with its
    retries'); returns the lines written. `partial`: as export_dataset's."""
    chain = lineage(out_dir)
    unfinished(chain, partial)
    job = Job.model_validate(chain[-1][1]["job"])
    if dest.exists():
        raise JobError(f"{dest} exists: export into a new file")
    default_url = CHAT_URL if job.input.messages_column or job.input.format == "openai_batch" else COMPLETIONS_URL
    created = int((chain[-1][0] / "run.json").stat().st_mtime)
    tokenizer = None

    def token(t: int) -> tuple[str, bytes]:
        nonlocal tokenizer
        if tokenizer is None:  # only for logprobs
            tokenizer = Tokenizer(job.model.tokenizer or job.model.target, job.model.chat_template)
        return tokenizer.decode([t]), tokenizer.token_bytes(t)

    lines = 0
    tmp = dest.with_name(f".{dest.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            for table in merged_rows(chain, grouped=True, spill_dir=dest.parent):
                rows = (row for batch in table.to_batches(1024) for row in batch.to_pylist())
                for _, samples in groupby(rows, key=lambda r: r["row_id"]):
                    f.write(response_line(list(samples), default_url, Path(job.model.target).name, created, token))
                    lines += 1
    except RequestError as e:
        tmp.unlink()
        raise JobError(f"{out_dir}: {e}") from None
    tmp.rename(dest)
    return lines


def _messages(table: pa.Table, column: str) -> pa.Array:
    if column not in table.column_names:
        raise JobError(f"--messages {column}: no such output column (pass the input's messages or prompt "
                       "through input.passthrough_columns)")
    def of(name: str) -> list:
        return table[name].to_pylist() if name in table.column_names else [None] * table.num_rows

    out = []
    for prompt, response, thought, talk in zip(table[column].to_pylist(), table["response"].to_pylist(),
                                               of("reasoning"), of("conversation")):
        if talk is not None:  # a conversation: every turn (the last one's reasoning split off, if it was)
            turns = [{k: m.get(k) for k in CONVERSATION_MESSAGE.names} for m in orjson.loads(talk)]
            turns[-1].update(content=response, reasoning_content=thought)
            out.append(turns)
            continue
        if isinstance(prompt, str):  # a text prompt: one user turn
            turns = [{"role": "user", "content": prompt}]
        else:  # chat messages (any keys past role and content are not kept)
            turns = [{"role": t.get("role"), "content": t.get("content")} for t in prompt or []]
        out.append(turns + [{"role": "assistant", "content": response, "reasoning_content": thought}])
    return pa.array(out, pa.list_(CONVERSATION_MESSAGE if "conversation" in table.column_names else MESSAGE))
