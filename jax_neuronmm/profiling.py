"""`jax_neuronmm.profile()`: what the NKI kernels did when run on the emulator backend.

    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        y = jitted_model(x).block_until_ready()
    print(prof)            # one row per kernel launch, then totals
    prof.runs[0].latency_us["trn1"]

The names are the emulator's (`nki_kernels.emulator.profile`), one vocabulary on both sides: `prof.runs` holds
one summary per launch (`name`, `hbm_bytes_read`, `hbm_bytes_written`, `dma_count`, `matmul_count`,
`instructions`, `pe_fill`, `latency_us[target]`, ...), and `prof` has the same totals (`hbm_bytes_read`,
`matmul_count`, `latency_us`, ...).

Kernels run inside host callbacks when the computation executes: block on the
results inside the `with` (`.block_until_ready()`); a launch that has not run by
the time the block exits is not recorded.
"""

import contextlib

from nki_kernels import emulator


class Profile:
    """The emulator's profile of the launches inside `profile()`, read through (same attributes), with a hint
    in `str()` when no kernel ran."""

    def __init__(self, recorded):
        self._recorded = recorded  # the emulator's profile, filled as kernels finish

    def __getattr__(self, name):
        return getattr(self._recorded, name)

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
