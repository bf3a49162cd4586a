"""A decode round's floors on a GPU, and the tokens per second they leave room for.

A round cannot take less than the longest of three times, each a rank's own:
- memory: the bytes it must read from HBM (every dense weight; of the routed experts, those some
  token of the round routes to; every cache, sequences at their bucket's longest) over the peak
  HBM bandwidth;
- compute: the FLOPs of its matmuls and attention (plan/work.py counts them from the engine's own
  round) over the GPU's dense peak for the dtype they run in;
- network: the bytes its collectives move on each link (NVLink inside a domain, the NIC across
  domains) over that link's bandwidth, the longer of the two (they run at once), by ring
  algorithms inside a domain and hierarchical ones across (link_bytes). NCCL may pick others:
  NVLink SHARP (NVLS) on NVSwitch systems reduces in the switch and moves about half a ring
  all-reduce's NVLink bytes, so there the network floor is up to 2x lower.
They are floors, not a prediction: kernels run below their peaks, and where the three overlap
the round takes their maximum, where they do not, up to their sum. Tokens per second per GPU =
sequences x tokens a round yields / the largest floor / GPUs of the group.

A round that verifies k drafts yields 1 + alpha_1 + ... + alpha_k tokens a sequence, alpha_j the
chance that its first j drafts are all accepted: from a finished run's rounds (report.py's alpha),
or from an acceptance length alone (the model card's: alpha_j = p^j, p such that verifying every
draft yields it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_batch.plan.hardware import Hardware

if TYPE_CHECKING:  # the plan's command line reads this module without torch
    from dflash_batch.plan.work import Work

# The model card's acceptance length on MATH-500 (lightseekorg/kimi-k3-dflash2: GSM8K 5.9,
# MATH-500 4.6, AIME and writing 2.8, ~4.8 at 128k).
CARD_ACC_LEN = 4.6


def experts_touched(tokens: int, experts: int, per_token: int) -> float:
    """The expected share of a layer's routed experts that `tokens` tokens route to, each to
    `per_token` of them (routing taken as uniform: a skewed router touches fewer)."""
    return 1.0 - (1.0 - per_token / experts) ** tokens


def memory_read(tokens: int, dense: int, routed: int, caches: int, experts: int = 0, per_token: int = 0) -> int:
    """Bytes a rank reads in a round of `tokens` target rows: its `dense` weight bytes, the touched
    share of its `routed` expert bytes (all of them without `experts`), and its `caches`."""
    share = experts_touched(tokens, experts, per_token) if experts else 1.0
    return dense + int(routed * share) + caches


def link_bytes(collectives: dict[str, int], ranks: int, per_domain: int, groups: int = 1) -> tuple[float, float]:
    """(NVLink, NIC) bytes a GPU moves for these payloads (parallel.tallied's kinds) in a group of
    `ranks` GPUs, `per_domain` to an NVLink domain. Inside a domain of g GPUs a ring all-reduce
    moves 2(g-1)/g of its payload, a reduce-scatter (g-1)/g, an all-gather g-1 payloads; across N
    domains the hierarchical algorithms run the domain part on NVLink and the cross part on each
    GPU's NIC, over its 1/g share: all-reduce 2(N-1)/N of payload/g, reduce-scatter (N-1)/N of it,
    all-gather N-1 payloads (then g-1 of the N gathered on NVLink). The domains are equal: a
    group that does not fill each of its domains is refused. Between `groups` data-parallel groups
    (a domain each, parallel.dispatch and combine), a GPU's NIC carries its share of the rows to
    each other group, groups - 1 payloads, and the reduce-scatter of the sums back, (groups-1)/groups
    of its payload."""
    g = min(ranks, per_domain)
    if ranks % g:
        raise ValueError(f"{ranks} ranks do not fill NVLink domains of {per_domain} GPUs evenly")
    n = ranks // g  # domains
    nvlink = nic = 0.0
    for kind, payload in collectives.items():
        if kind == "all_reduce":
            nvlink += 2 * (g - 1) / g * payload
            nic += 2 * (n - 1) / n * payload / g
        elif kind == "reduce_scatter":
            nvlink += (g - 1) / g * payload
            nic += (n - 1) / n * payload / g
        elif kind == "all_gather":
            nvlink += (g - 1) * n * payload
            nic += (n - 1) * payload
        elif kind == "dispatch":
            nic += (groups - 1) * payload
        elif kind == "combine":
            nic += (groups - 1) / groups * payload
        else:
            raise ValueError(f"a collective of kind {kind!r} has no traffic formula")
    return nvlink, nic


@dataclass(frozen=True)
class Floors:
    """A round's floors, seconds."""

    memory: float
    compute: float
    nvlink: float
    nic: float

    @property
    def network(self) -> float:
        """NVLink and the NIC carry their shares at once (NCCL pipelines a hierarchical collective's
        stages): the longer of the two."""
        return max(self.nvlink, self.nic)

    @property
    def seconds(self) -> float:
        return max(self.memory, self.compute, self.network)

    @property
    def binding(self) -> str:
        return max((("memory", self.memory), ("compute", self.compute), ("network", self.network)),
                   key=lambda kv: kv[1])[0]


def floors(read: int, work: Work, hw: Hardware, dtype: str, ranks: int, per_domain: int, groups: int = 1) -> Floors:
    """A rank's floors for a round that reads `read` bytes and does `work`, on `hw`, the model in
    `dtype`, in a group of `ranks` GPUs `per_domain` to an NVLink domain, one of `groups`
    data-parallel groups."""
    nvlink, nic = link_bytes(work.collectives, ranks, per_domain, groups)
    return Floors(read / (hw.hbm_tbps * 1e12), work.total_flops / hw.peak(dtype),
                  nvlink / (hw.nvlink_gbps * 1e9), nic / (hw.nic_gbps * 1e9))


def card_acceptance(acc_len: float, drafts: int) -> list[float]:
    """alpha_1..alpha_drafts from an acceptance length at every draft verified: alpha_j = p^j with
    1 + p + ... + p^drafts = acc_len (bisection; acc_len in 1 .. drafts + 1)."""
    if not 1 <= acc_len <= drafts + 1:
        raise ValueError(f"an acceptance length of {acc_len} with {drafts} drafts a round: give 1 to {drafts + 1}")
    low, high = 0.0, 1.0
    for _ in range(100):
        p = (low + high) / 2
        low, high = (p, high) if sum(p ** j for j in range(drafts + 1)) < acc_len else (low, p)
    return [low ** j for j in range(1, drafts + 1)]


def expected_tokens(alpha: list[float], k: int) -> float:
    """Tokens a round verifying k drafts yields a sequence: 1 + alpha_1 + ... + alpha_k."""
    return 1.0 + sum(alpha[:k])


def tokens_per_gpu(seqs: int, tokens: float, at: Floors, gpus: int) -> float:
    """The group's tokens a second, a GPU's share: `seqs` sequences yielding `tokens` each a round
    of at.seconds, over `gpus` GPUs."""
    return seqs * tokens / at.seconds / gpus
