"""CPU emulator of AWS's `nki` 0.6 dialect (numpy + ml_dtypes; never imports JAX).

`api` stands in for `nki`, `language` for `nki.language`, `isa` for `nki.isa` (`isa_constants` for
`nki.isa.constants`), `collectives` for `nki.collectives` (data exchanged between the
ranks of `simulate_spmd`, several NeuronCores; a plain launch is one rank). Kernels normally get
them through `nki_kernels.binding`; `as_nki()` lets unmodified kernel files `import nki`.

Modules by idea: `tensor` (storages and views; `tensor_views` the view-building methods), `isa` (the namespace)
over `isa_core` (copies, fills, element-wise basics and the shared checks), `isa_dma` (DMA), `isa_matmul` (TensorE),
`isa_vector` (fused and accumulating arithmetic), `isa_select` (predicates, masks, top-8), `isa_gather` (gathers,
shuffles, partition reductions) and `isa_control` (registers, random numbers, multi-core, trn3-only); `language`
with `language_math` and `language_control`; `cost_model` (modeled latency; `instruction_costs`,
`collective_costs` its documented figures); `spmd` (several ranks). Design notes and sources: docs/emulator.md.
"""

from . import api, isa, language, trace
from .context import count_only, use_target
from .errors import NkiCollectiveError, NkiDeadlockError, NkiHardwareError
from .kernel import Kernel, jit, output_specs, set_array_frontend, simulate
from .nki_import import as_nki
from .profile import profile
from .spmd import simulate_spmd

__all__ = [
    "Kernel",
    "NkiCollectiveError",
    "NkiDeadlockError",
    "NkiHardwareError",
    "api",
    "as_nki",
    "count_only",
    "isa",
    "jit",
    "language",
    "output_specs",
    "profile",
    "set_array_frontend",
    "simulate",
    "simulate_spmd",
    "trace",
    "use_target",
]
