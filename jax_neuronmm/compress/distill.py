"""End-to-end distillation of a compressed CausalLM's SVD factors from the dense model's logits.

Only the factors (every SVDLinear's u and v, inside SVDMLP too) are trained; embeddings, norms and any projection
left dense stay frozen. The dense model runs once, up front. The loss has two terms, both cheap next to the
262k-row LM head, which never runs during training:

  * the squared error of the centered logits over the whole vocabulary, ‖(h̃ − h)·Eᵀ·C‖², with h̃, h the final
    normed hidden states of the compressed and the dense model, E [V, hidden] the unembedding and C centering over
    the vocabulary (softmax ignores a shift): the G-weighted hidden-state error with G = Eᵀ·C·E [hidden, hidden],
    computed once (final logit soft-capping is ignored by this term), divided by the dense logits' energy;
  * the KL divergence from the teacher's to the student's next-token distribution restricted to the teacher's
    top-k tokens at each position (both renormalized over those k): the student's logits there are h̃ times k rows
    of E, k·hidden multiply-adds per token instead of V·hidden. It puts the weight where perplexity is decided,
    on the likely tokens; on Gemma 3 270M at keep 0.8 it took held-out perplexity from 1.48x to 1.39x dense
    (benchmarks/results/accuracy_report.md). top_k = 0 leaves it out.

Runs on JAX's default device.
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
    (the update of a factor is about learning_rate·RMS(factor) per entry); seed: the order of sequences;
    top_k: tokens per position of the KL term (0: the centered-logit error alone)."""

    steps: int = 90
    batch: int = 2
    learning_rate: float = 6e-4
    seed: int = 0
    top_k: int = 64

    def __post_init__(self):
        check_adam_options(self)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k: got {self.top_k!r}, expected a non-negative int")


# Sequences the before/after loss comparison at the end of training runs on (each costs a forward pass).
CHECK_SEQUENCES = 16


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
    table = _unembedding(model)
    mean = jnp.mean(table, axis=0)
    return table.T @ table - table.shape[0] * jnp.outer(mean, mean)


def centered_logit_error(model, dense, ids) -> float:
    """‖centered logits(model) − centered logits(dense)‖² / ‖centered logits(dense)‖² on ids [B, T]."""
    gram = logit_gram(dense)
    diff = (final_hidden(model, ids) - final_hidden(dense, ids)).reshape(-1, gram.shape[0])
    target = final_hidden(dense, ids).reshape(-1, gram.shape[0])
    return float(jnp.sum((diff @ gram) * diff) / jnp.sum((target @ gram) * target))


def distill_factors(
    model,
    dense,
    calibration_ids,
    options: DistillOptions = DistillOptions(),
    *,
    progress: bool = True,
    on_step: Callable[[int, object], None] | None = None,
) -> None:
    """Trains `model`'s factors in place for options.steps Adam steps towards `dense`'s logits on
    calibration_ids [B, T]; keeps the factors it started from if training raised the loss on the first
    CHECK_SEQUENCES sequences. on_step(steps_done, model), when given, runs after every step with the model
    holding the current factors (to watch held-out loss)."""
    ids = np.asarray(calibration_ids, np.int32)
    gram = logit_gram(dense)
    targets = np.concatenate([np.asarray(_final_hidden_jit(dense, ids[i : i + 1])) for i in range(ids.shape[0])])
    energy = float(np.mean(np.einsum("bth,hg,btg->bt", targets, np.asarray(gram), targets)))
    table = _unembedding(dense)
    cap = getattr(dense.config, "final_logit_softcapping", None)
    # The teacher's top-k logits and token ids [B, T, k], one sequence at a time (its full logits are B·T·V).
    teacher = None
    if options.top_k:
        k = min(options.top_k, table.shape[0])
        top = [_top_logits(jnp.asarray(targets[i]), table, cap, k) for i in range(ids.shape[0])]
        teacher = tuple(np.stack([np.asarray(pair[part]) for pair in top]) for part in (0, 1))
    graphdef, factors, rest = nnx.split(model, is_factor, ...)
    scales = jax.tree.map(lambda p: jnp.sqrt(jnp.mean(jnp.square(p))), factors)
    optimizer = optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(options.learning_rate))
    state = optimizer.init(factors)

    def loss_fn(factors, rest, batch_ids, batch_targets, batch_teacher):
        hidden = final_hidden(nnx.merge(graphdef, factors, rest), batch_ids)
        diff = hidden - batch_targets
        loss = jnp.mean(jnp.einsum("bth,hg,btg->bt", diff, gram, diff)) / energy
        if batch_teacher is not None:
            teacher_logits, token_ids = batch_teacher
            student_logits = _capped(jnp.einsum("bth,btkh->btk", hidden, table[token_ids]), cap)
            teacher_log_p = jax.nn.log_softmax(teacher_logits, axis=-1)
            kl = jnp.sum(
                jnp.exp(teacher_log_p) * (teacher_log_p - jax.nn.log_softmax(student_logits, axis=-1)), axis=-1
            )
            loss = loss + jnp.mean(kl)
        return loss

    def rows_of(rows):
        return ids[rows], targets[rows], None if teacher is None else tuple(part[rows] for part in teacher)

    @jax.jit
    def step(factors, state, rest, batch):
        loss, grads = jax.value_and_grad(loss_fn)(factors, rest, *batch)
        updates, state = optimizer.update(grads, state, factors)
        updates = jax.tree.map(lambda u, s: u * s, updates, scales)
        return optax.apply_updates(factors, updates), state, loss

    loss_jit = jax.jit(loss_fn)

    def check_loss(factors):
        checked = range(min(CHECK_SEQUENCES, ids.shape[0]))
        return float(np.mean([loss_jit(factors, rest, *rows_of(slice(i, i + 1))) for i in checked]))

    start = jax.tree.map(lambda x: x, factors)  # detached: split's State shares the model's Variables
    rng = np.random.default_rng(options.seed)
    batch = min(options.batch, ids.shape[0])
    bar = tqdm(range(options.steps), desc="distilling factors", disable=not progress, unit="step")
    for done in bar:
        factors, state, loss = step(factors, state, rest, rows_of(rng.choice(ids.shape[0], batch, replace=False)))
        bar.set_postfix(loss=f"{float(loss):.4f}")
        if on_step is not None:
            nnx.update(model, factors)
            on_step(done + 1, model)
    nnx.update(model, factors if check_loss(factors) < check_loss(start) else start)


@functools.partial(nnx.jit)
def _final_hidden_jit(model, ids):
    return final_hidden(model, ids)


def _unembedding(model) -> jax.Array:
    """E [V, hidden] float32: the LM head's rows, or the token embedding when they are tied."""
    table = model.embed_tokens.embedding[...] if model.lm_head is None else model.lm_head.kernel[...].T
    return jnp.asarray(table, jnp.float32)


def _capped(logits, cap):
    return logits if cap is None else jnp.tanh(logits / cap) * cap


@functools.partial(jax.jit, static_argnums=(2, 3))
def _top_logits(hidden, table, cap, k):
    """The k largest logits [T, k] of hidden [T, hidden] and their token ids [T, k]."""
    return jax.lax.top_k(_capped(hidden @ table.T, cap), k)
