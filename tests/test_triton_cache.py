"""The carried Triton cache (benchmarks/triton_cache.py) against the code it was built from, on a
clean clone: the cache itself is not in git, its manifest is. A kernel whose source changed after
the last build would miss on the device (Triton keys a kernel by its source and first line), so
every file of every directory that defines a Triton kernel must hash as the manifest recorded it,
and every module the manifest compiled kernels from must still be there. Rebuild with
`python benchmarks/triton_cache.py build` (in benchmarks/device_twin.sh's venv: docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from benchmarks.carried_cache import MANIFEST, ROOT, kernel_sources

REBUILD = "rebuild the carried Triton cache: python benchmarks/triton_cache.py build (docs/gpu.md)"


def manifest() -> dict:
    return json.loads(MANIFEST.read_text())


def test_the_kernel_sources_are_those_the_cache_was_built_from():
    built, now = manifest()["sources"], kernel_sources()
    assert built, "the manifest records no kernel source"
    changed = sorted(p for p in built.keys() & now.keys() if built[p] != now[p])
    assert not changed, f"{', '.join(changed)} changed since the cache was built: {REBUILD}"
    assert built.keys() == now.keys(), (f"kernel files added {sorted(now.keys() - built.keys())}, gone "
                                        f"{sorted(built.keys() - now.keys())} since the cache was built: {REBUILD}")


def test_every_module_the_cache_compiled_from_is_importable():
    modules = {row["module"] for rows in manifest()["stages"].values() for row in rows}
    assert "dflash_batch.kernels.attn_res" in modules and any(m.startswith("fla.") for m in modules)
    gone = sorted(m for m in modules if not m.startswith("fla.") and importlib.util.find_spec(m) is None)
    assert not gone, f"the cache holds kernels of {gone}, which no longer import: {REBUILD}"


def test_the_cache_is_for_the_carried_fla_and_the_devices_triton():
    m = manifest()
    carried = re.search(r"fla-core==(\S+)", (ROOT / "benchmarks" / "prepare_wheels.sh").read_text())[1]
    assert m["fla"] == carried, f"built with fla {m['fla']}, the check carries {carried}: {REBUILD}"
    assert (m["triton"], m["python"]) == ("3.6.0", "3.12"), "the device runs Triton 3.6.0 on Python 3.12"
    assert m["fla_configs"], "fla's autotuned kernels are pinned"


def test_a_kernel_missing_from_the_carried_cache_is_named(tmp_path, monkeypatch, capsys):
    """The device's cache manager: a kernel or launcher Triton looks for and does not find, or a
    launcher it builds again because the carried one did not load, is one line on stderr and in
    $DFLASH_TRITON_MISSES (then compiled); with $DFLASH_TRITON_STRICT=1, refused. One that is there
    is not named."""
    from benchmarks.carried_cache import CarriedCache, NotCarried

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DFLASH_TRITON_MISSES", str(tmp_path / "misses.txt"))
    cache = CarriedCache("KEY")
    assert cache.get_group("_sample_kernel.json") is None
    assert cache.get_file("__triton_launcher.cpython-312-x86_64-linux-gnu.so") is None
    cache.put_group("_accept_kernel.json", {"_accept_kernel.json": cache.put("{}", "_accept_kernel.json")})
    assert cache.get_group("_accept_kernel.json")
    lines = (tmp_path / "misses.txt").read_text().splitlines()
    assert [line.split(" is not")[0] for line in lines] == [
        "triton cache: kernel _sample_kernel", "triton cache: launcher __triton_launcher.cpython-312-x86_64-linux-gnu.so"]
    assert capsys.readouterr().err.count("not carried") == 2
    cache.put(b"built", "cuda_utils.so")  # a launcher built where there was none: named above, not here
    cache.put(b"built again", "cuda_utils.so")  # the carried one did not load
    assert (tmp_path / "misses.txt").read_text().splitlines()[2].startswith("triton cache: loadable launcher cuda_utils")
    monkeypatch.setenv("DFLASH_TRITON_STRICT", "1")
    with pytest.raises(NotCarried, match="_scatter_kernel"):
        cache.get_group("_scatter_kernel.json")


def test_fla_is_pinned_to_the_manifests_configs(tmp_path, monkeypatch):
    """kernels/kda.py pins each of fla's autotuned chunked kernels to the one config the cache holds;
    a name fla lacks and an unreadable table are errors that name them."""
    from dflash_batch.kernels import kda
    from fla.ops.kda import chunk_kda  # noqa: F401 (loads the kernels chunk_kda runs)

    pinned = manifest()["fla_configs"]
    tuners = kda.autotuned_kernels()
    saved = {name: tuners[name].configs for name in pinned}
    try:
        kda.pin_autotune(pinned)
        for name, c in pinned.items():
            (config,) = tuners[name].configs
            assert (config.kwargs, config.num_warps, config.num_stages) == (c["kwargs"], c["num_warps"], c["num_stages"])
    finally:
        for name, configs in saved.items():
            tuners[name].configs = configs
    with pytest.raises(ValueError, match="not_a_kernel"):
        kda.pin_autotune({"not_a_kernel": next(iter(pinned.values()))})
    (tmp_path / "bad.json").write_text("{}")
    monkeypatch.setenv("DFLASH_FLA_CONFIGS", str(tmp_path / "bad.json"))
    kda._pin_from_env.cache_clear()
    with pytest.raises(ValueError, match="bad.json"):
        kda._pin_from_env()
    kda._pin_from_env.cache_clear()
