"""SVD compression of dense weights and parameter trees, and checkpoint I/O for the compressed result.

  block_aligned_rank(k, n, keep, block=128)        rank for a kept-parameter fraction, aligned to the PE array
  truncated_svd(w, rank) -> (u, v)                 Eckart–Young optimal factors, u = U·√Σ, v = √Σ·Vᵀ
  whitened_svd(w, activations, rank) -> (u, v)     SVD-LLM truncation-aware whitening with calibration inputs
  compress_params(params, keep=|rank=, ...)        kernel → (u, v) over Linen / NNX trees, with a report
  save_compressed / load_compressed                 safetensors + metadata + checksums, atomic writes
"""

from jax_neuronmm.compress.checkpoint import CheckpointError, CheckpointInfo, load_compressed, save_compressed
from jax_neuronmm.compress.params import DEFAULT_INCLUDE, CompressionReport, LayerReport, compress_params
from jax_neuronmm.compress.svd import (
    WhitenedFactors,
    WhiteningDampedWarning,
    block_aligned_rank,
    truncated_svd,
    whitened_svd,
    whitened_svd_with_info,
)

__all__ = [
    "DEFAULT_INCLUDE",
    "CheckpointError",
    "CheckpointInfo",
    "CompressionReport",
    "LayerReport",
    "WhitenedFactors",
    "WhiteningDampedWarning",
    "block_aligned_rank",
    "compress_params",
    "load_compressed",
    "save_compressed",
    "truncated_svd",
    "whitened_svd",
    "whitened_svd_with_info",
]
