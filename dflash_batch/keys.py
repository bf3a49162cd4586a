"""A row's key hash and a shard's identity: what the output ledger (io/) and the row plan (plan/)
both key rows by."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def hash64(text: str) -> int:
    """A stable 64-bit hash of a text (blake2b): the same on every host and Python."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
