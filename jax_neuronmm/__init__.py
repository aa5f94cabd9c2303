"""jax_neuronmm: fused SVD-compressed matmuls for JAX, built for AWS Trainium.

`svd_matmul(x, u, v)` computes (x·u)·v, `svd_mlp(...)` a gated low-rank MLP and
`decode_step(...)` one decode step over every decoder layer, each as one JAX primitive: XLA reference lowering
everywhere, NKI kernels on
Trainium, or on the bundled CPU emulator with `use_backend("emulator")`. Each
op's module registers its own lowerings when imported.
"""

from jax_neuronmm import nki_frontend as _nki_frontend
from jax_neuronmm.backend import BACKENDS, get_backend, set_backend, use_backend
from jax_neuronmm.decode_step import decode_step, decode_step_p, decode_step_ref
from jax_neuronmm.profiling import Profile, profile
from jax_neuronmm.svd_matmul import svd_matmul, svd_matmul_p, svd_matmul_ref
from jax_neuronmm.svd_mlp import svd_mlp, svd_mlp_p, svd_mlp_ref
from jax_neuronmm.weights import Factored, Quantized

_nki_frontend.install()

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "Factored",
    "Profile",
    "Quantized",
    "decode_step",
    "decode_step_p",
    "decode_step_ref",
    "get_backend",
    "profile",
    "set_backend",
    "svd_matmul",
    "svd_matmul_p",
    "svd_matmul_ref",
    "svd_mlp",
    "svd_mlp_p",
    "svd_mlp_ref",
    "use_backend",
]
