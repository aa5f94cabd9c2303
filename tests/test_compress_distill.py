"""Distillation losses against float64 references, and what training with them does on a small model."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jax_neuronmm.models import from_preset
from jax_neuronmm.pipeline import Recipe
from jax_neuronmm.pipeline.compression import compress_model
from jax_neuronmm.pipeline.distill import (
    DistillOptions,
    _kl_loss,
    _window_schedule,
    distill_factors,
    fp8_rounded,
    learning_rate_schedule,
    likely_rows,
    top_k_kl,
    unembedding,
    vocab_kl,
)
from jax_neuronmm.pipeline.quantization import quantize_model


def _log_softmax64(logits):
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _logits64(hidden, table, cap):
    logits = hidden.astype(np.float64) @ table.astype(np.float64).T
    return logits if cap is None else np.tanh(logits / cap) * cap


def _kl64(student_logits, teacher_logits):
    log_p, log_q = _log_softmax64(teacher_logits), _log_softmax64(student_logits)
    return np.sum(np.exp(log_p) * (log_p - log_q), -1)


@pytest.mark.parametrize("n,vocab,chunk,cap", [(1, 7, 16, None), (5, 1003, 128, None), (13, 1000, 333, 3.0)])
def test_vocab_kl_matches_float64(n, vocab, chunk, cap):
    rng = np.random.default_rng(n + vocab)
    student, teacher = (rng.standard_normal((n, 9)).astype(np.float32) for _ in range(2))
    table = (rng.standard_normal((vocab, 9)) * 1.5).astype(np.float32)
    expected = _kl64(_logits64(student, table, cap), _logits64(teacher, table, cap))
    got = vocab_kl(jnp.asarray(student), jnp.asarray(teacher), jnp.asarray(table), cap, chunk)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)


def test_vocab_kl_gradient_is_the_probability_difference():
    rng = np.random.default_rng(1)
    student, teacher = (rng.standard_normal((6, 5)).astype(np.float32) for _ in range(2))
    table = rng.standard_normal((301, 5)).astype(np.float32)
    grad = jax.grad(lambda s: vocab_kl(s, jnp.asarray(teacher), jnp.asarray(table), None, 64).sum())(student)
    # d KL / d student logits = q - p, so d / d student hidden = (q - p)·E.
    q = np.exp(_log_softmax64(_logits64(student, table, None)))
    p = np.exp(_log_softmax64(_logits64(teacher, table, None)))
    np.testing.assert_allclose(np.asarray(grad), (q - p) @ table.astype(np.float64), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("vocab,chunk", [(1003, 128), (300, 300), (41, 64)])
def test_vocab_kl_gradients_with_a_factored_capped_head_match_float64(vocab, chunk):
    # Ragged vocabularies: the last chunk overlaps the one before (its shared rows counted once) or the chunk
    # is wider than the vocabulary.
    rng = np.random.default_rng(vocab)
    n, hidden, rank, cap = 7, 9, 5, 2.5
    student, teacher = (rng.standard_normal((n, hidden)) for _ in range(2))
    u, v = rng.standard_normal((hidden, rank)) * 0.7, rng.standard_normal((rank, vocab)) * 0.7
    table = rng.standard_normal((vocab, hidden)) * 1.5
    weights = rng.uniform(0.5, 2.0, n)  # a cotangent that is not all ones

    def loss(s, u, v):
        got = vocab_kl(s, jnp.asarray(teacher, jnp.float32), jnp.asarray(table, jnp.float32), cap, chunk, (u, v))
        return jnp.sum(got * jnp.asarray(weights, jnp.float32))

    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(a, jnp.float32) for a in (student, u, v)))
    raw = student @ u @ v
    capped = np.tanh(raw / cap) * cap
    teacher_logits = _logits64(teacher, table, cap)
    q, p = np.exp(_log_softmax64(capped)), np.exp(_log_softmax64(teacher_logits))
    d_raw = weights[:, None] * (q - p) * (1 - np.tanh(raw / cap) ** 2)
    expected = (d_raw @ v.T @ u.T, student.T @ (d_raw @ v.T), (student @ u).T @ d_raw)
    np.testing.assert_allclose(float(value), np.sum(weights * _kl64(capped, teacher_logits)), rtol=1e-4)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5 * np.abs(want).max())


def test_top_k_kl_matches_float64():
    rng = np.random.default_rng(2)
    student, teacher = rng.standard_normal((2, 3, 7)) * 4, rng.standard_normal((2, 3, 7)) * 4
    got = top_k_kl(jnp.asarray(student, jnp.float32), jnp.asarray(teacher, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), _kl64(student, teacher), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cap,factored", [(None, False), (4.0, True)])
def test_likely_rows_and_the_kl_over_them_match_float64(cap, factored):
    rng = np.random.default_rng(11)
    vocab, width, rank = 1003, 12, 5
    table = (rng.standard_normal((vocab, width)) * 1.5).astype(np.float32)
    teacher = rng.standard_normal((3, 37, width)).astype(np.float32)  # 37: the stride leaves a ragged tail
    rows = np.asarray(likely_rows(teacher, jnp.asarray(table), cap, 6))
    top = np.argsort(-_logits64(teacher[:, ::4].reshape(-1, width), table, cap), axis=-1)[:, :6]
    np.testing.assert_array_equal(rows, np.unique(top))
    assert 6 < len(rows) < vocab
    student = teacher + 0.3 * rng.standard_normal(teacher.shape).astype(np.float32)
    positions = np.stack([np.sort(rng.choice(37, 9, replace=False)) for _ in range(3)]).astype(np.int32)
    head, student_logits = None, _logits64(student.reshape(-1, width), table, cap)
    if factored:  # the student's head (u, v) over the whole vocabulary; the loss restricts v's columns to rows
        u, v = (
            rng.standard_normal((width, rank)).astype(np.float32),
            rng.standard_normal((rank, vocab)).astype(np.float32),
        )
        head = (jnp.asarray(u), jnp.asarray(v))
        logits = student.reshape(-1, width).astype(np.float64) @ u @ v
        student_logits = logits if cap is None else np.tanh(logits / cap) * cap
    loss = _kl_loss(cap, DistillOptions(vocab_chunk=100), jnp.asarray(rows))
    got = loss(jnp.asarray(student), head, jnp.asarray(table[rows]), teacher, jnp.asarray(positions), None)
    picked = (np.arange(3)[:, None] * 37 + positions).reshape(-1)
    teacher_logits = _logits64(teacher.reshape(-1, width), table, cap)
    expected = _kl64(student_logits[picked][:, rows], teacher_logits[picked][:, rows]).mean()
    np.testing.assert_allclose(float(got), expected, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny():
    model = from_preset("gemma3", "tiny", num_layers=2, vocab_size=300)
    return model, np.random.default_rng(5).integers(0, 300, (24, 33))


def _full_kl64(student_model, teacher_model, ids):
    """Mean next-token KL (float64) from the teacher's to the student's distribution at every position."""
    student = np.asarray(student_model(jnp.asarray(ids)), np.float64)
    teacher = np.asarray(teacher_model(jnp.asarray(ids)), np.float64)
    return float(np.mean(_kl64(student, teacher)))


@pytest.mark.parametrize("loss,vocab_top_k", [("kl", 0), ("kl", 5), ("topk", 0)])
def test_distill_lowers_the_full_vocabulary_kl(tiny, loss, vocab_top_k):
    model, ids = tiny
    compressed = compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)
    before = _full_kl64(compressed, model, ids[:8])
    options = DistillOptions(
        steps=40,
        batch=4,
        learning_rate=3e-3,
        relative=False,
        warmup=5,
        loss=loss,
        positions=11,
        top_k=7,
        vocab_top_k=vocab_top_k,
    )
    distill_factors(compressed, model, ids, options, progress=False)
    after = _full_kl64(compressed, model, ids[:8])
    assert after < 0.7 * before, (before, after)


def test_distill_keeps_the_factors_with_the_lowest_held_out_loss(tiny):
    model, ids = tiny
    compressed = compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)
    held = ids[-4:]
    seen = []
    distill_factors(
        compressed,
        model,
        ids,
        DistillOptions(
            steps=12,
            batch=2,
            learning_rate=3e-3,
            relative=False,
            warmup=0,
            eval_every=4,
            holdout=4,
            positions=0,
            vocab_top_k=0,
        ),
        progress=False,
        on_step=lambda done, m: seen.append(_full_kl64(m, model, held)),
    )
    # With every position sampled and the whole vocabulary, the held-out loss is the full KL on the held-out
    # windows (float32): the kept factors are those of the best of steps 0, 4, 8 and 12.
    start = _full_kl64(compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False), model, held)
    best = min([start] + [seen[i - 1] for i in (4, 8, 12)])
    np.testing.assert_allclose(_full_kl64(compressed, model, held), best, rtol=1e-3)


def _drift64(model, start):
    """Mean over the SVD factors of ||w - w0||² / ||w0||² in float64 (distill's anchor term, by hand)."""
    ratios = []
    for name in ("u", "v"):
        for a, b in zip(_factors(model, name), _factors(start, name)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            ratios.append(np.sum((a - b) ** 2) / np.sum(b**2))
    return float(np.mean(ratios))


def _factors(model, name):
    return [v[...] for path, v in nnx.iter_graph(model) if path and path[-1] == name and isinstance(v, nnx.Param)]


def test_the_anchor_keeps_the_factors_nearer_their_start(tiny):
    # Same data, steps and seed: a pull toward the starting factors leaves them nearer the start (float64 drift),
    # and without one the KL falls further.
    model, ids = tiny
    recipe = Recipe(keep=0.5, method="svd", block=8)
    start = compress_model(model, recipe, progress=False)
    drifts, kls = [], []
    for anchor in (0.0, 20.0):
        compressed = compress_model(model, recipe, progress=False)
        options = DistillOptions(
            steps=20, batch=4, learning_rate=3e-3, relative=False, warmup=0, holdout=0, anchor=anchor
        )
        distill_factors(compressed, model, ids, options, progress=False)
        drifts.append(_drift64(compressed, start))
        kls.append(_full_kl64(compressed, model, ids[:8]))
    assert drifts[0] > 2 * drifts[1] > 0, drifts
    assert kls[0] < kls[1], kls
    with pytest.raises(ValueError, match="DistillOptions.anchor: got -1.0"):
        DistillOptions(anchor=-1.0)


def test_fp8_rounded_is_the_stored_rounding_with_a_straight_through_gradient():
    rng = np.random.default_rng(11)
    # Ragged [37, 19], columns from 1e-3 to 1e3 in magnitude, one all zero.
    w = rng.standard_normal((37, 19)) * np.logspace(-3, 3, 19)
    w[:, 4] = 0.0
    w32 = w.astype(np.float32)
    amax = np.abs(w32.astype(np.float64)).max(0)
    scale = np.where(amax > 0, amax / 240.0, 1.0).astype(np.float32).astype(np.float64)
    want = (w32 / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    got = np.asarray(fp8_rounded(jnp.asarray(w32)), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert np.abs(got - w32).max(0)[5] > 0  # the rounding changes the weights
    c = rng.standard_normal(w.shape).astype(np.float32)
    grad = jax.grad(lambda x: jnp.sum(fp8_rounded(x) * c))(jnp.asarray(w32))
    np.testing.assert_array_equal(np.asarray(grad), c)


def test_distill_through_fp8_lowers_the_kl_of_the_fp8_model(tiny):
    model, ids = tiny
    start = compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)
    before = _full_kl64(quantize_model(start, targets=("mlp", "attention"), progress=False), model, ids[:8])
    options = DistillOptions(
        steps=40, batch=4, learning_rate=3e-3, relative=False, warmup=5, positions=11, vocab_top_k=0
    )
    trained = {}
    for weight_dtype in (None, "float8_e4m3"):
        trained[weight_dtype] = compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)
        distill = dataclasses.replace(options, weight_dtype=weight_dtype)
        distill_factors(trained[weight_dtype], model, ids, distill, progress=False)
    fp8 = quantize_model(trained["float8_e4m3"], targets=("mlp", "attention"), progress=False)
    after = _full_kl64(fp8, model, ids[:8])
    assert after < 0.7 * before, (before, after)
    # The forward passes saw the rounded factors: training took another path than on the float factors.
    u_fp8, u_float = (np.asarray(trained[d].layers[0].mlp.down_proj.u[...]) for d in ("float8_e4m3", None))
    assert np.abs(u_fp8 - u_float).max() > 1e-3 * np.abs(u_float).max()


def test_unembedding_is_the_tied_embedding_or_the_head():
    tied = from_preset("gemma3", "tiny", num_layers=1, vocab_size=50)
    np.testing.assert_array_equal(np.asarray(unembedding(tied)), np.asarray(tied.embed_tokens.embedding[...]))


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("loss", "mse", r"DistillOptions.loss: got 'mse', expected one of \('kl', 'topk'\)"),
        ("clip_norm", -1.0, "DistillOptions.clip_norm: got -1.0, expected a finite number >= 0"),
        ("clip_norm", float("nan"), "DistillOptions.clip_norm: got nan, expected a finite number >= 0"),
        ("positions", -3, "DistillOptions.positions: got -3, expected a non-negative int"),
        ("vocab_chunk", 0, "DistillOptions.vocab_chunk: got 0, expected a positive int"),
        ("vocab_top_k", -1, "DistillOptions.vocab_top_k: got -1, expected a non-negative int"),
        ("steps", 2.5, "DistillOptions.steps: got 2.5, expected a positive int"),
        ("relative", 1, "DistillOptions.relative: got 1, expected a bool"),
        ("pruned_learning_rate", 0.0, "DistillOptions.pruned_learning_rate: got 0.0, expected a finite positive"),
        ("pruned_learning_rate", True, "DistillOptions.pruned_learning_rate: got True, expected a finite positive"),
        ("schedule", "linear", r"DistillOptions.schedule: got 'linear', expected one of \('cosine', 'constant'\)"),
        (
            "weight_dtype",
            "int8",
            r"DistillOptions.weight_dtype: got 'int8', expected None or one of \('float8_e4m3',\)",
        ),
    ],
)
def test_distill_options_are_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        DistillOptions(**{field: value})


@pytest.mark.parametrize("steps,warmup", [(37, 5), (9, 0), (4, 20)])
def test_cosine_schedule_warms_up_then_decays_to_zero(steps, warmup):
    peak = 3e-3
    schedule = learning_rate_schedule(DistillOptions(steps=steps, warmup=warmup, learning_rate=peak))
    for step in range(steps + 2):
        if step < warmup:
            want = peak * step / warmup
        else:
            want = peak * 0.5 * (1 + np.cos(np.pi * min(step - warmup, steps - warmup) / (steps - warmup)))
        np.testing.assert_allclose(float(schedule(step)), want, rtol=1e-5, atol=1e-9)
    constant = learning_rate_schedule(DistillOptions(steps=steps, warmup=0, schedule="constant", learning_rate=peak))
    assert constant == peak


def test_relative_learning_rate_scales_each_factor_by_its_rms(tiny):
    from flax import nnx

    from jax_neuronmm.pipeline.distill import is_trained

    model, ids = tiny
    compressed = compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)
    before = {k: np.asarray(v.get_value(), np.float64) for k, v in nnx.to_flat_state(nnx.state(compressed, is_trained))}
    options = DistillOptions(steps=1, learning_rate=1e-2, relative=True, warmup=0, holdout=0, positions=5)
    distill_factors(compressed, model, ids, options, progress=False)
    after = {k: np.asarray(v.get_value(), np.float64) for k, v in nnx.to_flat_state(nnx.state(compressed, is_trained))}
    rms = {k: np.sqrt(np.mean(v**2)) for k, v in before.items()}
    assert len({round(float(v), 6) for v in rms.values()}) > 1  # factors of different scales
    for key in before:
        # Adam's first step moves every entry with a gradient by learning_rate (m / sqrt(v) = sign(g)), scaled here
        # by the factor's RMS.
        steps = np.abs(after[key] - before[key]) / rms[key]
        np.testing.assert_allclose(steps.max(), 1e-2, rtol=1e-3)


def test_pruned_kernels_step_by_their_own_learning_rate_beside_factors(tiny):
    from flax import nnx

    from jax_neuronmm.compress.prune import PrunedKernel
    from jax_neuronmm.pipeline.distill import is_trained

    model, ids = tiny
    recipe = Recipe(keep=0.5, include=("mlp", "attention"), mlp_form="pruned", steps=(), block=8)
    compressed = compress_model(model, recipe, calibration_ids=ids, progress=False)
    state = nnx.state(compressed, is_trained)
    before = {k: np.asarray(v.get_value(), np.float64) for k, v in nnx.to_flat_state(state)}
    pruned = {k for k, v in nnx.to_flat_state(state) if isinstance(v, PrunedKernel)}
    assert pruned and set(before) - pruned  # pruned MLP kernels beside attention factors
    options = DistillOptions(
        steps=1, learning_rate=1e-2, pruned_learning_rate=3e-3, warmup=0, holdout=0, positions=5, vocab_top_k=0
    )
    distill_factors(compressed, model, ids, options, progress=False)
    after = {k: np.asarray(v.get_value(), np.float64) for k, v in nnx.to_flat_state(nnx.state(compressed, is_trained))}
    for key in before:
        steps = np.abs(after[key] - before[key]) / np.sqrt(np.mean(before[key] ** 2))
        np.testing.assert_allclose(steps.max(), 3e-3 if key in pruned else 1e-2, rtol=1e-3)


def test_compress_model_factors_the_head_and_keeps_the_embedding_lookup_exact(tiny):
    from jax_neuronmm.nn.nnx import SVDLinear

    model, ids = tiny
    assert model.lm_head is None  # tied embeddings
    full = compress_model(
        model, Recipe(rank="full", include=("head",), method="whitened", steps=()), calibration_ids=ids
    )
    assert isinstance(full.lm_head, SVDLinear) and full.lm_head.rank == model.config.hidden_size
    np.testing.assert_array_equal(
        np.asarray(full.embed_tokens.embedding[...]), np.asarray(model.embed_tokens.embedding[...])
    )
    window = jnp.asarray(ids[:2])
    np.testing.assert_allclose(np.asarray(full(window)), np.asarray(model(window)), rtol=2e-3, atol=2e-3)
    low = compress_model(
        model, Recipe(keep=0.5, include=("head",), method="whitened", steps=(), block=8), calibration_ids=ids
    )
    assert low.lm_head.rank < model.config.hidden_size and isinstance(low.layers[0].mlp, type(model.layers[0].mlp))


def test_likely_rows_look_at_sparser_positions_past_their_budget(monkeypatch):
    from jax_neuronmm.pipeline import distill

    rng = np.random.default_rng(12)
    table = rng.standard_normal((211, 8)).astype(np.float32)
    teacher = rng.standard_normal((3, 37, 8)).astype(np.float32)
    monkeypatch.setattr(distill, "_LIKELY_ROWS_POSITIONS", 20)  # 111 positions: every 6th
    rows = np.asarray(likely_rows(teacher, jnp.asarray(table), None, 3))
    top = np.argsort(-_logits64(teacher[:, ::6].reshape(-1, 8), table, None), axis=-1)[:, :3]
    np.testing.assert_array_equal(rows, np.unique(top))


@pytest.mark.parametrize("count, steps, batch", [(13, 5, 1), (13, 30, 1), (7, 9, 2)])
def test_window_schedule_visits_every_window_once_an_epoch(count, steps, batch):
    rng = np.random.default_rng(count * steps)
    schedule, drawn = _window_schedule(count, steps, batch, rng)
    assert schedule.shape == (steps, batch) and np.all(np.diff(drawn) > 0) and drawn.min() >= 0 and drawn.max() < count
    windows = drawn[schedule].reshape(-1)
    np.testing.assert_array_equal(np.unique(windows), drawn)  # drawn holds exactly the windows some step uses
    for start in range(0, windows.size, count):  # each epoch: distinct windows, all of them when it is complete
        epoch = windows[start : start + count]
        assert np.unique(epoch).size == epoch.size
        assert epoch.size < count or np.unique(epoch).size == count
