"""Modeled latency of an emulated kernel run on trn1 / trn2, from documented hardware facts.

A list scheduler over the run's instruction records: each engine runs its instructions in program order, an
instruction waits for the records it depends on (overlapping accesses), a DMA is spread over the DMA engines its
partitions use at the documented per-engine rate scaled by the documented efficiency curve for its buffer size,
and collectives take collective_costs.py's time on a queue of their own. Optional fitted terms (`CostTerms`,
fitted_costs.json) add what the documents give no figure for. docs/emulator.md ("The cost model") cites every
source and states what is not modeled and the known gaps.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import pathlib

from nki_kernels import hardware

from . import collective_costs, instruction_costs, trace

TARGETS = hardware.TARGETS


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Documented per-NeuronCore facts of one target. Clocks in GHz = cycles per ns."""

    tensor_ghz: float
    vector_ghz: float
    scalar_ghz: float
    gpsimd_ghz: float
    dma_engines: int
    dma_engine_bytes_per_ns: float
    hbm_bytes_per_ns: float  # the core's share of the chip's HBM bandwidth
    vector_bf16_perf_mode: bool  # NeuronCore-v3 VectorE performance mode [ARCH2]


HARDWARE = {
    "trn1": Hardware(
        # [ARCH1] engine table: Tensor 2.8, Vector 1.12, Scalar 1.4, GpSimd 1.4 GHz.
        tensor_ghz=2.8,
        vector_ghz=1.12,
        scalar_ghz=1.4,
        gpsimd_ghz=1.4,
        # [DMA] table "theoretical peak DMA bandwidth per NeuronCore generation": TRN1 17 B/ns per
        # engine, 16 engines, 272 GB/s. ([ARCH1] quotes 27 GiB/s per engine; the per-generation
        # table is the newer and the one that also covers trn2, so it is used for both.)
        dma_engines=16,
        dma_engine_bytes_per_ns=17.0,
        # [HBM] 820 GB/s per trn1 chip shared by its 2 NeuronCores.
        hbm_bytes_per_ns=820.0 / 2,
        vector_bf16_perf_mode=False,
    ),
    "trn2": Hardware(
        # [ARCH2] "Compute Engine Specifications": Tensor 2.4, Vector 0.96, Scalar 1.2, GpSimd 1.2 GHz.
        tensor_ghz=2.4,
        vector_ghz=0.96,
        scalar_ghz=1.2,
        gpsimd_ghz=1.2,
        # [DMA] TRN2 23 B/ns per engine, 16 engines, 368 GB/s.
        dma_engines=16,
        dma_engine_bytes_per_ns=23.0,
        # [HBM] 2.9 TB/s per trn2 chip shared by its 8 physical NeuronCores.
        hbm_bytes_per_ns=2900.0 / 8,
        vector_bf16_perf_mode=True,
    ),
}

# [ISA] nc_matmul: "max(min(64, N_stationary), N_moving)" TensorE cycles, "4 * ..." for float32
# inputs (average cost of back-to-back matmuls, i.e. with the stationary load hidden behind the
# previous moving pass; [ARCH1]: MM_INIT_LATENCY = 64 cycles, fp32 "roughly 4x higher").
MM_INIT_CYCLES = 64
FP32_MATMUL_FACTOR = 4
# [ISA] "MIN_II is the minimum instruction initiation interval for small input tiles. MIN_II is
# roughly 64 engine cycles" (activation, tensor_copy, tensor_scalar, tensor_tensor, memset, ...).
MIN_II_CYCLES = 64
# [ISA] iota: "150 + N GpSimd Engine cycles".
IOTA_FIXED_CYCLES = 150
# [ARCH1] VectorE: "with every instruction depending on the output tile of the previous
# instruction, we need to add a static instruction overhead of 100 engine cycles"; [PERF] gives
# the same ~100-cycle static overhead for ScalarE. Applied to Vector/Scalar/GpSimd instructions
# whose start waits on a data dependency, the engine's own previous instruction included.
DEPENDENT_OVERHEAD_CYCLES = 100
# [DMA bandwidth guide] "every DMA transfer incurs descriptor setup, synchronization, and
# semaphore-to-start latency (~1300 ns cross-engine)".
DMA_FIXED_LATENCY_NS = 1300.0
# [DMA] "each DMA engine corresponds to 8 partition lanes" (128 partitions / 16 engines); its
# Example 1 profiles a [4, 4096] load on one engine, Example 2 a [128, 128] load on all 16.
DMA_PARTITIONS_PER_ENGINE = 8
# [DMA] figure nki-dma-intro-1 (p_dim = 128): (bytes per partition, throughput relative to the
# 32 KiB point). Read off the plotted markers by pixel position, with the unlabeled x axis taken
# as zero throughput: the readings double with every doubling of size from 32 B to 1 KiB, which
# is what a fixed cost per transfer gives. The text: "at 4096 free bytes, we are able to nearly
# saturate DMA bandwidth"; [DMA bandwidth guide]: < 256 B "a small fraction of peak", >= 2 KiB
# "approaches peak", >= 4 KiB saturates; [PERF] Opt #9: transfers (per engine: 8 partitions)
# "should be larger than 32KiB" = 4 KiB per partition. Between points the model interpolates
# log-linearly (a power law between neighbours); below 32 B throughput is taken as proportional
# to size (the fixed per-transfer cost of the curve's lower part), so a smaller buffer takes the
# time of a 32 B one -- an extrapolation, the figure has no point below 32 B; from 32 KiB up as 1.
DMA_EFFICIENCY_BY_PARTITION_BYTES = (
    (32, 0.016),
    (64, 0.029),
    (128, 0.053),
    (256, 0.105),
    (512, 0.209),
    (1024, 0.423),
    (2048, 0.815),
    (4096, 0.965),
    (8192, 0.983),
    (16384, 0.990),
    (32768, 1.0),
)
# [ARCH2] "DMA transpose on Trainium2 can achieve up to 90% DMA throughput utilization" (HBM to
# SBUF); "SBUF2SBUF transpose can achieve up to 50% of DMA throughput". No trn1 figure is
# documented; the same factors are used.
DMA_TRANSPOSE_EFFICIENCY_FROM_HBM = 0.9
DMA_TRANSPOSE_EFFICIENCY_ON_CHIP = 0.5
# [ARCH1]/[ISA] PE array 128 x 128; used by the roofline.
PE_ROWS = PE_COLS = hardware.PMAX

_BF16_LIKE = ("bfloat16", "float16")
# Fewest bytes per dependency-index bucket; a storage gets at most _MAX_BUCKETS buckets.
_MIN_BUCKET_BYTES = 512
_MAX_BUCKETS = 256
# DMA engine idle gaps remembered for slotting in later transfers, and the shortest kept.
_MAX_GAPS = 16
_MIN_GAP_NS = 1e-3


FITTED_COSTS_PATH = pathlib.Path(__file__).with_name("fitted_costs.json")


@dataclasses.dataclass(frozen=True)
class CostTerms:
    """Costs the documented model leaves out, as named terms (docs/emulator.md, "The cost model": "Fitted terms").

    dma_issue_ns: ns a DMA holds an issue queue before its transfer can start.
    step_fixed_us: µs added once per launch (a looped decode step is one launch).
    hbm_efficiency: fraction of the core's HBM share that all its DMA engines reach together (the cap is per core).
    lnc: physical cores per rank (2: trn2's default logical core).
    compute_scale: factor on every compute instruction's time (1 as documented; the speed bands use 2).
    issue_queues: DMA issue queues per physical core (2 on trn2: its two descriptor-generation engines per core).
    """

    dma_issue_ns: float = 0.0
    step_fixed_us: float = 0.0
    hbm_efficiency: float = 1.0
    lnc: int = 1
    compute_scale: float = 1.0
    issue_queues: int = 1

    def __post_init__(self):
        for name in ("dma_issue_ns", "step_fixed_us"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"CostTerms.{name}: got {value!r}, expected a finite number >= 0")
        if not (isinstance(self.hbm_efficiency, (int, float)) and 0 < self.hbm_efficiency <= 1):
            raise ValueError(f"CostTerms.hbm_efficiency: got {self.hbm_efficiency!r}, expected a number in (0, 1]")
        if self.lnc not in (1, 2) or isinstance(self.lnc, bool):
            raise ValueError(f"CostTerms.lnc: got {self.lnc!r}, expected 1 or 2 physical cores per rank")
        if self.issue_queues not in (1, 2) or isinstance(self.issue_queues, bool):
            raise ValueError(f"CostTerms.issue_queues: got {self.issue_queues!r}, expected 1 or 2 per physical core")
        if not (isinstance(self.compute_scale, (int, float)) and 0 < self.compute_scale < math.inf):
            raise ValueError(f"CostTerms.compute_scale: got {self.compute_scale!r}, expected a finite number > 0")


def fitted_terms(target: str, path: str | pathlib.Path | None = None) -> CostTerms:
    """The CostTerms fitted for `target`, read from `path` (default FITTED_COSTS_PATH, written by
    benchmarks/calibration.py). A missing target, an unknown or missing field fails with a ValueError."""
    _check_target(target)
    path = pathlib.Path(FITTED_COSTS_PATH if path is None else path)
    with open(path, encoding="utf-8") as f:
        table = json.load(f)
    entry = table.get("targets", {}).get(target) if isinstance(table, dict) else None
    fields = {f.name for f in dataclasses.fields(CostTerms)}
    if not isinstance(entry, dict) or set(entry) != fields:
        raise ValueError(
            f"{path}: targets.{target}: got {entry!r}, expected an object with the fields {sorted(fields)}"
        )
    return CostTerms(**entry)


def _check_target(target: str) -> Hardware:
    hardware.check_target(target)
    return HARDWARE[target]


def _engine_ghz(hw: Hardware, engine: str) -> float:
    return {"tensor": hw.tensor_ghz, "vector": hw.vector_ghz, "scalar": hw.scalar_ghz, "gpsimd": hw.gpsimd_ghz}[engine]


def compute_cycles(record: trace.InstructionRecord, hw: Hardware) -> float:
    """Engine cycles a non-DMA instruction occupies its engine ([ISA] cost formulas)."""
    if (listed := instruction_costs.cycles(record)) is not None:  # per-instruction table (documented costs)
        return listed
    n = record.free_elements
    if record.engine == "tensor":
        if record.opcode == "nc_transpose" and record.matmul is not None:
            # [ISA] nc_transpose on TensorE: "max(P, min(64, F))" for back-to-back transposes, also for
            # fp32, P = partitions and F = free size of the data. The data is the stationary operand
            # and a [P, P] identity the moving one, so P is the moving free size, F the stationary's.
            mm = record.matmul
            return max(mm.moving_free, min(MM_INIT_CYCLES, mm.stationary_free))
        if record.matmul is not None:
            mm = record.matmul
            cycles = max(min(MM_INIT_CYCLES, mm.stationary_free), mm.moving_free)
            return cycles * (FP32_MATMUL_FACTOR if mm.input_dtype == "float32" else 1)
        return max(record.partitions, min(MM_INIT_CYCLES, n))  # a transpose without MatmulInfo
    if record.opcode == "iota":
        return IOTA_FIXED_CYCLES + n
    reads_psum = any(a.buffer == "psum" for a in record.reads)
    touches_psum = reads_psum or any(a.buffer == "psum" for a in record.writes)
    perf_mode = record.engine == "vector" and hw.vector_bf16_perf_mode and _all_bf16_like(record)
    elements_per_cycle = 1.0
    if record.engine == "vector" and record.opcode != "tensor_tensor" and len(record.input_dtypes) >= 2:
        # [ARCH1] VectorE cost model: "If there are two input tiles, the instruction can execute in
        # roughly 2N cycles" (tensor_tensor_scan, scalar_tensor_tensor, ...); the PSUM exception
        # below is documented for tensor_tensor only.
        elements_per_cycle = 0.5
    elif record.engine == "vector" and record.opcode == "tensor_tensor":
        # [ISA] tensor_tensor on VectorE: N when one input is in PSUM, otherwise 2N (the N case
        # for all-bf16 add/multiply/subtract is not applied: records do not carry the operator).
        elements_per_cycle = 1.0 if reads_psum else 0.5
        if perf_mode and not reads_psum:
            # [ARCH2] "Vector Engine Performance Mode", 2x case 2a: both inputs in SBUF and all of
            # input/output tensors in BF16/FP16.
            elements_per_cycle *= 2
    elif perf_mode and record.opcode in ("tensor_copy", "tensor_scalar"):
        # [ARCH2] "Vector Engine Performance Mode": all input/output tensors in BF16/FP16 (1b) and
        # 4x when all are in SBUF (1a) with contiguous innermost free elements (1c); 2x for 1a+1b
        # without 1c (2x case 1a), or 1b+1c with the input or the output in PSUM (2x case 1b).
        if not touches_psum:
            elements_per_cycle = 4.0 if record.inner_contiguous else 2.0
        elif record.inner_contiguous:
            elements_per_cycle = 2.0
    return max(MIN_II_CYCLES, n / elements_per_cycle)


def _all_bf16_like(record: trace.InstructionRecord) -> bool:
    """Output and every input data tensor in BF16/FP16 ([ARCH2] performance-mode condition 1b).

    A record without input dtypes cannot show its inputs qualify, so it does not.
    """
    return (
        record.dtype in _BF16_LIKE and bool(record.input_dtypes) and all(d in _BF16_LIKE for d in record.input_dtypes)
    )


class _RegionIndex:
    """Finish times of earlier reads and writes, per storage and byte bucket.

    Each entry is [p_start, p_stop, b_start, b_stop, finish_ns]; an entry is stored in every
    bucket its byte range touches. An entry is dropped when a later one of the same kind covers
    it and finishes no earlier, so repeated accesses to one tile keep the lists short.
    """

    def __init__(self, bucket_bytes: dict[int, int]) -> None:
        self._bucket_bytes = bucket_bytes
        self._buckets: dict[tuple[int, int], list[list]] = {}
        self._storages: set[int] = set()

    def latest_overlap(self, access: trace.Access) -> float:
        storage = access.storage
        if storage not in self._storages:
            return 0.0
        latest = 0.0
        p0, p1, b0, b1 = access.p_start, access.p_stop, access.b_start, access.b_stop
        size = self._bucket_bytes[storage]
        buckets = self._buckets
        for b in range(b0 // size, max(b1 - 1, b0) // size + 1):
            for e in buckets.get((storage, b), ()):
                if e[4] > latest and e[0] < p1 and p0 < e[1] and e[2] < b1 and b0 < e[3]:
                    latest = e[4]
        return latest

    def add(self, access: trace.Access, finish: float) -> None:
        storage = access.storage
        self._storages.add(storage)
        p0, p1, b0, b1 = access.p_start, access.p_stop, access.b_start, access.b_stop
        entry = [p0, p1, b0, b1, finish]
        size = self._bucket_bytes[storage]
        for b in range(b0 // size, max(b1 - 1, b0) // size + 1):
            entries = self._buckets.get((storage, b))
            if entries is None:
                self._buckets[(storage, b)] = [entry]
                continue
            entries[:] = [
                e for e in entries if not (p0 <= e[0] and e[1] <= p1 and b0 <= e[2] and e[3] <= b1 and e[4] <= finish)
            ]
            entries.append(entry)


class _DmaEngine:
    """Booked time of one DMA engine: fully free after `tail`, plus the most recent idle gaps.

    A transfer takes the earliest gap that fits. Only the last _MAX_GAPS gaps are remembered
    (older ones count as busy), which bounds the work per transfer and how far back a transfer
    can be slotted in.
    """

    def __init__(self) -> None:
        self.tail = 0.0
        self.gaps: list[list[float]] = []  # [start, stop], sorted, disjoint, all before `tail`

    def copy(self) -> _DmaEngine:
        twin = _DmaEngine()
        twin.tail = self.tail
        twin.gaps = [list(gap) for gap in self.gaps]
        return twin

    def earliest(self, ready: float, duration: float) -> float:
        """Earliest start >= ready of a free stretch of `duration` ns."""
        if ready >= self.tail:
            return ready
        for start, stop in self.gaps:
            t = max(start, ready)
            if stop - t >= duration:
                return t
        return max(self.tail, ready)

    def book(self, t: float, duration: float) -> None:
        """Mark [t, t + duration) busy; the stretch must be free (found by `earliest`)."""
        end = t + duration
        if t >= self.tail:
            if t > self.tail:
                self.gaps.append([self.tail, t])
            self.tail = end
        else:
            for i, (start, stop) in enumerate(self.gaps):
                if start <= t and end <= stop:
                    pieces = [p for p in ([start, t], [end, stop]) if p[1] - p[0] > _MIN_GAP_NS]
                    self.gaps[i : i + 1] = pieces
                    break
        if len(self.gaps) > _MAX_GAPS:
            del self.gaps[: len(self.gaps) - _MAX_GAPS]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Result of scheduling one run: times in µs, per record in record order."""

    target: str
    start_us: tuple[float, ...]
    finish_us: tuple[float, ...]
    engine_busy_us: dict[str, float]  # "tensor", "vector", "scalar", "gpsimd", "dma" (summed over engines)
    collective_us: float = 0.0  # time in nki.collectives calls (their own queue; collective_costs.py)
    fixed_us: float = 0.0  # CostTerms.step_fixed_us: once per launch, after the last instruction

    @property
    def latency_us(self) -> float:
        return max(self.finish_us, default=0.0) + self.fixed_us


def dma_efficiency(buffer_bytes: float) -> float:
    """Throughput of DMA buffers of `buffer_bytes` relative to the peak (figure nki-dma-intro-1).

    Below the figure's smallest point (32 B) throughput scales with size, so every smaller buffer
    takes the 32 B buffer's time (extrapolated: the figure stops at 32 B).
    """
    curve = DMA_EFFICIENCY_BY_PARTITION_BYTES
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes: got {buffer_bytes}, expected a positive byte count")
    if buffer_bytes >= curve[-1][0]:
        return curve[-1][1]
    if buffer_bytes <= curve[0][0]:
        return curve[0][1] * buffer_bytes / curve[0][0]
    k = bisect.bisect_right(curve, (buffer_bytes, math.inf))
    (x0, y0), (x1, y1) = curve[k - 1], curve[k]
    return y0 * (y1 / y0) ** (math.log(buffer_bytes / x0) / math.log(x1 / x0))


def dma_buffer_bytes(record: trace.InstructionRecord) -> int:
    """Contiguous bytes per DMA buffer: per SBUF partition, or the HBM-side run if shorter."""
    dma = record.dma
    if dma.src_buffer == "hbm" and dma.dst_buffer == "hbm":
        return max(1, dma.contiguous_bytes)
    per_partition = dma.nbytes // max(1, record.partitions)
    return max(1, min(per_partition, dma.contiguous_bytes))


def dma_engine_count(record: trace.InstructionRecord, hw: Hardware) -> int:
    """DMA engines sharing one transfer: one per 8 partitions, at most all of them [DMA]."""
    return max(1, min(hw.dma_engines, -(-record.partitions // DMA_PARTITIONS_PER_ENGINE)))


def dma_transfer_ns(
    record: trace.InstructionRecord, hw: Hardware, hbm_efficiency: float | None = None
) -> tuple[int, float]:
    """(engines used, ns each engine is busy) for one DMA record, fixed latency excluded. hbm_efficiency (a
    CostTerms field): the core's engines share that fraction of its HBM share; None: the cap is per transfer."""
    if record.dma is None:
        raise ValueError(f"record {record.opcode} at {record.line}: engine 'dma' without DmaInfo")
    dma = record.dma
    engines = dma_engine_count(record, hw)
    hbm_sides = (dma.src_buffer == "hbm") + (dma.dst_buffer == "hbm")
    per_engine_rate = hw.dma_engine_bytes_per_ns
    if hbm_sides:
        # All engines together cannot draw more than the core's HBM share (each byte crosses
        # HBM once per HBM side).
        sharing = engines if hbm_efficiency is None else hw.dma_engines
        efficiency = 1.0 if hbm_efficiency is None else hbm_efficiency
        per_engine_rate = min(per_engine_rate, efficiency * hw.hbm_bytes_per_ns / (sharing * hbm_sides))
    per_engine_rate *= dma_efficiency(dma_buffer_bytes(record))
    if dma.transpose:
        per_engine_rate *= DMA_TRANSPOSE_EFFICIENCY_FROM_HBM if hbm_sides else DMA_TRANSPOSE_EFFICIENCY_ON_CHIP
    return engines, dma.nbytes / engines / per_engine_rate


def collective_links(
    target: str,
    hop_latency_us: float = collective_costs.DEFAULT_HOP_LATENCY_US,
    core_link_gbps: float | None = None,
    ranks_per_chip: int | None = None,
) -> collective_costs.Links:
    """Link figures collectives are priced with on `target` (collective_costs.py has the sources and the model).

    hop_latency_us: per-hop latency (documented as 1-2 µs; benchmarks sweep collective_costs.HOP_LATENCY_SWEEP_US).
    core_link_gbps: bandwidth between two ranks of one chip; no documented figure, so by default a rank's own
    HBM-to-HBM DMA rate: min(16 engines x per-engine rate, half its HBM share) times its cores.
    ranks_per_chip: default 2 on trn1 (one per NeuronCore-v2), 4 on trn2 (LNC=2).
    """
    hw = _check_target(target)
    if core_link_gbps is None:
        ranks = ranks_per_chip or collective_costs.make_links(target, 1.0).ranks_per_chip
        cores_per_rank = collective_costs.physical_cores(target) / ranks
        core_link_gbps = cores_per_rank * min(hw.dma_engines * hw.dma_engine_bytes_per_ns, hw.hbm_bytes_per_ns / 2)
    return collective_costs.make_links(target, core_link_gbps, hop_latency_us, ranks_per_chip)


class _Dependencies:
    """When every region a later record may wait on was last read / written. Per storage, a read only matters to a
    later write (WAR) and a write to a later access, so others are not indexed; DMA writes to HBM get an index of
    their own because they never order each other (kernels write each output element once)."""

    def __init__(self, records) -> None:
        extent: dict[int, int] = {}  # per storage: byte extent
        self.last_write: dict[int, int] = {}  # per storage: the last record that writes / touches it
        self.last_access: dict[int, int] = {}
        for i, record in enumerate(records):
            for access in record.reads:
                self.last_access[access.storage] = i
                if access.b_stop > extent.get(access.storage, 0):
                    extent[access.storage] = access.b_stop
            for access in record.writes:
                self.last_access[access.storage] = self.last_write[access.storage] = i
                if access.b_stop > extent.get(access.storage, 0):
                    extent[access.storage] = access.b_stop
        bucket_bytes = {s: max(_MIN_BUCKET_BYTES, math.ceil(e / _MAX_BUCKETS)) for s, e in extent.items()}
        self.reads = _RegionIndex(bucket_bytes)
        self.writes = _RegionIndex(bucket_bytes)
        self.hbm_dma_writes = _RegionIndex(bucket_bytes)

    def ready(self, record: trace.InstructionRecord, is_dma: bool) -> float:
        """When every earlier record `record` depends on (RAW, WAR, WAW) has finished."""
        ready = 0.0
        for access in record.reads:
            ready = max(ready, self.writes.latest_overlap(access), self.hbm_dma_writes.latest_overlap(access))
        for access in record.writes:
            ready = max(ready, self.reads.latest_overlap(access), self.writes.latest_overlap(access))
            if not (is_dma and access.buffer == "hbm"):
                ready = max(ready, self.hbm_dma_writes.latest_overlap(access))
        return ready

    def finished(self, i: int, record: trace.InstructionRecord, is_dma: bool, finish: float) -> None:
        """Records that record `i` finishes at `finish`, for the later records that will depend on it."""
        for access in record.reads:
            if self.last_write.get(access.storage, -1) > i:
                self.reads.add(access, finish)
        for access in record.writes:
            if self.last_access[access.storage] > i:
                index = self.hbm_dma_writes if is_dma and access.buffer == "hbm" else self.writes
                index.add(access, finish)


class _DmaPool:
    """The core's DMA engines. Engines with identical bookings form one group ([engine, count]), evaluated once."""

    def __init__(self, engines: int) -> None:
        self.groups = [[_DmaEngine(), engines]]

    def book(self, ready: float, engines: int, transfer_ns: float) -> tuple[float, float]:
        """Gives each of `engines` shares to the engines that can start it earliest; returns (first start, last
        start)."""
        offers = sorted((group[0].earliest(ready, transfer_ns), k) for k, group in enumerate(self.groups))
        needed = engines
        for t, k in offers:
            group = self.groups[k]
            if group[1] > needed:  # split off the engines this transfer leaves alone
                self.groups.append([group[0].copy(), group[1] - needed])
                group[1] = needed
            group[0].book(t, transfer_ns)
            needed -= group[1]
            if needed == 0:
                break
        return offers[0][0], t


def _scheduled_hardware(target: str, terms: CostTerms | None) -> Hardware:
    """`target`'s hardware, with LNC=2's doubled DMA engines and HBM share when `terms` say so."""
    hw = _check_target(target)
    if terms is None:
        return hw
    return dataclasses.replace(
        hw, dma_engines=hw.dma_engines * terms.lnc, hbm_bytes_per_ns=hw.hbm_bytes_per_ns * terms.lnc
    )


def _scheduled_links(target, links, unlimited_bandwidth) -> collective_costs.Links:
    if links is None:
        links = collective_links(target)
    elif links.target != target:
        raise ValueError(f"links: figures of {links.target!r}, but the run is scheduled on {target!r}")
    if unlimited_bandwidth:
        links = dataclasses.replace(links, chip_link_bytes_per_ns=math.inf, core_link_bytes_per_ns=math.inf)
    return links


def schedule(
    run: trace.KernelRun,
    target: str,
    links: collective_costs.Links | None = None,
    unlimited_bandwidth: bool = False,
    terms: CostTerms | None = None,
) -> Schedule:
    """List-schedule `run` on `target` (the rules: docs/emulator.md, "The cost model").

    links: the link figures collectives are priced with (default: collective_links(target)).
    unlimited_bandwidth: DMA and link bandwidth infinite (the dependency floor, docs/emulator.md): transfers take
    no engine time, only their fixed latency, and collectives their hop latencies (links' bandwidths made
    infinite, their hop latency kept).
    terms: the fitted terms (CostTerms; fitted_terms(target) loads them); None: the documented model alone.
    """
    hw = _scheduled_hardware(target, terms)
    hbm_efficiency = None if terms is None else terms.hbm_efficiency
    issue_ns = 0.0 if terms is None else terms.dma_issue_ns
    issue_free = [0.0] * (1 if terms is None else terms.lnc * terms.issue_queues)  # when each issue queue frees
    compute_scale = 1.0 if terms is None else terms.compute_scale
    links = _scheduled_links(target, links, unlimited_bandwidth)
    collective_free = collective_busy = 0.0
    dependencies = _Dependencies(run.records)
    engine_free = {"tensor": 0.0, "vector": 0.0, "scalar": 0.0, "gpsimd": 0.0}
    busy = {engine: 0.0 for engine in trace.ENGINES}
    dma_pool = _DmaPool(hw.dma_engines)
    dma_costs: dict = {}  # (partitions, DmaInfo) -> (engines, ns): tiles repeat their shapes
    starts, finishes = [], []
    for i, record in enumerate(run.records):
        is_dma = record.engine == "dma"
        ready = dependencies.ready(record, is_dma)
        if record.collective is not None:
            # A collective runs on the CC cores' queue, in program order, once its sources are ready.
            start = max(collective_free, ready)
            finish = collective_free = start + collective_costs.record_ns(record, links)
            collective_busy += finish - start
        elif is_dma:
            key = (record.partitions, record.dma) if record.dma is not None else None
            cost = dma_costs.get(key)
            if cost is None:
                engines, transfer_ns = dma_transfer_ns(record, hw, hbm_efficiency)
                cost = dma_costs[key] = (engines, 0.0 if unlimited_bandwidth else transfer_ns)
            engines, transfer_ns = cost
            if issue_ns:  # the transfer starts once the earliest free issue queue has issued it
                q = min(range(len(issue_free)), key=issue_free.__getitem__)
                ready = issue_free[q] = max(issue_free[q], ready) + issue_ns
            start, last_start = dma_pool.book(ready, engines, transfer_ns)
            finish = last_start + transfer_ns + DMA_FIXED_LATENCY_NS
            busy["dma"] += transfer_ns * engines
        elif record.engine in engine_free:
            ghz = _engine_ghz(hw, record.engine)
            cycles = compute_cycles(record, hw) * compute_scale
            free = engine_free[record.engine]
            if record.engine != "tensor" and ready > 0.0 and ready >= free:
                # Waiting on a dependency, including the engine's own previous instruction
                # (then ready == free): the documented static overhead applies.
                ready += DEPENDENT_OVERHEAD_CYCLES / ghz
            start = max(free, ready)
            finish = engine_free[record.engine] = start + cycles / ghz
            busy[record.engine] += cycles / ghz
        else:
            raise ValueError(
                f"record {record.opcode} at {record.line}: engine {record.engine!r}, expected one of {trace.ENGINES}"
            )
        dependencies.finished(i, record, is_dma, finish)
        starts.append(start / 1e3)
        finishes.append(finish / 1e3)
    return Schedule(
        target=target,
        start_us=tuple(starts),
        finish_us=tuple(finishes),
        engine_busy_us={k: v / 1e3 for k, v in busy.items()},
        collective_us=collective_busy / 1e3,
        fixed_us=0.0 if terms is None else terms.step_fixed_us,
    )


def model_latency(
    run: trace.KernelRun, target: str, links: collective_costs.Links | None = None, terms: CostTerms | None = None
) -> float:
    """Modeled latency in µs of one kernel run on `target` ("trn1" or "trn2"); links, terms: see `schedule`."""
    return schedule(run, target, links, terms=terms).latency_us


def dependency_floor_us(run: trace.KernelRun, target: str, links: collective_costs.Links | None = None) -> float:
    """Modeled µs of `run` on `target` with unlimited DMA and link bandwidth: its dependency chain
    (docs/emulator.md, "Dependency floor"); links: see `schedule` (their hop latency is what counts)."""
    return schedule(run, target, links, unlimited_bandwidth=True).latency_us


def roofline_us(flops: float, hbm_bytes: float, target: str, input_dtype: str = "bfloat16") -> float:
    """Lower bound in µs: max(flops / peak TensorE rate, hbm_bytes / DMA-to-HBM bandwidth).

    Peak rate = 128 x 128 PEs x 2 flop x TensorE clock (91.8 TFLOP/s trn1, 78.6 trn2 for bf16),
    a quarter of that for float32 inputs [ARCH1]. Bandwidth = min(core's HBM share, 16 DMA engines).
    """
    hw = _check_target(target)
    if flops < 0 or hbm_bytes < 0:
        raise ValueError(f"flops, hbm_bytes: got {flops}, {hbm_bytes}, expected non-negative numbers")
    flop_per_ns = PE_ROWS * PE_COLS * 2 * hw.tensor_ghz
    if input_dtype == "float32":
        flop_per_ns /= FP32_MATMUL_FACTOR
    bytes_per_ns = min(hw.hbm_bytes_per_ns, hw.dma_engines * hw.dma_engine_bytes_per_ns)
    return max(flops / flop_per_ns, hbm_bytes / bytes_per_ns) / 1e3
