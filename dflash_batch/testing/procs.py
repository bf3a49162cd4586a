"""Processes read from /proc (Linux): for the worker tests and the data-path and long-prefill
benchmarks."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid`, ascending (so in start order, barring wrap-around)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # it exited meanwhile
    return sorted(out)


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _status_mb(pid: int, field: str) -> float:
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return 0.0


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the process's peak RSS since exec (or reset_peak_rss); 0 once it is gone."""
    return _status_mb(pid, "VmHWM")


def rss_mb(pid: int) -> float:
    """VmRSS: the process's RSS now; 0 once it is gone."""
    return _status_mb(pid, "VmRSS")


def reset_peak_rss() -> None:
    """Start this process's VmHWM again from its RSS now (Linux's clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")
