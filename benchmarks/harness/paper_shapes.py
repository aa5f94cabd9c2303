"""The MLP shapes NeuronMM evaluates: what the shipped table is tuned for and the benchmarks report on."""

from __future__ import annotations

from nki_kernels.block_table import TUNED_TOKENS
from nki_kernels.ranks import block_aligned_rank

# MLP shapes (hidden H, intermediate I) of the models NeuronMM evaluates, and the kept-parameter ratio.
PAPER_MLP_SHAPES = {
    "Llama-3.2-1B": (2048, 8192),
    "Llama-3.2-3B": (3072, 8192),
    "Qwen3-1.7B": (2048, 6144),
    "Qwen3-4B": (2560, 9728),
    "Llama-3.1-8B": (4096, 14336),
}
PAPER_KEEP = 0.8


def paper_tuning_jobs(models=tuple(PAPER_MLP_SHAPES), tokens=TUNED_TOKENS):
    """(kind, shape) pairs of the shipped table: per model and T, the up/gate and down projections as fused
    matmuls and the two MLP kernels."""
    jobs = []
    for model in models:
        h, i = PAPER_MLP_SHAPES[model]
        r = block_aligned_rank(h, i, PAPER_KEEP)
        for t in tokens:
            jobs += [
                ("svd_matmul", (t, h, r, i)),
                ("svd_matmul", (t, i, r, h)),
                ("svd_mlp_gate_up", (t, h, r, i)),
                ("svd_mlp_down", (t, i, r, h)),
            ]
    return jobs
