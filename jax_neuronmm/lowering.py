"""Lowering rules: one XLA reference lowering for every platform, plus overrides.

Like JAX's own `lu_p`: the reference lowering (`reference.py`, two dots with
float32 accumulation) serves every platform; a platform can override it. The
`neuron` override (NKI kernels through NKI's JAX integration) is registered by
`register_platform_lowering` once the Neuron PJRT plugin is present.
"""

from jax_neuronmm import reference
from jax_neuronmm._compat import lower_fun, register_lowering
from jax_neuronmm.svd_matmul import svd_matmul_p
from jax_neuronmm.svd_mlp import svd_mlp_p


def _svd_matmul_xla(x, u, v, *, n_batch, precision, out_dtype):
    return reference.svd_matmul_ref(x, u, v, n_batch=n_batch, precision=precision, out_dtype=out_dtype)


def _svd_mlp_xla(*operands, **params):
    return reference.svd_mlp_ref(*operands, **params)


register_lowering(svd_matmul_p, lower_fun(_svd_matmul_xla, multiple_results=False))
register_lowering(svd_mlp_p, lower_fun(_svd_mlp_xla, multiple_results=False))


def register_platform_lowering(primitive, platform, rule):
    """Extension point: replaces the reference lowering of `primitive` on `platform`.

    `rule` is an MLIR lowering rule `(ctx, *operands, **params) -> results`.
    """
    register_lowering(primitive, rule, platform=platform)
