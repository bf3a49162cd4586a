"""Inputs named by URL are read through fsspec (here its in-memory filesystem): a glob and a
directory of JSONL and Parquet give exactly the rows the same files give from local disk; a
protocol whose package is missing is refused before any work, naming the package."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dflash_batch.cli import main
from dflash_batch.job import JobError
from dflash_batch.plan.shards import Shard
from dflash_batch.runner import run_job
from tests.fake_engine import fake_factory
from tests.jobs_util import base_job, read_out, write_job, write_jsonl

fsspec = pytest.importorskip("fsspec")


def without_dir(rows: list[dict]) -> list[tuple]:
    return sorted((r["row_id"], r["sample_index"], r["response"], r["status"]) for r in rows)


@pytest.mark.parametrize("where", ["glob", "directory"])
def test_remote_inputs_give_the_local_rows(tmp_path, model_dir, where):
    local = tmp_path / "in"
    local.mkdir()
    write_jsonl(local / "a.jsonl", [{"id": f"j{i}", "prompt": f"hello {i}"} for i in range(7)] + [b"{not json"])
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(9)], "prompt": [f"bye {i}" * (i + 1) for i in range(9)]}),
                   local / "b.parquet", row_group_size=4)
    fs = fsspec.filesystem("memory")
    root = f"/dfb-{where}-{tmp_path.name}"
    for f in local.iterdir():
        fs.pipe(f"{root}/{f.name}", f.read_bytes())
    remote = [f"memory://{root}/*.jsonl", f"memory://{root}/b.parquet"] if where == "glob" else [f"memory://{root}"]
    for name, paths in (("local", [str(local / "a.jsonl"), str(local / "b.parquet")]), ("remote", remote)):
        doc = base_job(model_dir, paths, input={"workers": 0, "batch_rows": 3}, output={"dir": f"out-{name}"})
        run_job(write_job(tmp_path, doc, f"{name}.yaml"), fake_factory(), Shard(0, 1), progress=False)
    got, want = read_out(tmp_path / "out-remote"), read_out(tmp_path / "out-local")
    assert len(want) == 17 and without_dir(got) == without_dir(want)
    # Remote inputs are not counted for status (no fingerprint): the finished run's record decides.
    status = CliRunner().invoke(main, ["status", str(tmp_path / "out-remote")]).output
    assert "1 shard(s), 1 complete" in status, status


@pytest.mark.parametrize("url, package", [("s3://bucket/p.jsonl", "s3fs"), ("gs://bucket/p.jsonl", "gcsfs")])
def test_a_protocol_without_its_package_is_refused(tmp_path, model_dir, url, package):
    pytest.importorskip("fsspec")
    try:
        fsspec.core.url_to_fs(url)
        pytest.skip(f"{package} is installed here")
    except ImportError:
        pass
    doc = base_job(model_dir, [url], input={"workers": 0})
    with pytest.raises(JobError, match=f"input.paths: '{url}': .*{package}"):
        run_job(write_job(tmp_path, doc), fake_factory(), Shard(0, 1), progress=False)
