"""Flax modules whose weights are SVD factors or quantized values, calling the fused `svd_matmul` / `svd_mlp`.

NNX:   Linear (dense), SVDLinear (drop-in for nnx.Linear, `SVDLinear.from_linear`), SVDMLP (`SVDMLP.from_linears`),
       each in any `jax_neuronmm.weights.WeightFormat` (`layer.format`; `layer.quantized()` converts)
Linen: SVDDense (drop-in for nn.Dense, `SVDDense.params_from_dense`), SVDMLP (`SVDMLP.params_from_dense`)
The two SVDMLP classes are reached as `jax_neuronmm.nn.nnx.SVDMLP` and `jax_neuronmm.nn.linen.SVDMLP`.
"""

from jax_neuronmm.nn import linen, nnx
from jax_neuronmm.nn.linen import SVDDense
from jax_neuronmm.nn.nnx import SVDLinear

__all__ = ["SVDDense", "SVDLinear", "linen", "nnx"]
