"""SVD compression of dense weights and parameter trees, and checkpoint I/O for the compressed result.

  block_aligned_rank(k, n, keep, block=128)        rank for a kept-parameter fraction, aligned to the PE array
  truncated_svd(w, rank) -> (u, v)                 Eckart–Young optimal factors, u = U·√Σ, v = √Σ·Vᵀ
  whitened_svd(w, activations, rank) -> (u, v)     SVD-LLM truncation-aware whitening with calibration inputs
  whitening(x) / whitened_factors(w, S, rank)      the same, with the Cholesky factor S computed once per input
  output_whitening(G) / whitened_factors(..., out_chol=L)   the truncation also weighted by an output Gram G
  refit_v(u, x̃, y)                                 closed-form ridge update of v given u on calibration data
  allocate_ranks(losses, shapes, keep)              block-aligned ranks (or dense: allow_dense) under one budget,
                                                   by a Lagrangian price per parameter or exactly (solver=)
  compress_params(params, keep=|rank=, ...)        kernel → (u, v) over Linen / NNX trees, with a report
  quantize_fp8(w, axis=-1) -> (values, scale)      fp8 e4m3 (±240) values, one fp32 scale per output channel
  gptq_fp8(w, gram) -> (values, scale)             the same format, rounded with error feedback (GPTQ)
  prune_neurons(HᵀH, W_down, keep_count, M)        a gated MLP's neurons kept (greedy OBS), down_proj rows refit
  save_compressed / load_compressed                 safetensors + metadata + checksums, atomic writes

Weight math only: nothing here runs a model, and this package imports neither `jax_neuronmm.models`, `nn` nor
`pipeline`. How a model gets compressed with it (calibration, Fisher weighting, allocation, pruning, distillation)
is `jax_neuronmm.pipeline`.
"""

from jax_neuronmm.compress.allocation import allocate_ranks
from jax_neuronmm.compress.checkpoint import CheckpointError, CheckpointInfo, load_compressed, save_compressed
from jax_neuronmm.compress.params import DEFAULT_INCLUDE, CompressionReport, LayerReport, compress_params
from jax_neuronmm.compress.prune import prune_neurons
from jax_neuronmm.compress.quantize import FP8_DTYPE, FP8_MAX, dequantize_fp8, gptq_fp8, quantize_fp8
from jax_neuronmm.compress.refit import refit_v
from jax_neuronmm.compress.svd import (
    WhitenedFactors,
    WhiteningDampedWarning,
    block_aligned_rank,
    output_whitening,
    single_threaded_blas,
    truncated_svd,
    whitened_decomposition,
    whitened_factors,
    whitened_svd,
    whitened_svd_with_info,
    whitening,
)

__all__ = [
    "DEFAULT_INCLUDE",
    "FP8_DTYPE",
    "FP8_MAX",
    "CheckpointError",
    "CheckpointInfo",
    "CompressionReport",
    "LayerReport",
    "WhitenedFactors",
    "WhiteningDampedWarning",
    "allocate_ranks",
    "block_aligned_rank",
    "compress_params",
    "dequantize_fp8",
    "gptq_fp8",
    "load_compressed",
    "output_whitening",
    "prune_neurons",
    "quantize_fp8",
    "refit_v",
    "save_compressed",
    "single_threaded_blas",
    "truncated_svd",
    "whitened_decomposition",
    "whitened_factors",
    "whitened_svd",
    "whitened_svd_with_info",
    "whitening",
]
