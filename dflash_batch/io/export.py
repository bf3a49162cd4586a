"""`dflash-batch export OUT_DIR DEST`: a push-ready Hugging Face dataset from a run's parts.

The committed rows are streamed (one part in memory at a time) into split files named by the
Hub's convention, `data/train-00000-of-0000N.parquet`, beside a dataset card with the job, the
model, the sampling and the acceptance summary. `messages`: an SFT column, the prompt's chat (a
passthrough column holding messages, or a text column as one user turn) followed by the
assistant's turn, its reasoning as `reasoning_content` where the run split it.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_batch.io.card import dataset_card
from dflash_batch.io.ledger import part_files
from dflash_batch.job import Job, JobError

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])


def export_dataset(out_dir: Path, dest: Path, rows_per_file: int = 100_000, messages: str | None = None) -> int:
    """Write the dataset; returns the rows written."""
    run_file = out_dir / "run.json"
    if not run_file.exists():
        raise JobError(f"{out_dir}: no run.json; not a dflash-batch output directory")
    job = Job.model_validate(orjson.loads(run_file.read_bytes())["job"])
    parts = part_files(out_dir)
    total = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
    files = max(1, -(-total // rows_per_file))
    (dest / "data").mkdir(parents=True, exist_ok=True)
    if any((dest / "data").iterdir()):
        raise JobError(f"{dest / 'data'} is not empty: export into a new directory")
    writer, index, in_file, written = None, 0, 0, 0
    ok = rounds = accepted = 0
    for part in parts:
        table = pq.read_table(part)
        if messages is not None:
            table = table.append_column("messages", _messages(table, messages, part))
        ok += pc.sum(pc.equal(table["status"], "ok")).as_py() or 0
        rounds += pc.sum(table["spec_rounds"]).as_py() or 0
        accepted += pc.sum(table["spec_accepted"]).as_py() or 0
        while table.num_rows:
            if writer is None:
                writer = pq.ParquetWriter(dest / "data" / f"train-{index:05d}-of-{files:05d}.parquet", table.schema)
            take = table.slice(0, rows_per_file - in_file)
            writer.write_table(take)
            table, in_file, written = table.slice(take.num_rows), in_file + take.num_rows, written + take.num_rows
            if in_file == rows_per_file:
                writer.close()
                writer, index, in_file = None, index + 1, 0
    if writer is not None:
        writer.close()
    acc = f"{1 + accepted / rounds:.2f}" if rounds else "n/a (no speculation)"
    summary = (f"\n{written} rows: {ok} ok, {written - ok} error; acceptance length (1 + accepted / rounds, "
               f"pooled) {acc}. Exported from `{out_dir.resolve()}`.\n")
    (dest / "README.md").write_text(dataset_card(job, "data/train-*.parquet", summary))
    return written


def _messages(table: pa.Table, column: str, part: Path) -> pa.Array:
    if column not in table.column_names:
        raise JobError(f"--messages {column}: no such column in {part} (pass the input's messages or prompt "
                       "through input.passthrough_columns)")
    reasoning = table["reasoning"].to_pylist() if "reasoning" in table.column_names else [None] * table.num_rows
    out = []
    for prompt, response, thought in zip(table[column].to_pylist(), table["response"].to_pylist(), reasoning):
        if isinstance(prompt, str):  # a text prompt: one user turn
            turns = [{"role": "user", "content": prompt}]
        else:  # chat messages (any keys past role and content are not kept)
            turns = [{"role": t.get("role"), "content": t.get("content")} for t in prompt or []]
        out.append(turns + [{"role": "assistant", "content": response, "reasoning_content": thought}])
    return pa.array(out, pa.list_(MESSAGE))
