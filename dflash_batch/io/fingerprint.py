"""What a run computes from, by content: the models and inputs its job's paths name.

A run is identified by these files, not by where they lie, so the same job and output moved to
another directory, or read through another mount on a Slurm node, is the same run, and a weight
or input whose bytes changed is not (io/ledger.py refuses it, naming the file). A file's
fingerprint is a blake2b of its size and of 1 MiB at each of 8 evenly spaced offsets, the first
and last MiB among them (the whole file when it is smaller): a checkpoint of terabytes is not
read again, at the price of missing a change confined between those samples that keeps the size.
Fingerprints are kept in OUT_DIR/fingerprints.json by (path, size, mtime), so a resume or another
array task reads no file that has not changed since.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import orjson

from dflash_batch.io.inputs import expand_paths, source_names
from dflash_batch.job import LOCATIONS, Job

SAMPLE = 1 << 20
SAMPLES = 8
CACHE_FILE = "fingerprints.json"
# What checkpoints and tokenizers are read from (models/loader.py, tokenizer.py): a README
# or a licence beside them changes no output.
MODEL_FILES = (".json", ".safetensors", ".model", ".jinja")

_computed: dict[str, list] = {}  # this process's fingerprints, for a cache file not written yet


def _digest(path: Path, size: int) -> str:
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        if size <= SAMPLE * SAMPLES:
            h.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek((size - SAMPLE) * i // (SAMPLES - 1))
                h.update(f.read(SAMPLE))
    return h.hexdigest()


class Fingerprints:
    """File fingerprints by (absolute path, size, mtime), read from and saved to a run's cache."""

    def __init__(self, out_dir: Path):
        self.file = out_dir / CACHE_FILE
        try:
            saved = orjson.loads(self.file.read_bytes())
        except (OSError, orjson.JSONDecodeError):  # absent, or torn by a crash: computed again
            saved = {}
        self.known = {**saved, **_computed}
        self.unsaved = {key for key, entry in _computed.items() if saved.get(key) != entry}

    def of(self, path: Path) -> str:
        st, key = path.stat(), str(path.resolve())
        entry = self.known.get(key)
        if entry is None or entry[:2] != [st.st_size, st.st_mtime_ns]:
            entry = _computed[key] = self.known[key] = [st.st_size, st.st_mtime_ns, _digest(path, st.st_size)]
            self.unsaved.add(key)
        return entry[2]

    def save(self) -> None:
        """Write the cache if it gained entries and the run's directory exists (it is made only
        once the checkpoints load). Array tasks may race: the last one wins, and an entry lost
        is only computed again; so is a cache that could not be written (a full disk stops the
        run at its next part, with the message that says so)."""
        if not self.unsaved or not self.file.parent.is_dir():
            return
        tmp = self.file.with_name(f".{CACHE_FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(orjson.dumps(self.known))
            os.rename(tmp, self.file)
        except OSError:
            tmp.unlink(missing_ok=True)
            return
        self.unsaved = set()


def _files(location: str, prints: Fingerprints) -> dict[str, str]:
    """A checkpoint or tokenizer directory's files, or one file (a chat template), by name. A
    URL is its own identity (its bytes are not read here); a path that is not there has none."""
    if "://" in location:
        return {location: "url"}
    path = Path(location)
    if path.is_file():
        return {path.name: prints.of(path)}
    if not path.is_dir():
        return {}
    return {f.name: prints.of(f) for f in sorted(path.iterdir())
            if f.suffix in MODEL_FILES and not f.name.startswith(".") and f.is_file()}


def run_identity(job: Job, out_dir: Path, inputs: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """Per job field that names files (job.LOCATIONS), each file's fingerprint by name: for the
    inputs the names rows are read under (row ids without an id column derive from them).
    `inputs`: what stands for the input files where rows do not come from them (a Ray stage's)."""
    prints = Fingerprints(out_dir)
    identity = {f"model.{field}": _files(value, prints) for field in sorted(LOCATIONS["model"])
                if (value := getattr(job.model, field)) is not None}
    identity["input.paths"] = _inputs(job, prints) if inputs is None else inputs
    prints.save()
    return identity


def _inputs(job: Job, prints: Fingerprints) -> dict[str, str]:
    files = [f for f, _ in expand_paths(job.input.paths, job.input.format)]
    return {(f if isinstance(f, str) else name): ("url" if isinstance(f, str) else prints.of(f))
            for f, name in zip(files, source_names(files))}


def input_identity(job: Job, out_dir: Path) -> dict[str, str] | None:
    """The input files by content, as the run identity has them: a shard that got through them
    got through them wherever they now lie. None when an input is remote: nothing cheap says
    whether it changed, so a shard reading one is never taken as finished."""
    prints = Fingerprints(out_dir)
    inputs = _inputs(job, prints)
    prints.save()
    return None if "url" in inputs.values() else inputs


def identity_changes(old: dict[str, dict[str, str]], new: dict[str, dict[str, str]]) -> list[str]:
    """What differs between two run identities, naming the files: `model.target: model-00001.safetensors
    differs`."""
    out = []
    for field in sorted(set(old) | set(new)):
        a, b = old.get(field), new.get(field)
        if a is None or b is None:
            out.append(f"{field} {'added' if a is None else 'removed'}")
            continue
        files = [f"{name} {'differs' if name in a and name in b else 'missing' if name in a else 'added'}"
                 for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
        if files:
            out.append(f"{field}: {', '.join(files)}")
    return out
