"""Modeled time of `nki.collectives` calls: per call, the faster of a ring and a one-hop mesh over NeuronLink
(chip to chip) and the path between ranks on one chip, priced from AWS's architecture guides, with explicit
parameters where they give no figure (hop latency, the on-chip link). docs/emulator.md ("Collective costs") cites
the sources and spells out the placement, the link and the algorithm rules.
"""

from __future__ import annotations

import dataclasses
import math

from nki_kernels import hardware

from . import trace

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute")

# [INTRA] "about 1-2 us" per hop: benchmarks sweep the documented range; the default is its middle.
HOP_LATENCY_SWEEP_US = (1.0, 2.0)
DEFAULT_HOP_LATENCY_US = 1.5


@dataclasses.dataclass(frozen=True)
class Links:
    """Link figures of one target, in bytes/ns (= GB/s) and µs."""

    target: str
    ranks_per_chip: int
    chips_per_instance: int
    chip_link_bytes_per_ns: float  # documented NeuronLink bandwidth per chip, both directions summed
    core_link_bytes_per_ns: float  # between two ranks of one chip (a parameter: no documented figure)
    hop_latency_us: float

    @property
    def chip_egress_bytes_per_ns(self) -> float:
        return self.chip_link_bytes_per_ns / 2

    @property
    def max_ranks(self) -> int:
        return self.ranks_per_chip * self.chips_per_instance


# Documented per target: (physical NeuronCores per chip, ranks per chip by default, chips per instance,
# NeuronLink GB/s per chip inside an instance).
_CHIPS = {
    "trn1": (2, 2, 16, 384.0),  # [TRN2CHIP] Trainium 384 GB/s/chip; [TRN1ARCH] 2 cores, 16 chips
    "trn2": (8, 4, 16, 1024.0),  # [TRN2ARCH] 1,024 GB/s/chip intra-instance; [CC] LNC=2: 4 ranks per chip
}


def physical_cores(target: str) -> int:
    """NeuronCores per chip ([TRN1ARCH] 2, [TRN2CHIP] 8)."""
    hardware.check_target(target)
    return _CHIPS[target][0]


def make_links(target, core_link_bytes_per_ns, hop_latency_us=DEFAULT_HOP_LATENCY_US, ranks_per_chip=None) -> Links:
    """The Links of `target` with the figures the docs leave open given explicitly (cost_model.collective_links
    fills in the default on-chip link from the per-core DMA figures)."""
    hardware.check_target(target)
    cores, default_ranks, chips, chip_link = _CHIPS[target]
    ranks_per_chip = default_ranks if ranks_per_chip is None else int(ranks_per_chip)
    if ranks_per_chip < 1 or cores % ranks_per_chip:
        raise ValueError(f"ranks_per_chip: got {ranks_per_chip}, expected a divisor of the {cores} cores of a chip")
    if not (isinstance(hop_latency_us, (int, float)) and math.isfinite(hop_latency_us) and hop_latency_us >= 0):
        raise ValueError(f"hop_latency_us: got {hop_latency_us!r}, expected a finite number of µs >= 0")
    if not (isinstance(core_link_bytes_per_ns, (int, float)) and core_link_bytes_per_ns > 0):
        raise ValueError(f"core link: got {core_link_bytes_per_ns!r}, expected a positive GB/s")
    return Links(target, ranks_per_chip, chips, chip_link, float(core_link_bytes_per_ns), float(hop_latency_us))


def _check(kind, nbytes, group_size, lk):
    if kind not in KINDS:
        raise ValueError(f"kind: got {kind!r}, expected one of {KINDS}")
    if nbytes < 0 or group_size < 1:
        raise ValueError(f"nbytes, group_size: got {nbytes}, {group_size}; expected >= 0 and >= 1")
    if group_size > lk.max_ranks:
        raise ValueError(
            f"a rank-list of {group_size} ranks spans more than one {lk.target} instance ({lk.chips_per_instance} "
            f"chips x {lk.ranks_per_chip} ranks = {lk.max_ranks}); inter-instance (EFA) links are not modeled"
        )


def ring_us(kind, nbytes, group_size, lk: Links) -> float:
    """Ring algorithm: steps x (hop latency + chunk / slowest link); docs/emulator.md, "Collective costs"."""
    _check(kind, nbytes, group_size, lk)
    n = group_size
    if n == 1:
        return nbytes / lk.core_link_bytes_per_ns / 1e3
    steps, chunk = {
        "all_reduce": (2 * (n - 1), nbytes / n),
        "all_gather": (n - 1, nbytes),
        "reduce_scatter": (n - 1, nbytes / n),
        "all_to_all": (n - 1, nbytes / n),
        "permute": (1, nbytes),
    }[kind]
    per_rank_chip = min(lk.ranks_per_chip, n)
    bandwidth = lk.core_link_bytes_per_ns
    if n > per_rank_chip:  # the ring leaves the chip: one chunk per step crosses each chip boundary
        bandwidth = min(bandwidth, lk.chip_egress_bytes_per_ns)
    return steps * (lk.hop_latency_us + chunk / bandwidth / 1e3)


def mesh_us(kind, nbytes, group_size, lk: Links) -> float:
    """Mesh algorithm: one hop, every peer written directly; docs/emulator.md, "Collective costs"."""
    _check(kind, nbytes, group_size, lk)
    n = group_size
    if n == 1:
        return nbytes / lk.core_link_bytes_per_ns / 1e3
    c = min(lk.ranks_per_chip, n)
    if kind == "permute":
        bandwidth = lk.core_link_bytes_per_ns if n <= c else min(lk.core_link_bytes_per_ns, lk.chip_egress_bytes_per_ns)
        return lk.hop_latency_us + nbytes / bandwidth / 1e3
    chunk = nbytes if kind in ("all_reduce", "all_gather") else nbytes / n
    local_ns = (c - 1) * chunk / lk.core_link_bytes_per_ns
    remote_ns = c * (n - c) * chunk / lk.chip_egress_bytes_per_ns
    return lk.hop_latency_us + max(local_ns, remote_ns) / 1e3


def collective_us(kind, nbytes, group_size, lk: Links) -> float:
    """Modeled µs of one collective call: the faster of ring and mesh (the runtime picks by size)."""
    return min(ring_us(kind, nbytes, group_size, lk), mesh_us(kind, nbytes, group_size, lk))


def record_ns(record: trace.InstructionRecord, lk: Links) -> float:
    """Modeled ns of a collective record (one with CollectiveInfo)."""
    info = record.collective
    return collective_us(info.kind, info.nbytes, info.group_size, lk) * 1e3
