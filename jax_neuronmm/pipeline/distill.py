"""The "distill" step: end-to-end fine-tuning of a compressed CausalLM's compressed weights (`is_trained`: SVD
factors and pruned MLP kernels; everything else frozen) towards the dense model's next-token distributions.

The dense model runs once and its final hidden states are cached. The loss (`DistillOptions.loss`) is "kl", the KL
divergence from teacher to student over the vocabulary rows the teacher finds likely somewhere in the training
windows (`likely_rows`, the head `vocab_chunk` rows at a time), or "topk", the centered-logit error plus the KL over
the teacher's top tokens. Adam with warm-up, cosine decay and clipping; the factors of the step with the lowest loss
on `holdout` held-out windows are kept. docs/compression.md says why each choice. Runs on JAX's default device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from jax_neuronmm.compress.prune import PrunedKernel
from jax_neuronmm.compress.quantize import WEIGHT_DTYPES, dequantize_fp8, quantize_fp8
from jax_neuronmm.decoder_math import soft_cap
from jax_neuronmm.pipeline import sequential
from jax_neuronmm.pipeline.local_finetune import check_adam_options

LOSSES = ("kl", "topk")
SCHEDULES = ("cosine", "constant")


@dataclasses.dataclass(frozen=True)
class DistillOptions:
    """Distillation settings.

    steps: Adam steps; batch: training windows per step; learning_rate: Adam's peak step size, reached after
    `warmup` steps of linear warm-up, relative to each factor's RMS when `relative` (the factors of whitened SVD
    differ in scale by orders of magnitude across layers and projections, so one absolute step size fits few of
    them), else absolute; pruned_learning_rate: the same for pruned MLP kernels (they start as the dense model's own
    neurons, nearer where training ends than SVD factors, so they take smaller steps); schedule: after the warm-up,
    "cosine" (decays to 0 at the last step: the last steps' factors are the least noisy) or "constant"; clip_norm:
    global gradient-norm clipping (0: none); loss: one of LOSSES; positions: positions per window of the "kl" loss
    (0: every position); vocab_top_k: the "kl" loss runs over the vocabulary rows among the teacher's vocab_top_k
    most likely tokens at some sampled position of the training windows (`likely_rows`; 0: the whole vocabulary);
    vocab_chunk: LM-head rows per chunk of the "kl" loss; top_k: tokens per position of the "topk" loss's KL term
    (0: the centered-logit error alone); holdout: training windows held out to choose which step's factors to keep
    (0: keep the last step's); eval_every: steps between held-out measurements; seed: window order and sampled
    positions; weight_dtype: None, or "float8_e4m3": every forward pass sees the factors rounded to fp8 as
    compress_model with Recipe(weight_dtype=...) stores them (`quantize_fp8`, a scale per column), the gradient
    passed straight through the rounding to the float factors, so training corrects the error the rounding adds (the
    kept factors are float; round them after). anchor: weight of a pull toward the starting weights (L2-SP, Li et al.
    2018): the loss adds anchor times the mean over trained weights of ||w - w0||² / ||w0||², against a small
    training text moving the factors away from a truncation that fits every kind of text alike; 0: none (the
    default: on text no step saw it did not help, benchmarks/results/generalization.md).
    """

    steps: int = 480
    batch: int = 1
    learning_rate: float = 2e-3
    pruned_learning_rate: float = 5e-4
    relative: bool = True
    warmup: int = 20
    schedule: str = "cosine"
    clip_norm: float = 1.0
    loss: str = "kl"
    positions: int = 0
    vocab_top_k: int = 64
    vocab_chunk: int = 16384
    top_k: int = 64
    holdout: int = 4
    eval_every: int = 40
    seed: int = 0
    weight_dtype: str | None = None
    anchor: float = 0.0

    def __post_init__(self):
        # steps, batch and the step sizes: the checks local fine-tuning's options share
        check_adam_options(self, rates=("learning_rate", "pruned_learning_rate"))
        for name in ("vocab_chunk", "eval_every"):
            _check_int(name, getattr(self, name), 1)
        for name in ("warmup", "positions", "vocab_top_k", "top_k", "holdout", "seed"):
            _check_int(name, getattr(self, name), 0)
        for name in ("clip_norm", "anchor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"DistillOptions.{name}: got {value!r}, expected a finite number >= 0")
        if not isinstance(self.relative, bool):
            raise ValueError(f"DistillOptions.relative: got {self.relative!r}, expected a bool")
        if self.loss not in LOSSES:
            raise ValueError(f"DistillOptions.loss: got {self.loss!r}, expected one of {LOSSES}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"DistillOptions.schedule: got {self.schedule!r}, expected one of {SCHEDULES}")
        if self.weight_dtype is not None and self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"DistillOptions.weight_dtype: got {self.weight_dtype!r}, expected None or one of {WEIGHT_DTYPES}"
            )


def _check_int(name, value, low):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(
            f"DistillOptions.{name}: got {value!r}, expected {'a positive' if low else 'a non-negative'} int"
        )


def is_trained(path, value) -> bool:
    """nnx filter: what distillation trains, the u / v parameters of SVDLinear layers and pruned MLPs' kernels."""
    return isinstance(value, PrunedKernel) or (isinstance(value, nnx.Param) and bool(path) and path[-1] in ("u", "v"))


def fp8_rounded(w) -> jax.Array:
    """w [K, N] as its fp8 round-to-nearest with a scale per column (`quantize_fp8`, dequantized) in the forward
    pass; the gradient passes straight through (the rounding's derivative taken as 1)."""
    values, scale = quantize_fp8(w)
    return w + jax.lax.stop_gradient(dequantize_fp8(values, scale, dtype=w.dtype) - w)


def final_hidden(model, ids) -> jax.Array:
    """The final normed hidden states [B, T, hidden] of model on ids [B, T] (the LM head's input)."""
    x, positions, masks = sequential.calibration_batch(model, ids)
    for layer in model.layers:
        x = layer(x, positions, masks[layer.self_attn.spec.sliding_window], None, None)[0]
    return model.norm(x)


def unembedding(model) -> jax.Array:
    """E [V, hidden] float32: the LM head's rows, or the token embedding when they are tied."""
    table = model.embed_tokens.embedding[...] if model.lm_head is None else model.lm_head.kernel[...].T
    return jnp.asarray(table, jnp.float32)


def factored_head(model):
    """(u [hidden, r], v [r, V]) of a model whose LM head is factored (an SVDLinear), else None."""
    head = model.lm_head
    return None if head is None or not hasattr(head, "u") else (head.u[...], head.v[...])


def logit_gram(table) -> jax.Array:
    """G = Eᵀ·C·E [hidden, hidden] (float32) for an unembedding E [V, hidden], C = I − 11ᵀ/V: the centered logits'
    squared error of a hidden-state difference d is d·G·dᵀ."""
    mean = jnp.mean(table, axis=0)
    return table.T @ table - table.shape[0] * jnp.outer(mean, mean)


def centered_logit_error(model, dense, ids) -> float:
    """‖centered logits(model) − centered logits(dense)‖² / ‖centered logits(dense)‖² on ids [B, T]."""
    gram = logit_gram(unembedding(dense))
    diff = (final_hidden(model, ids) - final_hidden(dense, ids)).reshape(-1, gram.shape[0])
    target = final_hidden(dense, ids).reshape(-1, gram.shape[0])
    return float(jnp.sum((diff @ gram) * diff) / jnp.sum((target @ gram) * target))


# A logit no softmax weighs (rows a chunk does not count); finite so that their differences are 0, not inf - inf.
_PADDED_LOGIT = -1e30


def vocab_kl(student_hidden, teacher_hidden, table, cap: float | None, chunk: int, student_head=None) -> jax.Array:
    """KL(softmax(teacher logits) ‖ softmax(student logits)) per row [n], over the whole vocabulary.

    student_hidden, teacher_hidden: [n, hidden]; table: the teacher's unembedding E [V, hidden]; teacher logits =
    soft_cap(hidden·Eᵀ, cap); the student's are the same with E, or, with student_head = (u [hidden, r],
    v [r, V]) (a factored LM head, v trained), soft_cap(hidden·u·v, cap). The teacher side is not differentiated.

    The vocabulary is walked `chunk` rows at a time, so the forward pass computes n x chunk logits at a time; it
    keeps them for the backward pass (2·n·V floats), which then needs one n x V x hidden product (two with a
    factored head) beside the forward pass's two: the gradient of KL in the student's logits is
    softmax(student) − softmax(teacher), written out (`_chunked_kl`'s rule) rather than derived through the
    chunked log-sum-exps, whose derived backward pass ran about 10x slower than the forward pass on CPU.
    """
    teacher_hidden = jax.lax.stop_gradient(teacher_hidden)
    if student_head is None:  # the student's logits are hidden·Eᵀ, like the teacher's; E is frozen
        return _chunked_kl(student_hidden, table, teacher_hidden, table, cap, chunk, False)
    u, v = student_head  # the student's logits are (hidden·u)·v: v's columns are the head's rows
    return _chunked_kl(student_hidden @ u, v.T, teacher_hidden, table, cap, chunk, True)


def _chunk_starts(vocab: int, chunk: int):
    """(rows per chunk, at most vocab; first rows of the vocabulary's chunks [count]; which of each chunk's rows it
    counts [count, chunk]): the last chunk starts at vocab − chunk (so no [V, ·] table is copied into padded
    chunks), and the rows it shares with the chunk before are counted there."""
    chunk = min(chunk, vocab)
    count = -(-vocab // chunk)
    first = np.arange(count) * chunk
    starts = np.minimum(first, vocab - chunk)
    counted = starts[:, None] + np.arange(chunk)[None, :] >= first[:, None]
    return chunk, jnp.asarray(starts, jnp.int32), jnp.asarray(counted)


def _chunk_logits(student_in, student_table, teacher_hidden, teacher_table, cap, start, counted):
    """A chunk's student and teacher logits [n, chunk] from table rows start..start + chunk, rows it does not count
    at _PADDED_LOGIT."""
    rows = counted.shape[0]
    s = soft_cap(student_in @ jax.lax.dynamic_slice_in_dim(student_table, start, rows).T, cap)
    t = soft_cap(teacher_hidden @ jax.lax.dynamic_slice_in_dim(teacher_table, start, rows).T, cap)
    return jnp.where(counted, s, _PADDED_LOGIT), jnp.where(counted, t, _PADDED_LOGIT)


def _kl_forward(student_in, student_table, teacher_hidden, teacher_table, cap, chunk, keep):
    """(KL per row [n], (teacher and student log-normalizers [n], the chunks' logits when keep)). Per chunk c with
    teacher log-normalizer Z_c: w_c = Σ_v exp(t_v − Z_c)·(t_v − s_v); KL = Σ_c exp(Z_c − Z)·w_c − Z + log Σ_v exp(s_v),
    Z the teacher's log-normalizer over the vocabulary."""
    _, starts, counted = _chunk_starts(teacher_table.shape[0], chunk)

    def one_chunk(_, operands):
        s, t = _chunk_logits(student_in, student_table, teacher_hidden, teacher_table, cap, *operands)
        t_norm = jax.nn.logsumexp(t, axis=-1)
        weighted = jnp.sum(jnp.exp(t - t_norm[:, None]) * (t - s), axis=-1)
        return None, ((t_norm, jax.nn.logsumexp(s, axis=-1), weighted), (s, t) if keep else ())

    _, ((t_norms, s_norms, weighted), logits) = jax.lax.scan(one_chunk, None, (starts, counted))
    t_norm, s_norm = jax.nn.logsumexp(t_norms, axis=0), jax.nn.logsumexp(s_norms, axis=0)
    return jnp.sum(jnp.exp(t_norms - t_norm) * weighted, axis=0) - t_norm + s_norm, (t_norm, s_norm, logits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _chunked_kl(student_in, student_table, teacher_hidden, teacher_table, cap, chunk, train_rows):
    """vocab_kl of student logits soft_cap(student_in [n, k]·student_tableᵀ [V, k]) against teacher logits
    soft_cap(teacher_hidden·teacher_tableᵀ); differentiable in student_in, and in student_table when train_rows."""
    return _kl_forward(student_in, student_table, teacher_hidden, teacher_table, cap, chunk, False)[0]


def _chunked_kl_fwd(student_in, student_table, teacher_hidden, teacher_table, cap, chunk, train_rows):
    kl, (t_norm, s_norm, logits) = _kl_forward(
        student_in, student_table, teacher_hidden, teacher_table, cap, chunk, True
    )
    return kl, (student_in, student_table, teacher_hidden, teacher_table, t_norm, s_norm, logits)


def _chunked_kl_bwd(cap, chunk, train_rows, residuals, g):
    student_in, student_table, teacher_hidden, teacher_table, t_norm, s_norm, (s_all, t_all) = residuals
    chunk, starts, counted = _chunk_starts(teacher_table.shape[0], chunk)

    def one_chunk(d_in, operands):
        start, chunk_counted, s, t = operands
        # d KL / d student logit = softmax(student) − softmax(teacher); through the cap, × 1 − tanh².
        d = g[:, None] * (jnp.exp(s - s_norm[:, None]) - jnp.exp(t - t_norm[:, None]))
        if cap is not None:
            d = d * jnp.where(chunk_counted, 1 - jnp.square(s / cap), 0.0)
        d_in = d_in + d @ jax.lax.dynamic_slice_in_dim(student_table, start, chunk)
        return d_in, (d.T @ student_in if train_rows else ())

    d_in, d_rows = jax.lax.scan(one_chunk, jnp.zeros_like(student_in), (starts, counted, s_all, t_all))
    d_table = jnp.zeros_like(student_table)
    if train_rows:  # rows a chunk does not count have d = 0, so the shared rows add nothing twice
        rows = (starts[:, None] + jnp.arange(chunk)[None, :]).reshape(-1)
        d_table = d_table.at[rows].add(d_rows.reshape(-1, student_table.shape[1]))
    return d_in, d_table, jnp.zeros_like(teacher_hidden), jnp.zeros_like(teacher_table)


_chunked_kl.defvjp(_chunked_kl_fwd, _chunked_kl_bwd)


def top_k_kl(student_logits, teacher_logits) -> jax.Array:
    """KL from the teacher's to the student's distribution over the same k tokens, both renormalized:
    logits [..., k] → [...]."""
    teacher_log_p = jax.nn.log_softmax(teacher_logits, axis=-1)
    student_log_p = jax.nn.log_softmax(student_logits, axis=-1)
    return jnp.sum(jnp.exp(teacher_log_p) * (teacher_log_p - student_log_p), axis=-1)


def distill_factors(
    model,
    dense,
    distill_ids,
    options: DistillOptions = DistillOptions(),
    *,
    progress: bool = True,
    on_step: Callable[[int, object], None] | None = None,
    trained=is_trained,
) -> None:
    """Trains `model`'s factors in place for options.steps Adam steps towards `dense`'s next-token distributions on
    distill_ids [B, T] (its last options.holdout windows held out when B leaves at least one to train on) and keeps
    the factors with the lowest held-out loss, measured before training and every options.eval_every steps.
    on_step(steps_done, model), when given, runs after every step with the model holding the current factors.
    trained: the nnx filter of the weights trained (default `is_trained`: the compressed weights; fp8 distillation
    passes the dense projections' kernels)."""
    ids = np.asarray(distill_ids, np.int32)
    holdout = options.holdout if ids.shape[0] > options.holdout else 0
    count = ids.shape[0] - holdout
    rng = np.random.default_rng(options.seed)
    schedule, drawn = _window_schedule(count, options.steps, min(options.batch, count), rng)
    # The teacher runs on the windows some step trains on (each costs a forward pass) and on the held-out ones.
    ids = np.concatenate([ids[drawn], ids[count:]])
    train_ids = ids[: drawn.size]
    table = unembedding(dense)
    cap = getattr(dense.config, "final_logit_softcapping", None)
    targets = _teacher_hidden(dense, ids)
    if options.loss == "kl":
        rows = (
            likely_rows(targets[: train_ids.shape[0]], table, cap, options.vocab_top_k) if options.vocab_top_k else None
        )
        table = table if rows is None else table[rows]
        loss_fn, teacher = _kl_loss(cap, options, rows), np.zeros((ids.shape[0], 0), np.float32)
    else:
        loss_fn, teacher = _top_k_loss(targets, table, cap, options)
    graphdef, factors, rest = nnx.split(model, trained, ...)
    optimizer = optax.chain(
        optax.clip_by_global_norm(options.clip_norm) if options.clip_norm else optax.identity(),
        optax.adam(learning_rate_schedule(options)),
    )
    state = optimizer.init(factors)
    # Each leaf's step: the schedule's, times its RMS when relative, times pruned / learning_rate for pruned kernels.
    scales = jax.tree.map(
        lambda p: p.replace(
            (jnp.sqrt(jnp.mean(jnp.square(p[...]))) if options.relative else jnp.float32(1.0))
            * (options.pruned_learning_rate / options.learning_rate if isinstance(p, PrunedKernel) else 1.0)
        ),
        factors,
        is_leaf=lambda p: isinstance(p, nnx.Variable),
    )
    window = ids.shape[1]
    sampled = min(options.positions, window) if options.positions else window

    def batch_of(rows, seed_rng):
        """Windows `rows` of ids (held-out ones included): ids, teacher hidden states, sampled positions and the
        teacher's top-k logits and ids (the "topk" loss; empty otherwise)."""
        positions = np.stack([np.sort(seed_rng.choice(window, sampled, replace=False)) for _ in rows])
        return ids[rows], targets[rows], positions.astype(np.int32), jax.tree.map(lambda a: a[rows], teacher)

    start = jax.tree.map(lambda x: x, factors)  # what the anchor pulls toward
    leaves = len(jax.tree.leaves(factors))

    def drift(factors):
        """Mean over trained weights of ||w - w0||² / ||w0||²."""
        ratios = jax.tree.map(lambda w, w0: jnp.sum(jnp.square(w - w0)) / jnp.sum(jnp.square(w0)), factors, start)
        return sum(jax.tree.leaves(ratios)) / leaves

    # The model's other weights and the unembedding are arguments, not constants baked into the compiled steps.
    def distillation_loss(factors, rest, table, batch):
        if options.weight_dtype is not None:
            factors = jax.tree.map(fp8_rounded, factors)
        student = nnx.merge(graphdef, factors, rest)
        return loss_fn(final_hidden(student, batch[0]), factored_head(student), table, *batch[1:])

    def loss_of(factors, rest, table, batch):  # what training minimizes; steps are kept by distillation_loss alone
        loss = distillation_loss(factors, rest, table, batch)
        return loss + options.anchor * drift(factors) if options.anchor else loss

    @jax.jit
    def step(factors, state, rest, table, batch):
        loss, grads = jax.value_and_grad(loss_of)(factors, rest, table, batch)
        updates, state = optimizer.update(grads, state, factors)
        updates = jax.tree.map(lambda update, scale: update * scale, updates, scales)
        return optax.apply_updates(factors, updates), state, loss

    held_loss_jit = jax.jit(distillation_loss)
    # Fixed positions for the held-out windows, so successive measurements compare the same thing.
    held_batches = [
        batch_of(np.array([train_ids.shape[0] + i]), np.random.default_rng(10_000 + i)) for i in range(holdout)
    ]

    def held_out_loss(factors):
        return float(np.mean([held_loss_jit(factors, rest, table, batch) for batch in held_batches]))

    best = (held_out_loss(factors), 0, jax.tree.map(lambda x: x, factors)) if holdout else None
    bar = tqdm(range(options.steps), desc="distilling", disable=not progress, unit="step")
    for done in bar:
        factors, state, loss = step(factors, state, rest, table, batch_of(schedule[done], rng))
        if holdout and ((done + 1) % options.eval_every == 0 or done + 1 == options.steps):
            held = held_out_loss(factors)
            if held < best[0]:
                best = (held, done + 1, jax.tree.map(lambda x: x, factors))
            bar.set_postfix(loss=f"{float(loss):.4f}", held_out=f"{held:.4f}", best_step=best[1])
        else:
            bar.set_postfix(loss=f"{float(loss):.4f}")
        if on_step is not None:
            nnx.update(model, factors)
            on_step(done + 1, model)
    nnx.update(model, best[2] if holdout else factors)


def _window_schedule(count: int, steps: int, batch: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(schedule [steps, batch], drawn [W]): the training windows of each step, as indices into drawn, the sorted
    windows of 0..count-1 some step trains on. Epochs: every window once in a fresh order, then again, so a run
    sees as many different windows as its steps can (more different text generalizes better than more passes over
    the same). With batch > 1 a step that spans two epochs
    may hold one window twice."""
    epochs = -(-steps * batch // count)
    order = np.concatenate([rng.permutation(count) for _ in range(epochs)])[: steps * batch]
    drawn, schedule = np.unique(order, return_inverse=True)
    return schedule.reshape(steps, batch), drawn


def learning_rate_schedule(options: DistillOptions):
    """Adam's step size per step: linear warm-up from 0 to options.learning_rate over options.warmup steps, then
    constant or a cosine decay reaching 0 at options.steps (warm-up longer than the run: warm-up only)."""
    peak, warmup = options.learning_rate, options.warmup
    if options.schedule == "constant":
        return optax.linear_schedule(0.0, peak, warmup) if warmup else peak
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(options.steps, warmup + 1), 0.0)


def _kl_loss(cap, options, vocab_rows=None):
    """The "kl" loss of (student hidden [B, T, hidden], student head, unembedding, teacher hidden [B, T, hidden],
    positions [B, P], _). vocab_rows [V']: the vocabulary rows it runs over (the unembedding given is already
    those rows; a factored student head's v is restricted to them), None: all."""

    def loss(hidden, head, table, targets, positions, _):
        windows = jnp.arange(hidden.shape[0])[:, None]
        student = hidden[windows, positions].reshape(-1, hidden.shape[-1])
        teacher = jnp.asarray(targets)[windows, positions].reshape(-1, hidden.shape[-1])
        if head is not None and vocab_rows is not None:
            head = (head[0], head[1][:, vocab_rows])
        return jnp.mean(vocab_kl(student, teacher, table, cap, options.vocab_chunk, head))

    return loss


# Positions whose likely tokens `likely_rows` collects: every 4th of each window (which found nearly every row all of
# them do, at a quarter of the teacher head's cost), sparser past _LIKELY_ROWS_POSITIONS in all: each position costs a
# product with the whole vocabulary, and more rows make every distillation step slower.
_LIKELY_ROWS_STRIDE = 4
_LIKELY_ROWS_POSITIONS = 10_240


def likely_rows(hidden, table, cap, k: int) -> jax.Array:
    """The sorted ids [V'] of the vocabulary rows that are among the k most likely tokens of the teacher logits
    soft_cap(hidden·Eᵀ, cap) at some position of hidden [B, T, hidden] (every s-th position of each window, s the
    larger of _LIKELY_ROWS_STRIDE and B·T / _LIKELY_ROWS_POSITIONS rounded up), table: E [V, hidden].

    The teacher puts little of its mass outside these rows, on the training windows and on held-out text alike, and
    the KL over them alone (both distributions renormalized) costs a fraction of the whole vocabulary's."""
    stride = max(_LIKELY_ROWS_STRIDE, -(-hidden.shape[0] * hidden.shape[1] // _LIKELY_ROWS_POSITIONS))
    seen = np.zeros(table.shape[0], bool)
    for window in np.asarray(hidden):
        seen[np.asarray(_top_logits(jnp.asarray(window[::stride]), table, cap, min(k, table.shape[0]))[1])] = True
    return jnp.asarray(np.flatnonzero(seen), jnp.int32)


def _top_k_loss(targets, table, cap, options):
    """The "topk" loss of (student hidden, None, unembedding, teacher hidden, _, teacher top-k (logits, ids)
    [B, T, k]), and the
    teacher's top-k logits and ids of every window, computed one window at a time (full logits are B·T·V)."""
    gram = logit_gram(table)
    energy = float(np.mean(np.einsum("bth,hg,btg->bt", targets, np.asarray(gram), targets)))
    k = min(options.top_k, table.shape[0])
    teacher = np.zeros((targets.shape[0], 0), np.float32)
    if k:
        top = [_top_logits(jnp.asarray(window), table, cap, k) for window in targets]
        teacher = tuple(np.stack([np.asarray(pair[part]) for pair in top]) for part in (0, 1))

    def loss(hidden, head, table, batch_targets, _, batch_teacher):
        if head is not None:
            raise ValueError(
                'loss: "topk" compares hidden states through the teacher\'s head; use "kl" for a factored head'
            )
        diff = hidden - batch_targets
        value = jnp.mean(jnp.einsum("bth,hg,btg->bt", diff, gram, diff)) / energy
        if k:
            teacher_logits, token_ids = batch_teacher
            student_logits = soft_cap(jnp.einsum("bth,btkh->btk", hidden, table[token_ids]), cap)
            value = value + jnp.mean(top_k_kl(student_logits, teacher_logits))
        return value

    return loss, teacher


@functools.partial(jax.jit, static_argnums=(2, 3))
def _top_logits(hidden, table, cap, k):
    """The k largest logits [T, k] of hidden [T, hidden] and their token ids [T, k]."""
    return jax.lax.top_k(soft_cap(hidden @ table.T, cap), k)


def _teacher_hidden(dense, ids) -> np.ndarray:
    """final_hidden(dense, ·) of each window of ids [B, T], one window at a time: [B, T, hidden] float32. The
    module is split once and the state passed to one jax.jit function (nnx.jit walks the module on every call,
    which took about as long as the forward pass itself)."""
    graphdef, state = nnx.split(dense)
    forward = jax.jit(lambda state, window: final_hidden(nnx.merge(graphdef, state), window))
    return np.concatenate([np.asarray(forward(state, ids[i : i + 1])) for i in range(ids.shape[0])])
