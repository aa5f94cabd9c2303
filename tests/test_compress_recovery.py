"""Accuracy-recovery steps: refit of v, rank allocation, whitening reuse, local MLP fine-tuning, distillation, and
their wiring in compress_model (steps=, recommended pipeline, calibration checks)."""

import itertools
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_neuronmm.compress import allocation, svd
from jax_neuronmm.compress.allocation import allocate_ranks, loss_curve
from jax_neuronmm.compress.prune import PrunedKernel
from jax_neuronmm.compress.refit import refit_v
from jax_neuronmm.models import from_preset
from jax_neuronmm.nn.nnx import SVDMLP
from jax_neuronmm.pipeline import Recipe
from jax_neuronmm.pipeline.compression import NoCalibrationWarning, compress_model
from jax_neuronmm.pipeline.distill import (
    DistillOptions,
    centered_logit_error,
    distill_factors,
    final_hidden,
    is_trained,
    unembedding,
)
from jax_neuronmm.pipeline.local_finetune import LocalFinetuneOptions, finetune_mlp, relative_error
from jax_neuronmm.pipeline.sensitivity import KLProbes, kl_sensitivity
from jax_neuronmm.pipeline.sequential import calibration_batch, record_inputs
from nki_kernels.activations import ACTIVATIONS


def _correlated(rng, n, k):
    """Activations with a decaying spectrum, like real ones (whitening then matters)."""
    return (rng.standard_normal((n, k)) * np.geomspace(10, 0.1, k)) @ np.linalg.qr(rng.standard_normal((k, k)))[0]


@pytest.mark.parametrize("n,k,r,m", [(130, 100, 1, 7), (1000, 200, 130, 100)])
def test_refit_v_matches_float64_least_squares(n, k, r, m):
    rng = np.random.default_rng(n + r)
    x, u, y = _correlated(rng, n, k), rng.standard_normal((k, r)), rng.standard_normal((n, m))
    v = refit_v(u, x, y, ridge=0.0)
    expected = np.linalg.lstsq(x @ u, y, rcond=None)[0]
    np.testing.assert_allclose(v, expected, rtol=1e-6, atol=1e-8)


def test_refit_v_lowers_the_error_under_input_drift():
    rng = np.random.default_rng(1)
    x = _correlated(rng, 1000, 100)
    w = rng.standard_normal((100, 200))
    drifted = x + 0.3 * rng.standard_normal(x.shape)
    u, v = svd.whitened_svd(w, drifted, 40)
    refit = refit_v(u, drifted, x @ w)
    before = np.linalg.norm(drifted @ u @ v - x @ w)
    after = np.linalg.norm(drifted @ u @ refit - x @ w)
    assert after < before  # the refit is the least-squares optimum given u; the drift is mostly noise


def test_refit_v_is_a_no_op_on_whitened_factors_of_the_same_inputs():
    rng = np.random.default_rng(2)
    x, w = _correlated(rng, 700, 100), rng.standard_normal((100, 130))
    u, v = svd.whitened_svd(w, x, 30)
    np.testing.assert_allclose(refit_v(u, x, x @ w, ridge=0.0), v, rtol=1e-5, atol=1e-7)


def test_refit_v_rejects_bad_shapes():
    with pytest.raises(ValueError, match="inputs"):
        refit_v(np.ones((4, 2)), np.ones((10, 5)), np.ones((10, 3)))
    with pytest.raises(ValueError, match="targets"):
        refit_v(np.ones((4, 2)), np.ones((10, 4)), np.ones((9, 3)))


def test_whitening_factor_reused_gives_whitened_svd():
    rng = np.random.default_rng(3)
    x, w = _correlated(rng, 1000, 200), rng.standard_normal((200, 100))
    chol, damping = svd.whitening(x)
    assert damping == 0.0
    u, v = svd.whitened_factors(w, chol, 37)
    u_ref, v_ref = svd.whitened_svd(w, x, 37)
    np.testing.assert_allclose(u @ v, u_ref @ v_ref, rtol=1e-6, atol=1e-9)
    sigma = svd.whitened_decomposition(w, chol)[1]
    # Truncation error equals the discarded whitened energy (float64 reference).
    lost = np.linalg.norm(x @ w - x @ u @ v) ** 2
    np.testing.assert_allclose(lost, np.sum(sigma[37:] ** 2), rtol=1e-6)


def test_loss_curve_interpolates_geometrically_and_never_rises():
    curve = loss_curve({256: 0.04, 384: 0.01, 512: 0.004}, 640)
    assert curve.shape == (641,)
    np.testing.assert_allclose(curve[[256, 384, 512]], [0.04, 0.01, 0.004], rtol=1e-12)
    np.testing.assert_allclose(curve[320], np.sqrt(0.04 * 0.01), rtol=1e-12)  # log-linear between measurements
    np.testing.assert_allclose(curve[128], 0.04 * 4.0, rtol=1e-12)  # the lowest segment's slope continues
    np.testing.assert_allclose(curve[576], 0.004 * np.sqrt(0.4), rtol=1e-12)
    assert curve[640] == 0.0 and np.all(np.diff(curve) <= 0)
    noisy = loss_curve({10: 0.2, 20: 0.3}, 40)  # a higher rank measured worse: clipped, not rising
    assert np.all(np.diff(noisy) <= 0) and noisy[20] == noisy[10] == 0.2
    np.testing.assert_allclose(loss_curve({7: 0.5}, 9)[:9], 0.5)
    with pytest.raises(ValueError, match="measured"):
        loss_curve({40: 0.1}, 40)
    with pytest.raises(ValueError, match="measured"):
        loss_curve({4: -1.0}, 40)


def test_allocate_ranks_matches_the_brute_force_optimum():
    # Every projection factored: the least summed loss any block-aligned ranks within the budget reach.
    shapes = [(40, 72), (72, 40), (56, 56), (32, 80)]
    rng = np.random.default_rng(7)
    curves = [
        loss_curve({8: float(a), 16: float(a * b)}, min(k, n))
        for (k, n), a, b in zip(shapes, rng.uniform(0.1, 2.0, 4), rng.uniform(0.2, 0.6, 4))
    ]
    keep, block = 0.55, 4
    ranks = allocate_ranks(curves, shapes, keep, block, solver="exact")
    budget = keep * sum(k * n for k, n in shapes)
    caps = [(k * n // (k + n)) // block * block for k, n in shapes]
    assert all(r % block == 0 and block <= r <= c for r, c in zip(ranks, caps))
    assert sum(r * (k + n) for r, (k, n) in zip(ranks, shapes)) <= budget
    best = min(
        sum(c[r] for c, r in zip(curves, combo))
        for combo in itertools.product(*[range(block, c + 1, block) for c in caps])
        if sum(r * (k + n) for r, (k, n) in zip(combo, shapes)) <= budget
    )
    np.testing.assert_allclose(sum(c[r] for c, r in zip(curves, ranks)), best, rtol=1e-12)
    with pytest.raises(ValueError, match="losses"):
        allocate_ranks(curves[:1], shapes, keep)
    with pytest.raises(ValueError, match=r"losses\[0\]"):
        allocate_ranks([np.ones(4)], [(4, 8)], keep)
    with pytest.raises(ValueError, match="solver"):
        allocate_ranks(curves, shapes, keep, block, solver="greedy")


def test_allocate_ranks_with_the_dense_option_matches_the_brute_force_optimum(monkeypatch):
    # Unequal shapes and curves whose tails stay large: keeping some projections dense is cheaper than their ranks.
    shapes = [(40, 72), (72, 40), (56, 56), (32, 80), (48, 64)]
    block = 4

    def cost(rank, k, n):
        return k * n if rank is None else rank * (k + n)

    for seed in range(6):
        rng = np.random.default_rng(seed)
        curves = [
            loss_curve({8: float(a), 16: float(a * b)}, min(k, n))
            for (k, n), a, b in zip(shapes, rng.uniform(0.1, 2.0, 5), rng.uniform(0.3, 0.9, 5))
        ]
        keep = float(rng.uniform(0.5, 0.8))
        ranks = allocate_ranks(curves, shapes, keep, block, allow_dense=True, solver="exact")
        budget = keep * sum(k * n for k, n in shapes)
        assert sum(cost(r, k, n) for r, (k, n) in zip(ranks, shapes)) <= budget
        caps = [(k * n // (k + n)) // block * block for k, n in shapes]
        options = [[*range(block, cap + 1, block), None] for cap in caps]
        best = min(
            sum(0.0 if r is None else c[r] for c, r in zip(curves, combo))
            for combo in itertools.product(*options)
            if sum(cost(r, k, n) for r, (k, n) in zip(combo, shapes)) <= budget
        )
        got = sum(0.0 if r is None else c[r] for c, r in zip(curves, ranks))
        np.testing.assert_allclose(got, best, rtol=1e-12)
        factored_only = allocate_ranks(curves, shapes, keep, block, solver="exact")
        assert None not in factored_only
        assert got <= sum(c[r] for c, r in zip(curves, factored_only))
    assert None in ranks  # the last case keeps a projection dense
    # A budget finer than MAX_CELLS cells is counted in coarser units, each option's cost rounded up: still within it.
    monkeypatch.setattr(allocation, "MAX_CELLS", 50)
    coarse = allocate_ranks(curves, shapes, keep, block, allow_dense=True, solver="exact")
    assert sum(cost(r, k, n) for r, (k, n) in zip(coarse, shapes)) <= budget
    assert best <= sum(0.0 if r is None else c[r] for c, r in zip(curves, coarse))


@pytest.mark.parametrize("allow_dense", [False, True])
def test_lagrangian_allocation_is_the_least_price_per_parameter_that_fits(allow_dense):
    # Reference by the definition, over every option (no hull): at each price λ every projection takes its option of
    # least loss + λ·parameters; the answer is the choice at the smallest price whose parameters fit the budget.
    shapes = [(40, 72), (72, 40), (56, 56), (32, 80), (48, 64)]
    block = 4

    def cost(rank, k, n):
        return k * n if rank is None else rank * (k + n)

    def loss(curve, rank):
        return 0.0 if rank is None else curve[rank]

    differs = 0
    for seed in range(6):
        rng = np.random.default_rng(100 + seed)
        # Three measured ranks with random ratios: curves that bend both ways, so hulls skip some ranks.
        curves = [
            loss_curve({8: float(a), 12: float(a * b), 20: float(a * b * c)}, min(k, n))
            for (k, n), a, b, c in zip(
                shapes, rng.uniform(0.1, 2.0, 5), rng.uniform(0.2, 0.95, 5), rng.uniform(0.05, 0.9, 5)
            )
        ]
        keep = float(rng.uniform(0.45, 0.8))
        budget = keep * sum(k * n for k, n in shapes)
        caps = [(k * n // (k + n)) // block * block for k, n in shapes]
        options = [[*range(block, cap + 1, block), *([None] if allow_dense else [])] for cap in caps]
        # The choices change only at the rates between two options of one projection: try a price between each two.
        rates = sorted(
            {
                (loss(c, a) - loss(c, b)) / (cost(b, k, n) - cost(a, k, n))
                for c, (k, n), opts in zip(curves, shapes, options)
                for a, b in itertools.combinations(opts, 2)
                if cost(a, k, n) < cost(b, k, n)
            }
            | {0.0}
        )
        prices = [(low + high) / 2 for low, high in zip(rates, rates[1:])] + [2 * rates[-1] + 1.0]
        for price in prices:
            expected = [
                min(opts, key=lambda r, c=c, k=k, n=n: loss(c, r) + price * cost(r, k, n))
                for c, (k, n), opts in zip(curves, shapes, options)
            ]
            if sum(cost(r, k, n) for r, (k, n) in zip(expected, shapes)) <= budget:
                break
        ranks = allocate_ranks(curves, shapes, keep, block, allow_dense=allow_dense)
        assert ranks == expected
        spent = sum(cost(r, k, n) for r, (k, n) in zip(ranks, shapes))
        got = sum(loss(c, r) for c, r in zip(curves, ranks))
        # A Lagrangian choice is the exact optimum at the parameters it spends, and no better than the exact one.
        best_at_spent = min(
            sum(loss(c, r) for c, r in zip(curves, combo))
            for combo in itertools.product(*options)
            if sum(cost(r, k, n) for r, (k, n) in zip(combo, shapes)) <= spent
        )
        np.testing.assert_allclose(got, best_at_spent, rtol=1e-12)
        exact = allocate_ranks(curves, shapes, keep, block, allow_dense=allow_dense, solver="exact")
        assert sum(loss(c, r) for c, r in zip(curves, exact)) <= got * (1 + 1e-12)
        differs += exact != ranks
    if allow_dense:  # the dense option's jump in parameters leaves budget the two solvers spend differently
        assert differs > 0
    # A budget below one block each: every projection gets its smallest rank.
    assert allocate_ranks(curves, shapes, 0.01, block, allow_dense=allow_dense) == [block] * len(shapes)


def _kl64(student_hidden, teacher_hidden, table, rows):
    """Mean KL (float64) from the teacher's to the student's distribution over table rows `rows` [V']."""
    e = np.asarray(table, np.float64)[rows]
    t, s = np.asarray(teacher_hidden, np.float64) @ e.T, np.asarray(student_hidden, np.float64) @ e.T
    log_p = t - t.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    log_q = s - s.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    return float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), -1)))


@pytest.mark.parametrize("top_k", [300, 7])
def test_kl_sensitivity_matches_the_truncated_model_in_float64(tiny, top_k):
    model, calibration, _ = tiny
    calibration = calibration[:14]  # 448 tokens: enough to fill down_proj's 384-wide Gram matrix
    before = {path: np.array(v) for path, v in nnx.to_flat_state(nnx.state(model))}
    probes = {
        (1, "down_proj"): [3, 11],
        (0, "gate_proj"): [5],
        (1, "up_proj"): [5],
        (0, "up_proj"): [2],
        (1, "gate_proj"): [2],
        (0, "down_proj"): [9],
    }
    measured = kl_sensitivity(
        model, calibration, ("mlp",), probes, probes=KLProbes(windows=2, top_k=top_k), progress=False
    )
    assert set(measured) == set(probes) and measured[(1, "down_proj")].keys() == {3, 11}
    for path, value in nnx.to_flat_state(nnx.state(model)):  # the dense model is left as it was
        np.testing.assert_array_equal(np.asarray(value), before[path])
    table = unembedding(model)
    teacher = np.asarray(final_hidden(model, calibration[-2:])).reshape(-1, table.shape[1])
    rows = np.unique(np.argsort(-(teacher @ np.asarray(table).T), axis=-1)[:, :top_k])
    assert measured[(1, "down_proj")][3] > measured[(1, "down_proj")][11] > 0
    # the reference: down_proj of layer 1 whitened by its dense inputs on all calibration windows, truncated
    hidden = []
    x, positions, masks = calibration_batch(model, calibration)
    layer0 = model.layers[0]
    x = record_inputs(layer0, x, positions, masks[layer0.self_attn.spec.sliding_window], [])[0]
    layer1 = model.layers[1]
    hidden = record_inputs(layer1, x, positions, masks[layer1.self_attn.spec.sliding_window], [("mlp", "down_proj")])[
        1
    ][0]
    truncated = nnx.clone(model)
    kernel = truncated.layers[1].mlp.down_proj.kernel
    u, v = svd.whitened_svd(np.asarray(kernel[...], np.float64), hidden.astype(np.float64), 3)
    kernel[...] = jnp.asarray(u @ v, kernel[...].dtype)
    student = np.asarray(final_hidden(truncated, calibration[-2:])).reshape(-1, table.shape[1])
    np.testing.assert_allclose(measured[(1, "down_proj")][3], _kl64(student, teacher, table, rows), rtol=2e-3)
    with pytest.raises(ValueError, match=r"probes.windows: got 15, expected at most 14"):
        kl_sensitivity(model, calibration, ("mlp",), probes, probes=KLProbes(windows=15), progress=False)
    with pytest.raises(ValueError, match="KLProbes.top_k: got 0, expected a positive int"):
        KLProbes(top_k=0)


def test_local_finetune_lowers_mlp_output_error():
    rng = np.random.default_rng(4)
    k, i, n = 24, 40, 1000
    x = _correlated(rng, n, k).astype(np.float32)
    dense = {
        name: rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[0])
        for name, shape in (("gate", (k, i)), ("up", (k, i)), ("down", (i, k)))
    }
    gate, up = x.astype(np.float64) @ dense["gate"], x.astype(np.float64) @ dense["up"]
    target = ((ACTIVATIONS["gelu_tanh"].reference(gate) * up) @ dense["down"]).astype(np.float32)
    factors = {}
    for name, rank in (("gate", 7), ("up", 7), ("down", 7)):
        u, v = svd.truncated_svd(dense[name], rank)
        factors[f"{name}_u"], factors[f"{name}_v"] = u, v
    before = relative_error(factors, x, target, "gelu_tanh")
    tuned = finetune_mlp(
        factors, x, target, "gelu_tanh", LocalFinetuneOptions(steps=150, batch=256, learning_rate=3e-3)
    )
    after = relative_error(tuned, x, target, "gelu_tanh")
    assert after < 0.8 * before
    assert {key: value.shape for key, value in tuned.items()} == {key: value.shape for key, value in factors.items()}


@pytest.fixture(scope="module")
def tiny():
    model = from_preset("gemma3", "tiny", num_layers=2, vocab_size=300)
    rng = np.random.default_rng(5)
    return model, rng.integers(0, 300, (24, 32)), rng.integers(0, 300, (2, 32))


def test_distill_lowers_the_logit_error(tiny):
    model, calibration, _ = tiny
    compressed = compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)
    before = centered_logit_error(compressed, model, calibration)
    distill_factors(
        compressed,
        model,
        calibration,
        DistillOptions(steps=40, batch=8, learning_rate=3e-3, loss="topk", relative=False),
        progress=False,
    )
    after = centered_logit_error(compressed, model, calibration)
    assert after < 0.9 * before


def _top_k_kl64(student, teacher, ids, k):
    """Mean KL (float64) from teacher to student logits [B, T, V] restricted to the teacher's top-k tokens."""
    teacher, student = np.asarray(teacher, np.float64), np.asarray(student, np.float64)
    top = np.argsort(-teacher, axis=-1)[..., :k]
    t, s = np.take_along_axis(teacher, top, -1), np.take_along_axis(student, top, -1)
    log_p = t - np.log(np.sum(np.exp(t - t.max(-1, keepdims=True)), -1, keepdims=True)) - t.max(-1, keepdims=True)
    log_q = s - np.log(np.sum(np.exp(s - s.max(-1, keepdims=True)), -1, keepdims=True)) - s.max(-1, keepdims=True)
    return float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), -1)))


def test_distill_top_k_term_lowers_the_kl_on_the_teachers_likely_tokens(tiny):
    model, calibration, _ = tiny
    ids = jnp.asarray(calibration[:8])
    before = _top_k_kl64(
        compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)(ids),
        model(ids),
        calibration[:8],
        7,
    )
    kls = []
    for top_k in (0, 7):
        compressed = compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)
        distill_factors(
            compressed,
            model,
            calibration,
            DistillOptions(steps=30, batch=8, learning_rate=3e-3, loss="topk", top_k=top_k, relative=False),
            progress=False,
        )
        kls.append(_top_k_kl64(compressed(ids), model(ids), calibration[:8], 7))
    # The KL term targets exactly this quantity: it lowers it more than the centered-logit error alone does.
    assert kls[1] < 0.7 * before and kls[1] < kls[0]


@pytest.mark.parametrize("options", [LocalFinetuneOptions, DistillOptions])
@pytest.mark.parametrize("rate", [float("inf"), float("nan"), -1e-3, 0.0, "1e-3", True, None])
def test_learning_rate_must_be_finite_and_positive(options, rate):
    # inf used to give NaN factors (local fine-tuning) or steps the loss check silently undid (distillation).
    with pytest.raises(ValueError, match=rf"{options.__name__}\.learning_rate: got .*, expected a finite positive"):
        options(learning_rate=rate)
    assert options(learning_rate=2e-3).learning_rate == 2e-3


def test_distill_options_and_distill_ids_are_checked(tiny, monkeypatch):
    model, calibration, _ = tiny
    with pytest.raises(ValueError, match="top_k: got -1, expected a non-negative int"):
        DistillOptions(top_k=-1)
    with pytest.raises(ValueError, match=r"distill_ids: token id 300 is outside the vocabulary range \[0, 300\)"):
        compress_model(
            model, Recipe(keep=0.5, block=8), calibration_ids=calibration, distill_ids=calibration + 1, progress=False
        )
    with pytest.raises(ValueError, match="distill_ids: only used by the 'distill' step"):
        compress_model(
            model,
            Recipe(keep=0.5, method="whitened", steps=("sequential",), block=8),
            calibration_ids=calibration,
            distill_ids=calibration,
            progress=False,
        )
    seen = []
    monkeypatch.setattr(
        "jax_neuronmm.pipeline.distill.distill_factors",
        lambda compressed, dense, ids, options, progress: seen.append(np.asarray(ids)),
    )
    compress_model(
        model, Recipe(keep=0.5, block=8), calibration_ids=calibration[:4], distill_ids=calibration[4:], progress=False
    )
    compress_model(model, Recipe(keep=0.5, block=8, self_text=False), calibration_ids=calibration[:4], progress=False)
    np.testing.assert_array_equal(seen[0], calibration[4:])
    np.testing.assert_array_equal(seen[1], calibration[:4])
    # By default the calibration windows are mixed with the dense model's own samples, which end the windows.
    monkeypatch.setattr(
        "jax_neuronmm.pipeline.self_distillation.generated_windows",
        lambda dense, ids, options, progress: np.full((options.windows, ids.shape[1]), 5, np.int32),
    )
    compress_model(model, Recipe(keep=0.5, block=8), calibration_ids=calibration[:4], progress=False)
    assert seen[2].shape == (4 + 96, calibration.shape[1])
    np.testing.assert_array_equal(seen[2][seen[2][:, 0] != 5], calibration[:4])
    assert np.all(seen[2][-8:] == 5)


def _factors(model):
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, is_trained))}


def test_distill_on_step_sees_each_step_and_the_best_factors_are_kept(tiny):
    model, calibration, _ = tiny
    compressed = compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)
    start = centered_logit_error(compressed, model, calibration)
    seen = []
    distill_factors(
        compressed,
        model,
        calibration,
        DistillOptions(steps=6, batch=8, learning_rate=3e-3, holdout=0, relative=False),
        progress=False,
        on_step=lambda done, m: seen.append((done, centered_logit_error(m, model, calibration))),
    )
    assert [done for done, _ in seen] == list(range(1, 7))
    assert len({error for _, error in seen}) == 6  # the callback saw the factors change at every step
    assert seen[-1][1] < start
    np.testing.assert_allclose(centered_logit_error(compressed, model, calibration), seen[-1][1], rtol=1e-6)


def test_distill_keeps_the_starting_factors_when_training_raises_the_loss(tiny):
    model, calibration, _ = tiny
    compressed = compress_model(model, Recipe(keep=0.5, method="svd", block=8), progress=False)
    before = _factors(compressed)
    errors = []
    distill_factors(
        compressed,
        model,
        calibration,
        DistillOptions(steps=3, batch=2, learning_rate=3.0, relative=False),
        progress=False,
        on_step=lambda done, m: errors.append(centered_logit_error(m, model, calibration)),
    )
    assert errors[-1] > centered_logit_error(compressed, model, calibration)  # it did diverge, and was undone
    after = _factors(compressed)
    assert after.keys() == before.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key])


@pytest.mark.parametrize("steps", [("sequential",), ("refit",), ("allocate",), ("sequential", "refit", "local")])
def test_compress_model_steps_build_fused_mlps_within_budget(tiny, steps):
    model, calibration, evaluation = tiny
    compressed = compress_model(
        model,
        Recipe(
            keep=0.5,
            include=("mlp", "attention"),
            method="whitened",
            steps=steps,
            block=8,
            local=LocalFinetuneOptions(steps=5, batch=64),
        ),
        calibration_ids=calibration,
        progress=False,
    )
    dense_params = sum(layer.mlp.gate_proj.kernel.size * 3 for layer in model.layers)
    factored = 0
    for layer in compressed.layers:
        assert isinstance(layer.mlp, SVDMLP)
        factored += sum(p.u.size + p.v.size for p in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj))
    assert factored <= 0.55 * dense_params
    logits = compressed(jnp.asarray(evaluation))
    assert logits.shape == (2, 32, 300) and bool(jnp.all(jnp.isfinite(logits)))


def test_compress_model_without_method(tiny):
    model, calibration, _ = tiny
    with pytest.warns(NoCalibrationWarning, match="calibration_ids"):
        compress_model(model, Recipe(keep=0.5, block=8), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoCalibrationWarning)
        recommended = compress_model(
            model,
            Recipe(keep=0.5, block=8, local=LocalFinetuneOptions(steps=2), distill=DistillOptions(steps=2)),
            calibration_ids=calibration[:4],
            progress=False,
        )
    # The recommended pipeline prunes the MLPs' neurons (RECOMMENDED_MLP_FORM) to half the width.
    assert all(isinstance(layer.mlp.gate_proj.kernel, PrunedKernel) for layer in recommended.layers)
    assert recommended.config.intermediate_size == model.config.intermediate_size // 2


def test_compress_model_checks_calibration_ids(tiny):
    model, calibration, _ = tiny
    with pytest.raises(ValueError, match=r"calibration_ids: token id 300 is outside the vocabulary range \[0, 300\)"):
        compress_model(
            model, Recipe(keep=0.5, method="whitened", block=8), calibration_ids=calibration + 1, progress=False
        )
    with pytest.raises(ValueError, match="calibration_ids"):
        compress_model(model, Recipe(keep=0.5, method="svd", steps=("refit",)), progress=False)
    with pytest.raises(ValueError, match="steps"):
        compress_model(model, Recipe(keep=0.5, method="whitened", steps=("magic",)), calibration_ids=calibration)
    with pytest.raises(ValueError, match="rank"):
        compress_model(model, Recipe(rank=8, method="whitened", steps=("allocate",)), calibration_ids=calibration)
