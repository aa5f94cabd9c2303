"""`jax_neuronmm.profile()`: what the NKI kernels did when run on the emulator backend.

    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        y = jitted_model(x).block_until_ready()
    print(prof)            # one row per kernel launch, then totals
    print(prof.grouped())  # one row per kernel, launches summed
    print(LEGEND)          # what every column of both tables means
    prof.calls[0].modeled_us["trn1"]

Kernels run inside host callbacks when the computation executes: block on the
results inside the `with` (`.block_until_ready()`); a launch that has not run by
the time the block exits is not recorded.
"""

import collections
import contextlib
import dataclasses

from nki_kernels import emulator

LEGEND = """\
Columns. Per kernel (grouped): launches = times the kernel ran; instr = NKI instructions emulated; HBM MiB = bytes
  DMAs read from and wrote to HBM; matmuls = TensorE matrix multiplications (transposes excluded); PE fill = mean
  fraction of the 128x128 PE array a matmul occupies; T/V/S/G/D = instructions issued on the Tensor, Vector,
  Scalar and GpSimd engines and the DMA queues; trn1 us / trn2 us = the emulator cost model's latency on
  Trainium 1 / 2, summed over launches taken back to back (modeled, not measured on hardware).
Per launch, also: HBM rd KiB / HBM wr KiB = bytes read from / written to HBM; DMAs = DMA transfers; avg DMA B =
  mean bytes per DMA; transp = TensorE transposes; mov fill = mean moving-tensor free size of a matmul / 512."""


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One kernel launch on the emulator.

    modeled_us: the cost model's latency per target, {"trn1": µs, "trn2": µs}.
    pe_fill: mean fraction of the 128×128 PE array the launch's matmuls occupy.
    """

    kernel: str
    hbm_read_bytes: int
    hbm_write_bytes: int
    matmuls: int
    dma_count: int
    instructions: int
    pe_fill: float
    modeled_us: dict


class Profile:
    """Kernel launches recorded by `profile()`, with totals and a readable table (`str()`)."""

    def __init__(self, recorded):
        self._recorded = recorded  # nki_kernels.emulator.profile's record, filled as kernels finish

    @property
    def calls(self):
        return [KernelCall(kernel=r.name, hbm_read_bytes=r.hbm_bytes_read, hbm_write_bytes=r.hbm_bytes_written,
                           matmuls=r.matmul_count, dma_count=r.dma_count, instructions=r.instructions,
                           pe_fill=r.pe_fill, modeled_us=dict(r.latency_us))
                for r in self._recorded.runs]

    @property
    def hbm_read_bytes(self):
        return self._recorded.hbm_bytes_read

    @property
    def hbm_write_bytes(self):
        return self._recorded.hbm_bytes_written

    @property
    def matmuls(self):
        return self._recorded.matmul_count

    @property
    def modeled_us(self):
        """Summed modeled latency per target, launches taken back to back."""
        return self._recorded.latency_us

    def grouped(self) -> str:
        """A table with one row per kernel name (in first-launch order): launches, instructions, HBM MiB read +
        written, matmuls, mean PE fill, and modeled µs per target summed over its launches (see LEGEND)."""
        if not self._recorded.runs:
            return str(self)
        rows = collections.defaultdict(list)
        for call, run in zip(self.calls, self._recorded.runs):
            rows[call.kernel].append((call, run.engine_counts))
        header = f"{'kernel':28s} {'launches':>8s} {'instr':>9s} {'HBM MiB':>9s} {'matmuls':>8s} {'PE fill':>7s} " \
                 f"{'T/V/S/G/D':>16s} {'trn1 us':>10s} {'trn2 us':>10s}"
        lines = [header, "-" * len(header)]
        for kernel, launches in rows.items():
            calls = [call for call, _ in launches]
            matmuls = sum(c.matmuls for c in calls)
            fill = sum(c.pe_fill * c.matmuls for c in calls) / matmuls if matmuls else 0.0
            hbm = sum(c.hbm_read_bytes + c.hbm_write_bytes for c in calls) / 2**20
            # engine_counts lists the engines in T/V/S/G/D order, as the per-launch table prints them.
            engines = "/".join(str(sum(counts.get(engine, 0) for _, counts in launches)) for engine in launches[0][1])
            lines.append(f"{kernel:28s} {len(calls):8d} {sum(c.instructions for c in calls):9d} {hbm:9.2f} "
                         f"{matmuls:8d} {fill:7.3f} {engines:>16s} "
                         f"{sum(c.modeled_us['trn1'] for c in calls):10.2f} "
                         f"{sum(c.modeled_us['trn2'] for c in calls):10.2f}")
        return "\n".join(lines)

    def __len__(self):
        return len(self._recorded.runs)

    def __str__(self):
        if not self._recorded.runs:
            return "no NKI kernel ran (is the backend 'emulator'? did the computation run inside the block?)"
        return f"{len(self._recorded.runs)} NKI kernel launch(es) on the emulator\n{self._recorded}"


@contextlib.contextmanager
def profile():
    """Records every NKI kernel launch the emulator runs inside the block; yields a `Profile`."""
    with emulator.profile() as recorded:
        yield Profile(recorded)
