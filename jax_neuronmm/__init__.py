"""jax_neuronmm: fused SVD-compressed matmuls for JAX, built for AWS Trainium.

`svd_matmul(x, u, v)` computes (x·u)·v and `svd_mlp(...)` a gated low-rank MLP,
each as one JAX primitive: XLA reference lowering everywhere, NKI kernels on
Trainium, or on the bundled CPU emulator with `use_backend("emulator")`.
"""

from jax_neuronmm import lowering as _lowering  # noqa: F401  (registers the lowerings)
from jax_neuronmm import nki_frontend as _nki_frontend
from jax_neuronmm.backend import BACKENDS, get_backend, set_backend, use_backend
from jax_neuronmm.profiling import KernelCall, Profile, profile
from jax_neuronmm.reference import svd_matmul_ref, svd_mlp_ref
from jax_neuronmm.svd_matmul import svd_matmul, svd_matmul_p
from jax_neuronmm.svd_mlp import svd_mlp, svd_mlp_p

_nki_frontend.install()

__version__ = "0.1.0"

__all__ = ["BACKENDS", "KernelCall", "Profile", "get_backend", "profile", "set_backend", "svd_matmul",
           "svd_matmul_p", "svd_matmul_ref", "svd_mlp", "svd_mlp_p", "svd_mlp_ref", "use_backend"]
