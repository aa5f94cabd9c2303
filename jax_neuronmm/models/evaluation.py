"""Teacher-forced next-token predictions of a causal LM on token windows, and perplexity: the one definition the
examples, the benchmarks and the quality metrics (models.quality) share.

Each window of L tokens gives L − 1 predictions (token t + 1 from tokens 0..t of the same window; no context is
carried between windows). Log-softmax runs in float32 on the logits cast to float32; perplexity = exp(mean
next-token negative log-likelihood), averaged in float64 on the host.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.validation import check_token_ids


@dataclasses.dataclass(frozen=True)
class Predictions:
    """Teacher-forced predictions on windows [W, L]: log_likelihood [W, L-1] (float64 from float32) of each actual
    next token, and top1 [W, L-1], the most likely next token at each position."""

    log_likelihood: np.ndarray
    top1: np.ndarray

    @property
    def perplexity(self) -> float:
        return math.exp(-float(np.mean(self.log_likelihood)))


@nnx.jit
def window_predictions(model, ids):
    """(log-likelihood [W, L-1] float32 of each next token, argmax [W, L-1]) of windows ids [W, L] (no checks)."""
    logp = jax.nn.log_softmax(model(ids[:, :-1]).astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0], jnp.argmax(logp, axis=-1)


def perplexity(model: CausalLM, ids, *, batch_size: int = 1) -> float:
    """exp(mean next-token NLL) of `model` on ids [W, L] (W windows of L >= 2 token ids; [L] is one window):
    `predictions(model, ids, batch_size=batch_size).perplexity`."""
    return predictions(model, ids, batch_size=batch_size).perplexity


def predictions(model: CausalLM, ids, *, batch_size: int = 1) -> Predictions:
    """`model`'s teacher-forced Predictions on ids [W, L] (W windows of L >= 2 token ids; [L] is one window).

    Each window is scored on its own from its first token, over all W·(L − 1) predictions. batch_size: windows per
    forward pass (memory against speed; the result differs only by float32 rounding).

    Raises TypeError for a model that is not a jax_neuronmm.models CausalLM or a batch_size that is not an int, and
    ValueError naming `ids` for ids that are not integers of shape [W, L] with W >= 1 and L >= 2, or that lie
    outside [0, vocab_size); batch_size < 1 is a ValueError too.
    """
    if not isinstance(model, CausalLM):
        raise TypeError(f"perplexity: model: got {type(model).__name__}, expected a jax_neuronmm.models CausalLM")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise TypeError(f"perplexity: batch_size: got {batch_size!r}, expected an int >= 1")
    if batch_size < 1:
        raise ValueError(f"perplexity: batch_size: got {batch_size}, expected an int >= 1")
    try:
        windows = np.asarray(ids)
    except ValueError as error:  # numpy's "inhomogeneous shape"
        raise ValueError("perplexity: ids: windows of different lengths; expected int [W, L]") from error
    if windows.ndim == 1:
        windows = windows[None]
    if windows.ndim != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(
            f"perplexity: ids: got shape {windows.shape}, expected [W, L] (or [L]) with W >= 1 windows of L >= 2 "
            "tokens (a window of L tokens gives L - 1 predictions)"
        )
    if not np.issubdtype(windows.dtype, np.integer):
        raise ValueError(f"perplexity: ids: got dtype {windows.dtype}, expected integer token ids")
    windows = check_token_ids(windows, model.config.vocab_size, name="perplexity: ids")
    parts = [
        window_predictions(model, jnp.asarray(windows[start : start + batch_size]))
        for start in range(0, windows.shape[0], batch_size)
    ]
    return Predictions(
        np.concatenate([np.asarray(part[0], np.float64) for part in parts]),
        np.concatenate([np.asarray(part[1]) for part in parts]),
    )
