"""CPU emulator of AWS's `nki` 0.6 dialect (numpy + ml_dtypes; never imports JAX).

`api` stands in for `nki`, `language` for `nki.language`, `isa` for `nki.isa`. Kernels normally get
them through `nki_kernels.binding`; `as_nki()` lets unmodified kernel files `import nki`.
"""

from . import api, isa, language, trace
from .nki_import import as_nki
from .context import count_only, use_target
from .errors import NkiHardwareError
from .kernel import Kernel, jit, output_specs, set_array_frontend, simulate
from .profile import profile

__all__ = ["Kernel", "NkiHardwareError", "api", "as_nki", "count_only", "isa", "jit", "language",
           "output_specs", "profile", "set_array_frontend", "simulate", "trace", "use_target"]
