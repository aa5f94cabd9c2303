"""Structured pruning of a gated MLP's intermediate neurons: keep some of them whole in gate, up and down.

A gated MLP y = h·W_down with h = act(x·W_gate) * (x·W_up) [n, I] is a sum over its I neurons, so dropping a set of
them removes their columns of W_gate and W_up and their rows of W_down: the MLP stays a dense gated MLP, I' wide.
The rows of W_down that stay are refit in closed form to the dense output on calibration activations (least
squares over the kept neurons' h), and the neurons are chosen greedily, one at a time, by the optimal brain surgeon
rule for rows: removing neuron j from the kept set K (the others refit) adds

    w_j · M · w_jᵀ / [(H_Kᵀ·H_K)⁻¹]_jj

to the output error Σ_t (y_t − ŷ_t)·M·(y_t − ŷ_t)ᵀ, w_j the current (refit) row j of W_down and M [N, N] an output
metric (the identity for the squared error; `pipeline.fisher.output_grams` for the error's effect on the model's
log-likelihood). Each removal updates the refit rows and the inverse Gram matrix in rank one, so choosing I − I'
neurons costs O((I − I')·I·(I + N)). With `per_round` > 1, each round removes the per_round neurons of least cost
together and refits the others exactly for that set (a rank-per_round update): per_round times fewer updates of the
[I, I] inverse, for choices that ignore how removing one neuron of a round changes the others' costs.

Everything runs on the host in float64 numpy.
"""

from __future__ import annotations

import numbers

import numpy as np
from flax import nnx

from jax_neuronmm.compress.gram import check_gram, damped_cholesky

# Relative damping of the activations' Gram matrix HᵀH: a neuron that never fires on the calibration text has a zero
# row there.
DEFAULT_DAMPING = 1e-4


class PrunedKernel(nnx.Param):
    """A pruned MLP's kernel (pipeline.pruning): a dense weight that end-to-end distillation trains like SVD factors."""


def _check_keep_count(keep_count, width: int) -> None:
    if isinstance(keep_count, bool) or not isinstance(keep_count, numbers.Integral) or not 0 < keep_count <= width:
        raise ValueError(f"keep_count: got {keep_count!r}, expected an int in [1, {width}] (the MLP is {width} wide)")


def prune_neurons(
    gram, down, keep_count: int, output_gram=None, *, damping: float = DEFAULT_DAMPING, per_round: int = 1
):
    """(kept [keep_count] sorted neuron indices, refit down rows [keep_count, N] float64).

    gram: HᵀH [I, I] of the MLP's gated activations h on calibration tokens (damped by damping·mean(diag) on its
    diagonal); down: W_down [I, N]; output_gram: M [N, N], positive semi-definite, used as given (None: the squared
    error, M = I), undamped (damping it as `svd.output_whitening` damps it for factors measured worse here);
    per_round: neurons removed together per round (1: one at a time, each the cheapest given every
    removal before it). A gram that is not finite, symmetric and (damped) positive definite is a ValueError naming
    it (`compress.gram`).
    """
    weights = np.array(down, np.float64)
    width = weights.shape[0] if weights.ndim == 2 else -1
    if weights.ndim != 2 or np.shape(gram) != (width, width):
        raise ValueError(f"gram {np.shape(gram)} and down {weights.shape}: expected gram [I, I] and down [I, N]")
    gram = check_gram("prune_neurons", gram, width)
    _check_keep_count(keep_count, width)
    if not (isinstance(damping, numbers.Real) and np.isfinite(damping) and damping >= 0):
        raise ValueError(f"damping: got {damping!r}, expected a finite number >= 0")
    if isinstance(per_round, bool) or not isinstance(per_round, numbers.Integral) or per_round < 1:
        raise ValueError(f"per_round: got {per_round!r}, expected a positive int")
    outputs = weights.shape[1]
    if output_gram is None:
        metric = np.eye(outputs)
    else:
        metric = np.asarray(output_gram, np.float64)
        if metric.shape != (outputs, outputs):
            raise ValueError(f"output_gram: got shape {metric.shape}, expected [{outputs}, {outputs}] (down's N)")
    inverse = np.linalg.inv(damped_cholesky("prune_neurons", gram, damping)[0])
    weighted = weights @ metric  # rows w_j·M, updated alongside the refit rows
    alive = np.ones(width, bool)
    for remaining in range(width - keep_count, 0, -per_round):
        diagonal = np.where(alive, np.diag(inverse), 1.0)
        cost = np.where(alive, np.einsum("in,in->i", weights, weighted) / diagonal, np.inf)
        gone = np.argsort(cost, kind="stable")[: min(per_round, remaining)]
        # Refit the kept rows: the removed rows' contributions move onto them along the inverse's columns `gone`.
        step = inverse[:, gone] @ np.linalg.inv(inverse[np.ix_(gone, gone)])
        weights -= step @ weights[gone]
        weighted -= step @ weighted[gone]
        inverse -= step @ inverse[gone]
        weights[gone], weighted[gone], inverse[gone], inverse[:, gone] = 0.0, 0.0, 0.0, 0.0
        alive[gone] = False
    kept = np.flatnonzero(alive)
    return kept, weights[kept]
