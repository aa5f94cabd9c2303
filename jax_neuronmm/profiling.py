"""`jax_neuronmm.profile()`: what the NKI kernels did when run on the emulator backend.

    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        y = jitted_model(x).block_until_ready()
    print(prof)            # one row per kernel launch, then totals
    prof.calls[0].modeled_us["trn1"]

Kernels run inside host callbacks when the computation executes: block on the
results inside the `with` (`.block_until_ready()`); a launch that has not run by
the time the block exits is not recorded.
"""

import contextlib
import dataclasses

from nki_kernels import emulator


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
