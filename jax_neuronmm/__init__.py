"""jax_neuronmm: fused SVD-compressed matmuls for JAX, built for AWS Trainium.

`svd_matmul(x, u, v)` computes (x·u)·v and `svd_mlp(...)` a gated low-rank MLP,
each as one JAX primitive: XLA reference lowering everywhere, NKI kernels on
Trainium (or on the bundled CPU emulator on request).
"""

from jax_neuronmm import lowering as _lowering  # noqa: F401  (registers the lowerings)
from jax_neuronmm.reference import svd_matmul_ref, svd_mlp_ref
from jax_neuronmm.svd_matmul import svd_matmul, svd_matmul_p
from jax_neuronmm.svd_mlp import svd_mlp, svd_mlp_p

__version__ = "0.1.0"

__all__ = ["svd_matmul", "svd_matmul_p", "svd_matmul_ref", "svd_mlp", "svd_mlp_p", "svd_mlp_ref"]
