"""The run's ledger: run.json (what run this directory holds) and what is already committed.

Layout of an output directory:
    run.json                          config hash, shard count, schema version, the job
    data/shard-00003/part-000000.parquet
    stats/shard-00003.json            per-bucket totals, recomputed from committed parts
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_batch import __version__
from dflash_batch.io.card import dataset_card
from dflash_batch.io.fingerprint import identity_changes, run_identity
from dflash_batch.io.outputs import SCHEMA_VERSION, CommitError, atomic_write_bytes
from dflash_batch.io.spill import duplicates
from dflash_batch.job import Job, JobError, is_location, is_tuning
from dflash_batch.keys import Shard, hash64

RAY_INPUT = "<a Ray dataset>"  # a Ray stage's input.paths in run.json (ray.py): `status` knows such a run by it
RAY_IDENTITY = {RAY_INPUT: "ray"}  # what stands for a Ray stage's input files (its run identity, its stats)


def shard_dir(out_dir: Path, index: int) -> Path:
    return out_dir / "data" / f"shard-{index:05d}"


def part_files(out_dir: Path, index: int | None = None) -> list[Path]:
    pattern = f"shard-{index:05d}" if index is not None else "shard-*"
    return sorted((out_dir / "data").glob(f"{pattern}/part-*.parquet"))


def _changed_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed_fields(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def _run_record(job: Job, shard: Shard, job_file: str | None, identity: dict) -> dict:
    return {"config_hash": job.output_hash(identity), "num_shards": shard.count,
            "schema_version": SCHEMA_VERSION, "dflash_batch": __version__,
            "job_file": str(Path(job_file).resolve()) if job_file else None,
            "identity": identity, "job": job.model_dump(mode="json", exclude={"sharding"})}


def check_run(out_dir: Path, job: Job, shard: Shard, inputs: dict[str, str] | None = None) -> str:
    """If run.json exists, check that it describes the same logical run as `job` (read only:
    a job is refused before anything is loaded). Returns the config hash. `inputs`: what stands
    for the input files where the rows come from elsewhere (fingerprint.run_identity)."""
    if job.retry is not None and not Path(job.retry.samples).is_file():
        raise JobError(f"retry.samples: {job.retry.samples} does not exist (dflash-batch retry writes it beside "
                       "the retry's job file)")
    identity = run_identity(job, out_dir, inputs)
    record = _run_record(job, shard, None, identity)
    path = out_dir / "run.json"
    if not path.exists():
        return record["config_hash"]
    try:
        old = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError:
        raise JobError(f"{path} is corrupt; move it away only if the directory holds no parts") from None
    fix = (f"To start a new run, point output.dir (or --output-dir) at a new directory; to continue "
           f"the old one, run it with its original job file (saved in {path}).")
    if old.get("schema_version") != SCHEMA_VERSION:
        raise JobError(f"{out_dir}: written with output schema v{old.get('schema_version')}, this "
                       f"dflash-batch writes v{SCHEMA_VERSION}. {fix}")
    if old.get("num_shards") != shard.count:
        raise JobError(f"{out_dir}: the run uses {old.get('num_shards')} shards, this task says "
                       f"{shard.count}. Every task of one run must use the same shard count. {fix}")
    # A run.json written before runs were hashed by content holds a hash of the paths: such a run
    # resumes where its files were, and keeps its hash.
    legacy = "identity" not in old
    if legacy and old.get("config_hash") == job.output_hash():
        return old["config_hash"]
    if old.get("config_hash") != record["config_hash"]:
        changed = [f for f in _changed_fields(old.get("job", {}), record["job"])
                   if not is_tuning(f) and (legacy or not is_location(f))]
        changed += [] if legacy else identity_changes(old["identity"], identity)
        raise JobError(f"{out_dir}: the job changed since this run started (changed: "
                       f"{', '.join(changed) or 'unknown'}). {fix}")
    return record["config_hash"]


def lock_run(out_dir: Path, job: Job, shard: Shard, job_file: str | None = None,
             inputs: dict[str, str] | None = None) -> str:
    """Write run.json (and the directory's dataset card, io/card.py) if absent, atomically and
    race-free across array tasks, else check that it describes the same logical run. Returns the
    config hash. `job_file` (the path it was run from) is recorded for `status` to print the
    command that finishes the run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # The card first: a directory with run.json has it (load_dataset reads the parts through it).
    _create_once(out_dir / "README.md", dataset_card(job).encode())
    # Fingerprinted now that the directory exists: their cache is saved in it.
    record = _run_record(job, shard, job_file, run_identity(job, out_dir, inputs))
    _create_once(out_dir / "run.json", orjson.dumps(record, option=orjson.OPT_INDENT_2))
    return check_run(out_dir, job, shard, inputs)


def _create_once(path: Path, data: bytes) -> None:
    """Write `path` atomically unless it exists (race-free across array tasks: the first wins)."""
    if path.exists():
        return
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        tmp.write_bytes(data)
        os.link(tmp, path)  # fails if another task created it first
    except FileExistsError:
        pass
    except OSError as e:
        raise CommitError(f"{path}: cannot create it: {e.strerror or e}; nothing was generated. Fix the "
                          "disk (free space, permissions) and rerun the same command") from e
    finally:
        tmp.unlink(missing_ok=True)


def lock_path(out_dir: Path, index: int) -> Path:
    """The file a shard's writer holds locked (`status` asks the kernel whether one does)."""
    return shard_dir(out_dir, index) / ".writer.lock"


@contextmanager
def shard_lock(out_dir: Path, index: int, wait: bool = False) -> Iterator[None]:
    """Hold this shard's writer lock: an OS lock (POSIX, so NFS honours it across nodes) that the
    kernel releases when the process ends, however it ends. A second process on the same shard
    of the same directory is refused instead of interleaving parts with the first; `wait`: it
    waits for the lock instead (writers that hold it only to commit a part, ray.py)."""
    d = shard_dir(out_dir, index)
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path(out_dir, index), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise JobError(f"{d}: shard {index} is being written by another process ({holder}). Two processes on "
                       "one shard would interleave; wait for it or stop it, then rerun (more shards, "
                       "--shard I/N or a Slurm array, run in parallel)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    try:
        yield
    finally:
        os.close(fd)


def key_hash(row_id: str, sample_index: int) -> int:
    return hash64(f"{row_id}\x00{sample_index}")


class DoneSet:
    """(row_id, sample_index) pairs already committed, as a sorted array of 64-bit hashes:
    8 bytes a row instead of a Python tuple's ~100."""

    def __init__(self, hashes: np.ndarray):
        self.hashes = np.unique(hashes.astype(np.uint64))

    def __len__(self) -> int:
        return int(self.hashes.size)

    def __contains__(self, key: tuple[str, int]) -> bool:
        if not self.hashes.size:
            return False
        h = np.uint64(key_hash(*key))
        i = int(np.searchsorted(self.hashes, h))
        return i < self.hashes.size and self.hashes[i] == h


def _key_hashes(files: Iterable[Path]) -> DoneSet:
    chunks = []
    for f in files:
        t = pq.read_table(f, columns=["row_id", "sample_index"])
        chunks.append(np.fromiter((key_hash(r, s) for r, s in zip(t["row_id"].to_pylist(),
                                                                  t["sample_index"].to_pylist())),
                                  dtype=np.uint64, count=t.num_rows))
    return DoneSet(np.concatenate(chunks) if chunks else np.empty(0, np.uint64))


def committed_keys(out_dir: Path, index: int) -> DoneSet:
    return _key_hashes(part_files(out_dir, index))


class Skipped:
    """The keys a retry run does not generate: those committed, and those it was not given."""

    def __init__(self, done: DoneSet, chosen: DoneSet):
        self.done, self.chosen = done, chosen

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self.done or key not in self.chosen


def keys_to_skip(out_dir: Path, index: int, job: Job) -> DoneSet | Skipped:
    """What this shard must not generate: its committed keys; in a retry run (job.retry), also
    every key outside the retry's samples file."""
    done = committed_keys(out_dir, index)
    return done if job.retry is None else Skipped(done, _key_hashes([Path(job.retry.samples)]))


STAT_COLUMNS = ["bucket", "status", "sample_index", "prompt_tokens", "cached_tokens", "completion_tokens",
                "spec_rounds", "spec_accepted", "spec_drafts_verified", "spec_histogram", "spec_block_size"]
VERIFIED = ("spec_drafts_verified", "spec_verified_histogram")  # output schema v2
ADDED = {"cached_tokens": pa.int32()}  # output schema v3: null in older parts (nothing recorded)


def read_part(path: Path, columns: list[str]) -> tuple[pa.Table, bool]:
    """A part's columns, and whether it predates the record of drafts verified (output schema v1):
    such a part's VERIFIED columns are made as if every round verified the whole block, the
    assumption the figures written with it made; a column of ADDED that a part predates is null."""
    names = set(pq.read_schema(path).names)
    old = not all(c in names for c in columns if c in VERIFIED)
    read = [c for c in columns if c in names or c not in (*VERIFIED, *ADDED)]
    t = pq.read_table(path, columns=list(dict.fromkeys(read + (["spec_block_size", "spec_rounds"] if old else []))))
    made = {c: pa.nulls(len(t), ADDED[c]) for c in columns if c in ADDED and c not in names}
    if old:
        drafts = pc.subtract(pc.cast(t["spec_block_size"], pa.int64()), 1)
        rounds = pc.cast(t["spec_rounds"], pa.int64()).fill_null(0)
        made["spec_drafts_verified"] = pc.multiply(drafts, rounds).cast(pa.int32())
        if "spec_verified_histogram" in columns:  # [0, .., 0, rounds]: every round verified block - 1 drafts
            widths = pc.add(drafts, 1).fill_null(0).to_numpy()
            offsets = np.concatenate([[0], np.cumsum(widths)]).astype(np.int32)
            values = np.zeros(int(offsets[-1]), np.int32)
            values[offsets[1:][widths > 0] - 1] = rounds.to_numpy()[widths > 0]
            made["spec_verified_histogram"] = pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(values), mask=pc.is_null(t["spec_block_size"]).combine_chunks())
    if not made:
        return t, old
    return pa.table({c: made[c] if c in made else t[c] for c in columns}), old


def once_a_request(t: pa.Table) -> pa.Array:
    """The rows that count a request's prompt: its sample 0, when ok. Its other samples fork that
    prefill (cached_tokens their whole prompt), so prompt and cached tokens are counted once a
    request, as OpenAI's usage counts them (io/openai_batch.py): the cached share is then what
    shared heads saved, not what n > 1 repeats."""
    return pc.and_(pc.equal(t["status"], "ok"), pc.equal(t["sample_index"], 0))


def count_committed(out_dir: Path) -> tuple[Counter, Counter, dict[str, tuple[int, str]]]:
    """Committed rows per (shard, status) and per (bucket, status) (with, under (bucket,
    "prompt_tokens") and (bucket, "cached_tokens"), those sums once a request), and error rows
    per error_type (their count and a row id), counted part by part with Arrow: memory does not grow with the
    number of rows."""
    by_shard, by_bucket, by_error = Counter(), Counter(), {}
    for f in part_files(out_dir):
        t, _ = read_part(f, ["shard_index", "bucket", "status", "error_type", "row_id", "sample_index",
                             "prompt_tokens", "cached_tokens"])
        for keys, into in ((["shard_index", "status"], by_shard), (["bucket", "status"], by_bucket)):
            for row in t.group_by(keys).aggregate([("status", "count")]).to_pylist():
                into[(row[keys[0]], row["status"])] += row["status_count"]
        counted = t.filter(once_a_request(t)).group_by("bucket")
        for row in counted.aggregate([("prompt_tokens", "sum"), ("cached_tokens", "sum")]).to_pylist():
            for column in ("prompt_tokens", "cached_tokens"):  # (bucket, column): summed once a request
                by_bucket[(row["bucket"], column)] += row[f"{column}_sum"] or 0
        errors = t.filter(pc.equal(t["status"], "error"))
        for row in errors.group_by("error_type").aggregate([("row_id", "count"), ("row_id", "min")]).to_pylist():
            count, example = by_error.get(row["error_type"], (0, row["row_id_min"]))
            by_error[row["error_type"]] = (count + row["row_id_count"], min(example, row["row_id_min"]))
    return by_shard, by_bucket, by_error


def list_sums(lists: pa.ChunkedArray | pa.Array, code: np.ndarray, n: int) -> np.ndarray:
    """[n, width]: row i adds, position by position, the lists of the rows whose code is i
    (histograms summed per bucket or group; a null list adds nothing)."""
    lists = lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists
    lengths = pc.list_value_length(lists).fill_null(0).to_numpy()
    values = pc.list_flatten(lists).to_numpy()
    matrix = np.zeros((n, int(lengths.max(initial=0))), np.int64)
    row_of_value = np.repeat(np.arange(len(lengths)), lengths)
    position = np.arange(len(values)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    np.add.at(matrix, (code[row_of_value], position), values)
    return matrix


def _per_bucket(code: np.ndarray, n: int, column: pa.ChunkedArray) -> list[int]:
    values = column.fill_null(0).to_numpy().astype(np.int64)
    return np.bincount(code, weights=values, minlength=n).astype(np.int64).tolist()


def _bucket_totals(t: pa.Table) -> dict[str, dict]:
    """Raw per-bucket sums of one table's rows (histograms added position by position)."""
    buckets = pc.dictionary_encode(t["bucket"].fill_null("-")).combine_chunks()
    names, code = buckets.dictionary.to_pylist(), buckets.indices.to_numpy()
    n = len(names)
    ok = pc.cast(pc.equal(t["status"], "ok"), pa.int64())
    counted = pc.cast(once_a_request(t), pa.int64())
    sums = {"rows": np.bincount(code, minlength=n).tolist(), "ok": _per_bucket(code, n, ok),
            "prompt_tokens": _per_bucket(code, n, pc.multiply(counted, pc.cast(t["prompt_tokens"], pa.int64()))),
            "cached_tokens": _per_bucket(code, n, pc.multiply(counted, pc.cast(t["cached_tokens"], pa.int64()))),
            "completion_tokens": _per_bucket(code, n, t["completion_tokens"]),
            "spec_rounds": _per_bucket(code, n, t["spec_rounds"]),
            "spec_accepted": _per_bucket(code, n, t["spec_accepted"]),
            "spec_drafts_verified": _per_bucket(code, n, t["spec_drafts_verified"]),
            # ok rows decoded with the drafter (an auto bucket that turned it off has fewer)
            "speculated": _per_bucket(code, n, pc.multiply(ok, pc.is_valid(t["spec_block_size"]).cast(pa.int64())))}
    matrix = list_sums(t["spec_histogram"], code, n)
    return {name: {**{k: v[i] for k, v in sums.items()}, "spec_histogram": matrix[i].tolist()}
            for i, name in enumerate(names)}


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def _merge(into: dict[str, dict], more: dict[str, dict]) -> None:
    for name, b in more.items():
        if name not in into:
            into[name] = b
            continue
        a = into[name]
        for k, v in b.items():
            a[k] = _add_lists(a[k], v) if k == "spec_histogram" else a[k] + v


def _with_ratios(totals: dict[str, dict]) -> dict[str, dict]:
    """Per-bucket totals with their ratios: acceptance as ratios of sums, never means of per-row
    ratios."""
    for b in totals.values():
        b["error"] = b["rows"] - b["ok"]
        b["acc_len"] = 1 + b["spec_accepted"] / b["spec_rounds"] if b["spec_rounds"] else None
        b["proposal_acceptance"] = b["spec_accepted"] / b["spec_drafts_verified"] if b["spec_drafts_verified"] else None
        b["speculation"] = speculation(b["speculated"], b["ok"])
        b["cached_share"] = b["cached_tokens"] / b["prompt_tokens"] if b["prompt_tokens"] else None
    return totals


def speculation(speculated: int, ok: int) -> str:
    """How a bucket's ok rows were decoded: on (all with the drafter), off (none), or
    "on for k/n" (an auto bucket that turned speculation off part way)."""
    return "off" if not speculated else "on" if speculated == ok else f"on for {speculated}/{ok}"


def write_shard_stats(out_dir: Path, index: int, complete: bool, inputs: dict | None = None,
                      count: bool = True, schedule: dict | None = None, experts: dict | None = None) -> dict[str, dict]:
    """Per-bucket totals of the shard's committed parts, whether its run got through all of its
    input (`inputs`: the fingerprint of the files it read), and, once it has, the keys committed
    more than once (`status` reads both): two input rows with one id. A row id always falls in
    the same shard, so a shard's check is the run's. `count` False: the record without the
    totals, which read every part (a preempted task has seconds before SIGKILL). `schedule`: by
    bucket, the speculation schedule this process ran (engine/schedule.py; a resumed shard's is
    its last run's). `experts`: this run's routing (its counts, the ranks' loads, the forwards an
    expert-parallel group served for the others with no rows of its own; runner.expert_stats)."""
    files = part_files(out_dir, index) if count or complete else []
    keys, totals = ["row_id", "sample_index"], {}

    def parts() -> Iterator[pa.Table]:  # each part read once: its totals, then its keys
        for f in files:
            t, _ = read_part(f, STAT_COLUMNS + keys)
            _merge(totals, _bucket_totals(t))
            yield t.select(keys)

    record = {"shard": index, "complete": complete, "inputs": inputs}
    if schedule:
        record["schedule"] = schedule
    if experts:
        record["experts"] = experts
    if complete:
        record["duplicate_keys"] = duplicates(parts(), keys, spill_dir=out_dir)
    elif count:
        for _ in parts():
            pass
    stats = record["buckets"] = _with_ratios(totals)
    if count:
        record["rows"] = _rows(files)
    (out_dir / "stats").mkdir(exist_ok=True)
    atomic_write_bytes(out_dir / "stats" / f"shard-{index:05d}.json", orjson.dumps(record, option=orjson.OPT_INDENT_2))
    return stats


def duplicate_keys(out_dir: Path, num_shards: int) -> dict[int, dict]:
    """Per finished shard with duplicate keys, what write_shard_stats found."""
    out = {}
    for i in range(num_shards):
        path = out_dir / "stats" / f"shard-{i:05d}.json"
        found = orjson.loads(path.read_bytes()).get("duplicate_keys") if path.exists() else None
        if found and found["count"]:
            out[i] = found
    return out


def _rows(files: list[Path]) -> int:
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def shard_finished(out_dir: Path, index: int, inputs: dict | None) -> bool:
    """Whether this shard's run already got through all of these very input files and its parts
    are still all there (a rerun would find nothing to do)."""
    path = out_dir / "stats" / f"shard-{index:05d}.json"
    if inputs is None or not path.exists():
        return False
    record = orjson.loads(path.read_bytes())
    return (bool(record.get("complete")) and record.get("inputs") == inputs
            and record.get("rows") == _rows(part_files(out_dir, index)))


def shard_states(out_dir: Path, num_shards: int) -> list[str]:
    """Each shard's state from its stats file: complete (and its parts still the rows it
    counted then), incomplete (stopped before the end of its input: preempted, killed, failed;
    or parts committed since: a Ray pipeline's rows after it was marked finished) or not started."""
    states = []
    for i in range(num_shards):
        path = out_dir / "stats" / f"shard-{i:05d}.json"
        if path.exists():
            record = orjson.loads(path.read_bytes())
            whole = record.get("complete") and record.get("rows") == _rows(part_files(out_dir, i))
            states.append("complete" if whole else "incomplete")
        else:
            states.append("incomplete" if part_files(out_dir, i) else "not started")
    return states


def unfinished_shards(out_dir: Path, num_shards: int) -> list[int]:
    """The shards of a run whose runs have not got through their input (or a Ray pipeline's
    output not marked finished, ray.finish): what export and retry refuse to take as whole."""
    return [i for i, s in enumerate(shard_states(out_dir, num_shards)) if s != "complete"]


def array_spec(indices: list[int]) -> str:
    """Slurm's --array syntax for these task ids: 1,3,5-7."""
    out, i = [], 0
    while i < len(indices):
        j = i
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        out.append(str(indices[i]) if i == j else f"{indices[i]}-{indices[j]}")
        i = j + 1
    return ",".join(out)
