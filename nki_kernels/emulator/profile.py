"""Per-kernel-run profile of emulated NKI kernels.

    with emulator.profile() as prof:
        kernel(x, w)
    print(prof)                     # one row per kernel run plus totals
    prof.runs[0].hbm_bytes_read     # counters of the first run
    prof.runs[0].latency_us["trn2"] # modeled latency (see cost_model.py)
    prof.runs[0].collective_us["trn2"]  # of which nki.collectives calls took (simulate_spmd runs)

    with emulator.profile(dependency_floor=True) as prof:  # also the dependency floor of each run
        kernel(x, w)
    prof.runs[0].dependency_floor_us["trn2"]  # µs with unlimited DMA and link bandwidth (cost_model.py)

The profile listens to finished `KernelRun`s (trace.py) and keeps a
`RunSummary` of each; it never looks at emulator state. Counters are taken
when a run finishes; the modeled latency of a target is scheduled on first
read (the run's records are kept until every target has been read).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping

from nki_kernels import hardware

from . import cost_model, trace


class _PerTarget(Mapping):
    """A read-only {target: value} over cost_model.TARGETS; subclasses define __getitem__."""

    def __iter__(self) -> Iterator[str]:
        return iter(cost_model.TARGETS)

    def __len__(self) -> int:
        return len(cost_model.TARGETS)

    def __repr__(self) -> str:
        return repr(dict(self))


class ModeledLatency(_PerTarget):
    """Read-only {target: modeled µs} of one run; each target is scheduled when first read. `collective_us` is
    the {target: µs} that run's nki.collectives calls took in the same schedules; `dependency_floor_us` the
    {target: µs} with unlimited DMA and link bandwidth (cost_model.dependency_floor_us), scheduled beside each
    target's latency when dependency_floor is set (the records are not kept for a later request)."""

    def __init__(self, run: trace.KernelRun, dependency_floor: bool = False) -> None:
        # A snapshot of the record list, so later changes to `run` cannot alter the result.
        self._run: trace.KernelRun | None = dataclasses.replace(run, grid=tuple(run.grid), records=list(run.records))
        self._floor = dependency_floor
        self._schedules: dict[str, tuple[float, float, float | None]] = {}  # target -> (latency, collective, floor)
        self.collective_us = _CollectiveTime(self)
        self.dependency_floor_us = _DependencyFloor(self)

    def _scheduled(self, target: str) -> tuple[float, float, float | None]:
        if target not in self._schedules:
            if target not in cost_model.TARGETS:
                raise KeyError(target)
            scheduled = cost_model.schedule(self._run, target)
            floor = cost_model.dependency_floor_us(self._run, target) if self._floor else None
            self._schedules[target] = (scheduled.latency_us, scheduled.collective_us, floor)
            if len(self._schedules) == len(cost_model.TARGETS):
                self._run = None  # every target known: the records are no longer needed
        return self._schedules[target]

    def __getitem__(self, target: str) -> float:
        return self._scheduled(target)[0]


class _CollectiveTime(_PerTarget):
    """Read-only {target: µs in nki.collectives calls} of one run (cost_model.Schedule.collective_us)."""

    def __init__(self, latency: ModeledLatency) -> None:
        self._latency = latency

    def __getitem__(self, target: str) -> float:
        return self._latency._scheduled(target)[1]


class _DependencyFloor(_PerTarget):
    """Read-only {target: µs of the run with unlimited DMA and link bandwidth} (cost_model.dependency_floor_us);
    only for runs profiled with dependency_floor=True."""

    def __init__(self, latency: ModeledLatency) -> None:
        self._latency = latency

    def __getitem__(self, target: str) -> float:
        floor = self._latency._scheduled(target)[2]
        if floor is None:
            raise ValueError("dependency_floor_us: the run was profiled without profile(dependency_floor=True)")
        return floor


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """Counters and modeled latency of one kernel run.

    matmul_count: TensorE matrix multiplications, transposes excluded.
    transposes: TensorE transposes (nc_transpose on TensorE, nc_matmul with
      is_transpose=True): TensorE instructions, scheduled by the cost model, but
      multiplications by an identity, so not in matmul_count, pe_fill or moving_fill.
    pe_fill: mean over matmuls of contraction * stationary_free / 128**2, the
      fraction of the PE array a matmul occupies (0.0 when there are none).
    moving_fill: mean over matmuls of moving_free / 512.
    hbm_bytes_read / hbm_bytes_written: bytes DMAs read from HBM (source side) and
      write to HBM (destination side); they differ from dma_sizes for casting DMAs.
    dma_sizes: bytes each DMA writes (destination side), in issue order.
    engine_counts: instructions per engine, every name of trace.ENGINES present.
    latency_us: modeled latency in µs per target, keys "trn1" and "trn2" (a read-only
      mapping, computed per target on first read).
    rank: the run's rank under simulate_spmd (0 for a plain launch).
    collectives: nki.collectives calls; collective_bytes: the source bytes they sent (trace.CollectiveInfo).
    collective_us: modeled µs of those calls per target, within latency_us (same keys, computed with it).
    dependency_floor_us: modeled µs per target with unlimited DMA and link bandwidth (profile(dependency_floor=
      True) only; computed with latency_us).
    """

    name: str
    target: str
    grid: tuple[int, ...]
    instructions: int
    hbm_bytes_read: int
    hbm_bytes_written: int
    dma_count: int
    dma_sizes: tuple[int, ...]
    matmul_count: int
    transposes: int
    pe_fill: float
    moving_fill: float
    engine_counts: dict[str, int]
    latency_us: Mapping[str, float]
    rank: int = 0  # the run's rank under simulate_spmd (0 for a plain launch)
    collectives: int = 0
    collective_bytes: int = 0

    @property
    def collective_us(self) -> Mapping[str, float]:
        return self.latency_us.collective_us

    @property
    def dependency_floor_us(self) -> Mapping[str, float]:
        return self.latency_us.dependency_floor_us

    @property
    def dma_bytes(self) -> int:
        return sum(self.dma_sizes)

    @property
    def mean_dma_bytes(self) -> float:
        return self.dma_bytes / self.dma_count if self.dma_count else 0.0


def summarize(run: trace.KernelRun, dependency_floor: bool = False) -> RunSummary:
    """Counters of one finished kernel run, with its modeled latency on every target (lazy) and, with
    dependency_floor, its dependency floor beside it."""
    engine_counts = {engine: 0 for engine in trace.ENGINES}
    hbm_read = hbm_written = 0
    dma_sizes = []
    matmul_count = transposes = 0
    pe_fill_sum = moving_fill_sum = 0.0
    collectives = collective_bytes = 0
    for record in run.records:
        if record.collective is not None:
            collectives += 1
            collective_bytes += record.collective.nbytes
        engine_counts[record.engine] = engine_counts.get(record.engine, 0) + 1
        if record.dma is not None:
            dma_sizes.append(record.dma.nbytes)
            # A casting DMA reads the source's bytes and writes the destination's.
            if record.dma.src_buffer == "hbm":
                hbm_read += record.dma.bytes_read
            if record.dma.dst_buffer == "hbm":
                hbm_written += record.dma.nbytes
        if record.matmul is not None and record.matmul.is_transpose:
            transposes += 1
        elif record.matmul is not None:
            mm = record.matmul
            matmul_count += 1
            pe_fill_sum += mm.contraction * mm.stationary_free / (hardware.PMAX * hardware.STATIONARY_FMAX)
            moving_fill_sum += mm.moving_free / hardware.MOVING_FMAX
    return RunSummary(
        name=run.name,
        target=run.target,
        grid=tuple(run.grid),
        instructions=len(run.records),
        hbm_bytes_read=hbm_read,
        hbm_bytes_written=hbm_written,
        dma_count=len(dma_sizes),
        dma_sizes=tuple(dma_sizes),
        matmul_count=matmul_count,
        transposes=transposes,
        pe_fill=pe_fill_sum / matmul_count if matmul_count else 0.0,
        moving_fill=moving_fill_sum / matmul_count if matmul_count else 0.0,
        engine_counts=engine_counts,
        latency_us=ModeledLatency(run, dependency_floor),
        rank=run.rank,
        collectives=collectives,
        collective_bytes=collective_bytes,
    )


class Profile:
    """What `profile()` recorded: `.runs` (RunSummary per kernel run, in order) and totals."""

    def __init__(self, dependency_floor: bool = False) -> None:
        self.runs: list[RunSummary] = []
        self._floor = dependency_floor

    def _record(self, run: trace.KernelRun) -> None:
        self.runs.append(summarize(run, self._floor))

    @property
    def hbm_bytes_read(self) -> int:
        return sum(r.hbm_bytes_read for r in self.runs)

    @property
    def hbm_bytes_written(self) -> int:
        return sum(r.hbm_bytes_written for r in self.runs)

    @property
    def dma_count(self) -> int:
        return sum(r.dma_count for r in self.runs)

    @property
    def matmul_count(self) -> int:
        return sum(r.matmul_count for r in self.runs)

    @property
    def transposes(self) -> int:
        return sum(r.transposes for r in self.runs)

    @property
    def instructions(self) -> int:
        return sum(r.instructions for r in self.runs)

    @property
    def engine_counts(self) -> dict[str, int]:
        totals = {engine: 0 for engine in trace.ENGINES}
        for r in self.runs:
            for engine, count in r.engine_counts.items():
                totals[engine] = totals.get(engine, 0) + count
        return totals

    @property
    def latency_us(self) -> dict[str, float]:
        """Summed modeled latency per target (runs are assumed back to back)."""
        return {t: sum(r.latency_us[t] for r in self.runs) for t in cost_model.TARGETS}

    def __str__(self) -> str:
        header = (
            "kernel",
            "instr",
            "HBM rd KiB",
            "HBM wr KiB",
            "DMAs",
            "avg DMA B",
            "matmuls",
            "transp",
            "PE fill",
            "mov fill",
            "T/V/S/G/D",
            "trn1 us",
            "trn2 us",
        )
        rows = [header]
        for r in self.runs:
            rows.append(
                _row(
                    r.name,
                    r.instructions,
                    r.hbm_bytes_read,
                    r.hbm_bytes_written,
                    r.dma_count,
                    r.mean_dma_bytes,
                    r.matmul_count,
                    r.transposes,
                    r.pe_fill,
                    r.moving_fill,
                    r.engine_counts,
                    r.latency_us,
                )
            )
        if len(self.runs) > 1:
            total_dma_bytes = sum(r.dma_bytes for r in self.runs)
            matmuls = self.matmul_count
            rows.append(
                _row(
                    "TOTAL",
                    self.instructions,
                    self.hbm_bytes_read,
                    self.hbm_bytes_written,
                    self.dma_count,
                    total_dma_bytes / self.dma_count if self.dma_count else 0.0,
                    matmuls,
                    self.transposes,
                    sum(r.pe_fill * r.matmul_count for r in self.runs) / matmuls if matmuls else 0.0,
                    sum(r.moving_fill * r.matmul_count for r in self.runs) / matmuls if matmuls else 0.0,
                    self.engine_counts,
                    self.latency_us,
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)


def _row(
    name,
    instructions,
    hbm_read,
    hbm_written,
    dma_count,
    mean_dma,
    matmuls,
    transposes,
    pe_fill,
    moving_fill,
    engine_counts,
    latency_us,
) -> tuple[str, ...]:
    engines = "/".join(str(engine_counts.get(e, 0)) for e in trace.ENGINES)
    return (
        name,
        str(instructions),
        f"{hbm_read / 1024:.1f}",
        f"{hbm_written / 1024:.1f}",
        str(dma_count),
        f"{mean_dma:.0f}",
        str(matmuls),
        str(transposes),
        f"{pe_fill:.3f}",
        f"{moving_fill:.3f}",
        engines,
        f"{latency_us['trn1']:.2f}",
        f"{latency_us['trn2']:.2f}",
    )


@contextlib.contextmanager
def profile(dependency_floor: bool = False) -> Iterator[Profile]:
    """Record every kernel run finished inside the block; yields the `Profile`. dependency_floor: model each run's
    dependency floor (RunSummary.dependency_floor_us) beside its latency."""
    prof = Profile(dependency_floor)
    trace.add_listener(prof._record)
    try:
        yield prof
    finally:
        trace.remove_listener(prof._record)
