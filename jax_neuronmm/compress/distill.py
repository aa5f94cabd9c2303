"""End-to-end distillation of a compressed CausalLM's SVD factors from the dense model's logits.

Only the factors (every SVDLinear's u and v, inside SVDMLP too) are trained; embeddings, norms and any projection
left dense stay frozen. The loss is the squared error of the centered logits, ‖(h̃ − h)·Eᵀ·C‖² with h̃, h the final
normed hidden states of the compressed and the dense model and E [V, hidden] the unembedding (C centers over the
vocabulary: softmax ignores a shift). It equals G-weighted hidden-state error with G = Eᵀ·C·E [hidden, hidden],
computed once, so the 262k-row LM head never runs during training and the dense model runs once, up front (final
logit soft-capping, where a model has it, is ignored by this loss). Runs on JAX's default device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from jax_neuronmm.compress import sequential
from jax_neuronmm.compress.local_finetune import check_adam_options


@dataclasses.dataclass(frozen=True)
class DistillOptions:
    """steps: Adam steps; batch: calibration sequences per step; learning_rate: relative to each factor's RMS
    (the update of a factor is about learning_rate·RMS(factor) per entry); seed: the order of sequences."""

    steps: int = 60
    batch: int = 2
    learning_rate: float = 2e-4
    seed: int = 0

    def __post_init__(self):
        check_adam_options(self)


def is_factor(path, value) -> bool:
    """nnx filter: the u / v parameters of SVDLinear layers."""
    return isinstance(value, nnx.Param) and bool(path) and path[-1] in ("u", "v")


def final_hidden(model, ids) -> jax.Array:
    """The final normed hidden states [B, T, hidden] of model on ids [B, T] (the LM head's input)."""
    x, positions, masks = sequential.calibration_batch(model, ids)
    for layer in model.layers:
        x = layer(x, positions, masks[layer.self_attn.spec.sliding_window], None, None)[0]
    return model.norm(x)


def logit_gram(model) -> jax.Array:
    """G = Eᵀ·C·E [hidden, hidden] (float32) for the model's unembedding E [V, hidden], C = I − 11ᵀ/V."""
    table = model.embed_tokens.embedding[...] if model.lm_head is None else model.lm_head.kernel[...].T
    table = jnp.asarray(table, jnp.float32)
    mean = jnp.mean(table, axis=0)
    return table.T @ table - table.shape[0] * jnp.outer(mean, mean)


def centered_logit_error(model, dense, ids) -> float:
    """‖centered logits(model) − centered logits(dense)‖² / ‖centered logits(dense)‖² on ids [B, T]."""
    gram = logit_gram(dense)
    diff = (final_hidden(model, ids) - final_hidden(dense, ids)).reshape(-1, gram.shape[0])
    target = final_hidden(dense, ids).reshape(-1, gram.shape[0])
    return float(jnp.sum((diff @ gram) * diff) / jnp.sum((target @ gram) * target))


def distill_factors(model, dense, calibration_ids, options: DistillOptions = DistillOptions(), *,
                    progress: bool = True, on_step: Callable[[int, object], None] | None = None) -> None:
    """Trains `model`'s factors in place for options.steps Adam steps towards `dense`'s logits on
    calibration_ids [B, T]; keeps the factors it started from if training raised the loss on the whole set.
    on_step(steps_done, model), when given, runs after every step with the model holding the current factors
    (to watch held-out loss)."""
    ids = np.asarray(calibration_ids, np.int32)
    gram = logit_gram(dense)
    targets = np.concatenate([np.asarray(_final_hidden_jit(dense, ids[i:i + 1])) for i in range(ids.shape[0])])
    energy = float(np.mean(np.einsum("bth,hg,btg->bt", targets, np.asarray(gram), targets)))
    graphdef, factors, rest = nnx.split(model, is_factor, ...)
    scales = jax.tree.map(lambda p: jnp.sqrt(jnp.mean(jnp.square(p))), factors)
    optimizer = optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(options.learning_rate))
    state = optimizer.init(factors)

    def loss_fn(factors, rest, batch_ids, batch_targets):
        hidden = final_hidden(nnx.merge(graphdef, factors, rest), batch_ids)
        diff = hidden - batch_targets
        return jnp.mean(jnp.einsum("bth,hg,btg->bt", diff, gram, diff)) / energy

    @jax.jit
    def step(factors, state, rest, batch_ids, batch_targets):
        loss, grads = jax.value_and_grad(loss_fn)(factors, rest, batch_ids, batch_targets)
        updates, state = optimizer.update(grads, state, factors)
        updates = jax.tree.map(lambda u, s: u * s, updates, scales)
        return optax.apply_updates(factors, updates), state, loss

    loss_jit = jax.jit(loss_fn)

    def full_loss(factors):
        return float(np.mean([loss_jit(factors, rest, ids[i:i + 1], targets[i:i + 1]) for i in range(ids.shape[0])]))

    start = jax.tree.map(lambda x: x, factors)  # detached: split's State shares the model's Variables
    rng = np.random.default_rng(options.seed)
    batch = min(options.batch, ids.shape[0])
    bar = tqdm(range(options.steps), desc="distilling factors", disable=not progress, unit="step")
    for done in bar:
        rows = rng.choice(ids.shape[0], batch, replace=False)
        factors, state, loss = step(factors, state, rest, ids[rows], targets[rows])
        bar.set_postfix(loss=f"{float(loss):.4f}")
        if on_step is not None:
            nnx.update(model, factors)
            on_step(done + 1, model)
    nnx.update(model, factors if full_loss(factors) < full_loss(start) else start)


@functools.partial(nnx.jit)
def _final_hidden_jit(model, ids):
    return final_hidden(model, ids)
