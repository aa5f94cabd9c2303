"""The output side of the whitened truncation: each projection's output weighted by the Fisher information of the
model's next-token distribution (the "fisher" step of compress_model).

Whitening alone (SVD-LLM) minimizes a projection's output error ‖X·ΔW‖ on calibration inputs X, every output
direction weighted alike. The model does not weigh them alike: Gemma 3 normalizes the MLP's output before adding it
to the residual stream, so an error along the output itself costs nothing, and most output directions barely move
the next-token distribution. To second order the KL divergence from the dense model's distribution to that of a
model whose projection y = x·W became x·(W + ΔW) is ½·E[(g·(x·ΔW)ᵀ)²], g the gradient of log p(token) at the
projection's output, the token drawn from the model's own distribution (the Fisher information). Taking inputs and
gradients as independent (the Kronecker factorization of K-FAC) this is ½·tr(ΔWᵀ·A·ΔW·G), A = XᵀX the whitening's
Gram matrix and G = Σ gᵀ·g over the calibration positions (`output_grams`); the best rank-r W + ΔW is the truncated
SVD of Sᵀ·W·L with A = S·Sᵀ, G = L·Lᵀ (`svd.whitened_factors(..., out_chol=L)`).

On Gemma 3 270M, every MLP projection at rank 384 (keep 0.8), whitened by the dense model's inputs on 48 calibration
windows, no other step: 1.781x / 2.026x dense perplexity on the accuracy report's held-out novel / technical text,
and with G from 24 windows (damping 1e-3) 1.459x / 1.343x (benchmarks/results/accuracy_report.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jax_neuronmm.compress.projections import layer_projections
from jax_neuronmm.decoder_math import soft_cap
from jax_neuronmm.pipeline import distill

# Calibration windows whose sampled gradients make G: on Gemma 3 270M 24 windows (6,144 positions, enough to fill a
# 2048-wide G) take about 95 s on 2 CPU cores with the compilation (about 40 s of it), a forward and backward pass
# over the whole vocabulary each. More windows measure better (fisher + allocate at keep 0.8, before distillation:
# 12 windows 1.426x / 1.363x, 24 1.349x / 1.322x, 48 1.301x / 1.274x) at about 4 s a window.
DEFAULT_WINDOWS = 24


class _Perturbed(nnx.Module):
    """A projection whose output gets `delta` [n, N] added (reshaped to the output's leading shape): the gradient
    with respect to delta, at 0, is the gradient at the projection's output."""

    def __init__(self, inner: nnx.Module, delta):
        self.inner = inner
        self.delta = delta

    def __call__(self, x):
        y = self.inner(x)
        return y + self.delta.reshape(y.shape)


def output_grams(dense, calibration_ids, include, *, windows: int = DEFAULT_WINDOWS, seed: int = 0, progress=True):
    """{(layer index, projection name): G [N, N] float64}: Σ gᵀ·g over every position of the first `windows`
    windows of calibration_ids [B, T] (all B when fewer), g [N] the gradient of log p(y_t) at the projection's
    output, with y_t drawn from the dense model's own next-token distribution at each position (seed). One forward
    and backward pass of `dense` per window, logits over the whole vocabulary."""
    ids = np.asarray(calibration_ids, np.int32)
    if not isinstance(windows, int) or isinstance(windows, bool) or windows < 1:
        raise ValueError(f"windows: got {windows!r}, expected a positive int")
    targets = layer_projections(len(dense.layers), include)
    graphdef, state = nnx.split(dense)
    table = distill.unembedding(dense)
    cap = getattr(dense.config, "final_logit_softcapping", None)
    widths = [getattr(getattr(dense.layers[i], parent), name).kernel.shape[-1] for i, parent, name in targets]

    def log_likelihood(deltas, state, window, key):
        model = nnx.merge(graphdef, state)
        for (index, parent, name), delta in zip(targets, deltas):
            module = getattr(model.layers[index], parent)
            setattr(module, name, _Perturbed(getattr(module, name), delta))
        logits = soft_cap(distill.final_hidden(model, window)[0] @ table.T, cap)
        tokens = jax.random.categorical(key, jax.lax.stop_gradient(logits), axis=-1)
        return jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1))

    @jax.jit
    def accumulate(grams, state, window, key):
        zeros = [jnp.zeros((window.shape[1], n), jnp.float32) for n in widths]
        grads = jax.grad(log_likelihood)(zeros, state, window, key)
        return [gram + g.T @ g for gram, g in zip(grams, grads)]

    grams = [jnp.zeros((n, n), jnp.float32) for n in widths]
    keys = jax.random.split(jax.random.PRNGKey(seed), len(ids))
    for i in tqdm(range(min(windows, len(ids))), desc="output Fisher", disable=not progress, unit="window"):
        grams = accumulate(grams, state, jnp.asarray(ids[i : i + 1]), keys[i])
    return {(index, name): np.asarray(gram, np.float64) for (index, _, name), gram in zip(targets, grams)}
