"""The "fisher" step: each projection's output weighted by the Fisher information of the model's next-token
distribution, so that a whitened truncation minimizes (to second order, K-FAC) the KL divergence it causes rather
than its plain output error. `output_grams` gives G = Σ gᵀ·g per projection, g the gradient of log p(token) at its
output with the token drawn from the dense model; the truncation then uses its Cholesky factor
(`svd.whitened_factors(..., out_chol=L)`). The derivation is in docs/compression.md.
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

# Calibration windows whose sampled gradients make G (one forward and backward pass over the whole vocabulary each):
# enough positions to fill an MLP-wide G; more windows estimate it better at a cost linear in their count.
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
