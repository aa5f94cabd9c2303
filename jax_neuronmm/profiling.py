"""`jax_neuronmm.profile()`: what the NKI kernels did when run on the emulator backend.

    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        y = jitted_model(x).block_until_ready()
    print(prof)            # one row per kernel launch, then totals
    print(prof.grouped())  # one row per kernel, launches summed
    print(LEGEND)          # what every column of both tables means
    prof.runs[0].latency_us["trn1"]

The names are the emulator's (`nki_kernels.emulator.profile`), one vocabulary on both sides: `prof.runs` holds
one summary per launch (`name`, `hbm_bytes_read`, `hbm_bytes_written`, `dma_count`, `matmul_count`,
`instructions`, `pe_fill`, `latency_us[target]`, ...), and `prof` has the same totals (`hbm_bytes_read`,
`matmul_count`, `latency_us`, ...).

Kernels run inside host callbacks when the computation executes: block on the
results inside the `with` (`.block_until_ready()`); a launch that has not run by
the time the block exits is not recorded.
"""

import collections
import contextlib

from nki_kernels import emulator

LEGEND = """\
Columns. Per kernel (grouped): launches = times the kernel ran; instr = NKI instructions emulated; HBM MiB = bytes
  DMAs read from and wrote to HBM; matmuls = TensorE matrix multiplications (transposes excluded); PE fill = mean
  fraction of the 128x128 PE array a matmul occupies; T/V/S/G/D = instructions issued on the Tensor, Vector,
  Scalar and GpSimd engines and the DMA queues; trn1 us / trn2 us = the emulator cost model's latency on
  Trainium 1 / 2, summed over launches taken back to back (modeled, not measured on hardware).
Per launch, also: HBM rd KiB / HBM wr KiB = bytes read from / written to HBM; DMAs = DMA transfers; avg DMA B =
  mean bytes per DMA; transp = TensorE transposes; mov fill = mean moving-tensor free size of a matmul / 512."""


class Profile:
    """The emulator's profile of the launches inside `profile()`, read through (same attributes), with a hint
    in `str()` when no kernel ran."""

    def __init__(self, recorded):
        self._recorded = recorded  # the emulator's profile, filled as kernels finish

    def __getattr__(self, name):
        return getattr(self._recorded, name)

    def grouped(self) -> str:
        """A table with one row per kernel name (in first-launch order): launches, instructions, HBM MiB read +
        written, matmuls, mean PE fill, and modeled µs per target summed over its launches (see LEGEND)."""
        if not self._recorded.runs:
            return str(self)
        rows = collections.defaultdict(list)
        for run in self._recorded.runs:
            rows[run.name].append(run)
        header = (
            f"{'kernel':28s} {'launches':>8s} {'instr':>9s} {'HBM MiB':>9s} {'matmuls':>8s} {'PE fill':>7s} "
            f"{'T/V/S/G/D':>16s} {'trn1 us':>10s} {'trn2 us':>10s}"
        )
        lines = [header, "-" * len(header)]
        for kernel, runs in rows.items():
            matmuls = sum(r.matmul_count for r in runs)
            fill = sum(r.pe_fill * r.matmul_count for r in runs) / matmuls if matmuls else 0.0
            hbm = sum(r.hbm_bytes_read + r.hbm_bytes_written for r in runs) / 2**20
            # engine_counts lists the engines in T/V/S/G/D order, as the per-launch table prints them.
            engines = "/".join(
                str(sum(r.engine_counts.get(engine, 0) for r in runs)) for engine in runs[0].engine_counts
            )
            lines.append(
                f"{kernel:28s} {len(runs):8d} {sum(r.instructions for r in runs):9d} {hbm:9.2f} "
                f"{matmuls:8d} {fill:7.3f} {engines:>16s} "
                f"{sum(r.latency_us['trn1'] for r in runs):10.2f} "
                f"{sum(r.latency_us['trn2'] for r in runs):10.2f}"
            )
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
