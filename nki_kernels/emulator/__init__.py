"""CPU emulator of AWS's `nki` 0.6 dialect (numpy + ml_dtypes; never imports JAX).

`api` stands in for `nki`, `language` for `nki.language`, `isa` for `nki.isa` (`isa_constants` for
`nki.isa.constants`), `collectives` for `nki.collectives` (data exchanged between the
ranks of `simulate_spmd`, several NeuronCores; a plain launch is one rank). Kernels normally get
them through `nki_kernels.binding`; `as_nki()` lets unmodified kernel files `import nki`.

Instruction modules by idea: `isa` (data movement, TensorE, element-wise basics), `isa_vector` (fused and
accumulating arithmetic, bn_stats), `isa_select` (predicates, masks, top-8), `isa_gather` (gathers, shuffles,
partition reductions, top-k), `isa_control` (registers, random numbers, DMA compute, multi-core, trn3-only);
`language` with `language_math` (softmax, rms_norm, where, ...) and `language_control` (register loops,
constants). `instruction_costs` holds the documented per-instruction costs the cost model consults,
`collective_costs` the documented link figures it prices collectives with. `spmd` runs a kernel on several
ranks (`simulate_spmd`): a thread and a KernelContext per rank, a rendezvous per collective call.
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
