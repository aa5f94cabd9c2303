"""The output-weighted truncation (svd.whitened_factors with out_chol, svd.output_whitening), the Fisher Gram
matrices at projection outputs (pipeline.fisher.output_grams), the "fisher" step of compress_model and the Fisher
losses rank allocation uses after it (pipeline.sensitivity.fisher_losses)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_neuronmm.compress import svd
from jax_neuronmm.compress.allocation import allocate_ranks
from jax_neuronmm.models import from_preset
from jax_neuronmm.models.layers import GatedMLP
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear
from jax_neuronmm.pipeline import Recipe, fisher
from jax_neuronmm.pipeline.compression import compress_model
from jax_neuronmm.pipeline.distill import final_hidden, unembedding
from jax_neuronmm.pipeline.sensitivity import KLProbes, fisher_losses, kl_sensitivity
from jax_neuronmm.pipeline.sequential import LayerwiseOptions, calibration_batch, compress_layers, record_inputs

MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def _spd(rng, n, spread):
    """A symmetric positive definite [n, n] matrix with eigenvalues spread over `spread` decades."""
    q = np.linalg.qr(rng.standard_normal((n, n)))[0]
    return (q * np.geomspace(1.0, 10.0**-spread, n)) @ q.T


@pytest.mark.parametrize("k,n,r", [(37, 53, 11), (60, 29, 1)])
def test_output_weighted_factors_are_the_float64_optimum(k, n, r):
    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((k, n))
    x = rng.standard_normal((400, k)) * np.geomspace(10, 0.1, k)
    gram = _spd(rng, n, 4)
    chol = svd.whitening(x)[0]
    out_chol = svd.output_whitening(gram, damping=1e-3)
    weighting = gram + 1e-3 * np.mean(np.diag(gram)) * np.eye(n)
    np.testing.assert_allclose(out_chol @ out_chol.T, weighting, rtol=1e-10, atol=1e-12)
    u, v = svd.whitened_factors(w, chol, r, out_chol=out_chol)
    # Reference: the rank-r truncation of Sᵀ·W·L, mapped back by explicit inverses.
    s_t = np.linalg.cholesky(x.T @ x).T
    ell = np.linalg.cholesky(weighting)
    left, sigma, right_t = np.linalg.svd(s_t @ w @ ell)
    best = np.linalg.inv(s_t) @ (left[:, :r] * sigma[:r]) @ right_t[:r] @ np.linalg.inv(ell)
    np.testing.assert_allclose(u @ v, best, rtol=1e-7, atol=1e-9 * np.abs(best).max())

    def weighted(delta):
        return np.trace(delta.T @ (x.T @ x) @ delta @ weighting)

    np.testing.assert_allclose(weighted(w - u @ v), np.sum(sigma[r:] ** 2), rtol=1e-7)
    plain_u, plain_v = svd.whitened_factors(w, chol, r)  # unweighted: optimal for another norm, worse for this one
    assert weighted(w - plain_u @ plain_v) > weighted(w - u @ v)
    decomposition = svd.whitened_decomposition(w, chol, out_chol)
    np.testing.assert_allclose(decomposition[1], sigma[: min(k, n)], rtol=1e-9)
    reused = svd.whitened_factors(w, chol, r, decomposition, out_chol)
    np.testing.assert_allclose(reused[0] @ reused[1], u @ v, rtol=1e-12, atol=1e-14)


def test_output_whitening_checks_its_input():
    assert np.array_equal(svd.output_whitening(np.zeros((4, 4))), np.eye(4))  # no gradient reached it: no weighting
    with pytest.raises(ValueError, match="square"):
        svd.output_whitening(np.ones((3, 4)))
    with pytest.raises(ValueError, match="damping"):
        svd.output_whitening(np.eye(3), damping=0.0)
    with pytest.raises(ValueError, match="out_chol"):
        svd.whitened_decomposition(np.ones((5, 3)), np.eye(5), np.eye(4))


class _Shift(nnx.Module):
    """A projection whose output gets a fixed shift [T, N] added (the finite-difference reference's probe)."""

    def __init__(self, inner, shift):
        self.inner, self.shift = inner, shift

    def __call__(self, x):
        y = self.inner(x)
        return y + self.shift.reshape(y.shape)


@pytest.fixture(scope="module")
def tiny():
    model = from_preset("gemma3", "tiny", num_layers=2, vocab_size=300)
    return model, np.random.default_rng(7).integers(0, 300, (16, 24))


def test_output_grams_match_finite_differences(tiny):
    model, _ = tiny
    ids = np.random.default_rng(8).integers(0, 300, (2, 5))
    grams = fisher.output_grams(model, ids, ("mlp",), windows=2, seed=3, progress=False)
    assert set(grams) == {(i, name) for i in range(2) for name in ("gate_proj", "up_proj", "down_proj")}
    table = unembedding(model)
    keys = jax.random.split(jax.random.PRNGKey(3), len(ids))  # the sampling rule output_grams documents
    graphdef, state = nnx.split(model)
    for index, name in ((1, "down_proj"), (0, "up_proj")):
        width = grams[(index, name)].shape[0]
        expected = np.zeros((width, width))
        for window, key in zip(ids, keys):
            tokens = jax.random.categorical(key, final_hidden(model, window[None])[0] @ table.T, axis=-1)

            def log_likelihood(shift, window=window, tokens=tokens, index=index, name=name):
                shifted = nnx.merge(graphdef, state)
                mlp = shifted.layers[index].mlp
                setattr(mlp, name, _Shift(getattr(mlp, name), shift))
                logits = final_hidden(shifted, window[None])[0] @ table.T
                return jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, None], -1))

            # Central differences along every (position, output) coordinate, all in one vmapped pass.
            step = 1e-2
            basis = np.eye(len(window) * width, dtype=np.float32).reshape(-1, len(window), width) * step
            plus = jax.jit(jax.vmap(log_likelihood))(jnp.asarray(basis))
            minus = jax.jit(jax.vmap(log_likelihood))(jnp.asarray(-basis))
            g = (np.asarray(plus, np.float64) - np.asarray(minus, np.float64)).reshape(len(window), width) / (2 * step)
            expected += g.T @ g
        np.testing.assert_allclose(grams[(index, name)], expected, rtol=2e-2, atol=2e-3 * np.abs(expected).max())


def _weighted_error(kernel, factors, inputs, gram):
    delta = np.asarray(kernel, np.float64) - np.asarray(factors[0], np.float64) @ np.asarray(factors[1], np.float64)
    return np.trace(delta.T @ (inputs.T @ inputs) @ delta @ gram)


def test_fisher_step_weights_every_projection_by_its_output_gram(tiny):
    model, calibration = tiny
    weighted = compress_model(
        model,
        Recipe(keep=0.5, method="whitened", steps=("fisher",), block=8),
        calibration_ids=calibration,
        progress=False,
    )
    plain = compress_model(
        model, Recipe(keep=0.5, method="whitened", steps=(), block=8), calibration_ids=calibration, progress=False
    )
    assert all(isinstance(layer.mlp, SVDMLP) for layer in weighted.layers)
    grams = fisher.output_grams(model, calibration, ("mlp",), progress=False)
    x, positions, masks = calibration_batch(model, calibration)
    for index, layer in enumerate(model.layers):
        mask = masks[layer.self_attn.spec.sliding_window]
        inputs = dict(
            zip(
                ("gate_proj", "down_proj"),
                record_inputs(layer, x, positions, mask, [("mlp", "gate_proj"), ("mlp", "down_proj")])[1],
            )
        )
        inputs["up_proj"] = inputs["gate_proj"]
        x = record_inputs(layer, x, positions, mask, [])[0]
        for name in ("gate_proj", "up_proj", "down_proj"):
            gram = grams[(index, name)]
            gram = gram + svd.OUTPUT_DAMPING * np.mean(np.diag(gram)) * np.eye(len(gram))
            kernel = getattr(layer.mlp, name).kernel[...]
            mine = [getattr(getattr(weighted.layers[index].mlp, name), part)[...] for part in "uv"]
            theirs = [getattr(getattr(plain.layers[index].mlp, name), part)[...] for part in "uv"]
            x64 = inputs[name].astype(np.float64)
            assert _weighted_error(kernel, mine, x64, gram) < _weighted_error(kernel, theirs, x64, gram)
    with pytest.raises(ValueError, match="fisher"):
        compress_model(
            model, Recipe(keep=0.5, method="svd", steps=("fisher",)), calibration_ids=calibration, progress=False
        )


def test_sensitivity_measures_the_output_weighted_truncation(tiny):
    model, calibration = tiny
    calibration = calibration[:16]  # 384 tokens: enough to fill down_proj's 384-wide Gram matrix
    grams = fisher.output_grams(model, calibration, ("mlp",), windows=4, progress=False)
    out_chol = svd.output_whitening(grams[(1, "down_proj")])
    probes = {(i, name): [5] for i in range(2) for name in ("gate_proj", "up_proj", "down_proj")}
    chols = {(1, "down_proj"): out_chol}
    measured = kl_sensitivity(
        model, calibration, ("mlp",), probes, probes=KLProbes(top_k=300), output_chols=chols, progress=False
    )
    measured = measured[(1, "down_proj")][5]
    # Reference: the dense model with layer 1's down_proj replaced by its output-weighted truncation, KL in float64.
    x, positions, masks = calibration_batch(model, calibration)
    layer0, layer1 = model.layers
    x = record_inputs(layer0, x, positions, masks[layer0.self_attn.spec.sliding_window], [])[0]
    hidden = record_inputs(layer1, x, positions, masks[layer1.self_attn.spec.sliding_window], [("mlp", "down_proj")])
    kernel = np.asarray(layer1.mlp.down_proj.kernel[...], np.float64)
    u, v = svd.whitened_factors(kernel, svd.whitening(hidden[1][0].astype(np.float64))[0], 5, out_chol=out_chol)
    truncated = nnx.clone(model)
    truncated.layers[1].mlp.down_proj.kernel[...] = jnp.asarray(u @ v, jnp.float32)
    table = np.asarray(unembedding(model), np.float64)

    def log_probs(m):
        logits = np.asarray(final_hidden(m, calibration[-2:]), np.float64).reshape(-1, table.shape[1]) @ table.T
        logits -= logits.max(-1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(-1, keepdims=True))

    teacher, student = log_probs(model), log_probs(truncated)
    expected = np.mean(np.sum(np.exp(teacher) * (teacher - student), -1))
    np.testing.assert_allclose(measured, expected, rtol=2e-3)


def test_compression_reuses_the_sensitivity_decompositions(tiny):
    model, calibration = tiny
    include = ("mlp", "attention")
    grams = fisher.output_grams(model, calibration, include, windows=4, progress=False)
    out_chols = {key: svd.output_whitening(gram) for key, gram in grams.items()}
    rng = np.random.default_rng(11)
    ranks = {}
    for index, layer in enumerate(model.layers):
        for parent, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", MLP_NAMES)):
            for name in names:
                kernel = getattr(getattr(layer, parent), name).kernel
                ranks[(index, name)] = int(rng.integers(1, min(kernel.shape)))  # ragged, different per projection
    decompositions = {}
    kl_sensitivity(
        model,
        calibration,
        include,
        {key: [1] for key in ranks},
        output_chols=out_chols,
        decompositions=decompositions,
        progress=False,
    )
    assert set(decompositions) == set(ranks)
    reused, fresh = nnx.clone(model), nnx.clone(model)
    options = LayerwiseOptions()
    args = (calibration, include, ranks, "whitened", options)
    compress_layers(reused, model, *args, output_chols=out_chols, decompositions=decompositions, progress=False)
    compress_layers(fresh, model, *args, output_chols=out_chols, progress=False)
    for key, rank in ranks.items():
        index, name = key
        parent = "mlp" if name in MLP_NAMES else "self_attn"
        mine, theirs = (getattr(getattr(m.layers[index], parent), name) for m in (reused, fresh))
        assert mine.u.shape[1] == rank
        product = np.asarray(mine.u[...], np.float64) @ np.asarray(mine.v[...], np.float64)
        expected = np.asarray(theirs.u[...], np.float64) @ np.asarray(theirs.v[...], np.float64)
        np.testing.assert_allclose(product, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    with pytest.raises(ValueError, match=r"decompositions: no entry for \[\(0, 'q_proj'\)"):
        partial = {key: value for key, value in decompositions.items() if key != (0, "q_proj")}
        compress_layers(nnx.clone(model), model, *args, decompositions=partial, progress=False)
    with pytest.raises(ValueError, match="decompositions: .* without sequential"):
        sequential_args = (calibration, include, ranks, "whitened", LayerwiseOptions(sequential=True))
        compress_layers(
            nnx.clone(model),
            model,
            *sequential_args,
            decompositions=decompositions,
            progress=False,
        )


def test_fisher_losses_are_the_weighted_truncation_errors(tiny):
    model, calibration = tiny
    include = ("mlp", "attention")
    grams = fisher.output_grams(model, calibration, include, windows=4, progress=False)
    out_chols = {key: svd.output_whitening(gram) for key, gram in grams.items()}
    decompositions = {}
    losses = fisher_losses(model, calibration, include, out_chols, decompositions=decompositions, progress=False)
    assert set(losses) == set(decompositions) == set(out_chols)
    rng = np.random.default_rng(12)
    for (index, name), loss in losses.items():
        parent = "mlp" if name in MLP_NAMES else "self_attn"
        kernel = np.asarray(getattr(getattr(model.layers[index], parent), name).kernel[...], np.float64)
        assert loss.shape == (min(kernel.shape) + 1,) and loss[-1] == 0.0
        assert np.all(np.diff(loss) <= 0)
        chol, _, out_chol = decompositions[(index, name)]
        # Reference: the weighted error tr(ΔWᵀ·S·Sᵀ·ΔW·L·Lᵀ) of the rank-r factors, products in float64.
        for rank in rng.integers(1, min(kernel.shape), 2):
            u, v = svd.whitened_factors(kernel, chol, int(rank), out_chol=out_chol)
            delta = kernel - u @ v
            expected = np.trace(delta.T @ chol @ chol.T @ delta @ out_chol @ out_chol.T)
            np.testing.assert_allclose(loss[rank], expected, rtol=1e-6)
    partial = {key: value for key, value in out_chols.items() if key != (1, "o_proj")}
    with pytest.raises(ValueError, match=r"output_chols: no output weighting for \[\(1, 'o_proj'\)\]"):
        fisher_losses(model, calibration, include, partial, progress=False)


def test_compress_layers_leaves_projections_of_rank_none_dense(tiny):
    model, calibration = tiny
    rng = np.random.default_rng(12)
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    ranks = {}
    for index, layer in enumerate(model.layers):
        for parent, names in (("self_attn", attention), ("mlp", MLP_NAMES)):
            for name in names:
                ranks[(index, name)] = int(rng.integers(1, min(getattr(getattr(layer, parent), name).kernel.shape)))
    for key in ((0, "k_proj"), (0, "down_proj"), (1, "gate_proj"), (1, "up_proj"), (1, "down_proj")):
        ranks[key] = None  # layer 1's MLP wholly dense, layer 0's partly
    built = {}
    for include, sequential in ((("mlp", "attention"), False), (("mlp",), False), (("mlp",), True)):
        compressed = nnx.clone(model)
        selected = {key: r for key, r in ranks.items() if ("mlp" if key[1] in MLP_NAMES else "attention") in include}
        options = LayerwiseOptions(sequential=sequential)
        compress_layers(compressed, model, calibration, include, selected, "whitened", options, progress=False)
        for (index, name), rank in selected.items():
            parent = "mlp" if name in MLP_NAMES else "self_attn"
            mine = getattr(getattr(compressed.layers[index], parent), name)
            if rank is None:
                dense = getattr(getattr(model.layers[index], parent), name).kernel[...]
                np.testing.assert_array_equal(mine.kernel[...], dense)
            else:
                assert isinstance(mine, SVDLinear) and mine.rank == rank
        assert all(isinstance(layer.mlp, GatedMLP) for layer in compressed.layers)
        built[(include, sequential)] = compressed
    # Layer 0's gate and up see the dense model's inputs either way: sequential calibration with a dense down_proj
    # factors them alike.
    for name in ("gate_proj", "up_proj"):
        a, b = (getattr(built[(("mlp",), s)].layers[0].mlp, name) for s in (False, True))
        np.testing.assert_allclose(
            np.asarray(a.u[...], np.float64) @ np.asarray(a.v[...], np.float64),
            np.asarray(b.u[...], np.float64) @ np.asarray(b.v[...], np.float64),
            rtol=1e-5,
            atol=1e-6,
        )


def _rank(projection):
    return projection.u.shape[1] if isinstance(projection, SVDLinear) else None


def test_allocate_ranks_by_the_fisher_losses_after_the_fisher_step(tiny):
    model, calibration = tiny
    steps = ("fisher", "allocate")
    compressed = compress_model(
        model, Recipe(keep=0.6, method="whitened", steps=steps, block=8), calibration_ids=calibration, progress=False
    )
    grams = fisher.output_grams(model, calibration, ("mlp",), progress=False)
    out_chols = {key: svd.output_whitening(gram) for key, gram in grams.items()}
    losses = fisher_losses(model, calibration, ("mlp",), out_chols, progress=False)
    keys = [(index, name) for index in range(len(model.layers)) for name in MLP_NAMES]
    shapes = [getattr(model.layers[index].mlp, name).kernel.shape for index, name in keys]
    curves = [losses[key] for key in keys]

    def ranks_of(model):  # None where the projection stayed dense
        return [_rank(getattr(model.layers[index].mlp, name)) for index, name in keys]

    got = ranks_of(compressed)
    assert got == allocate_ranks(curves, shapes, 0.6, 8, allow_dense=True)
    assert None in got  # the tiny model's most sensitive projections cost less dense than at their largest rank
    assert sum(k * n if r is None else r * (k + n) for r, (k, n) in zip(got, shapes)) <= 0.6 * sum(
        k * n for k, n in shapes
    )
    for index, layer in enumerate(compressed.layers):
        dense_here = [name for name in MLP_NAMES if got[keys.index((index, name))] is None]
        assert isinstance(layer.mlp, GatedMLP if dense_here else SVDMLP)
        for name in dense_here:  # the dense weight itself, untouched
            np.testing.assert_array_equal(
                getattr(layer.mlp, name).kernel[...], getattr(model.layers[index].mlp, name).kernel[...]
            )
    factored = compress_model(
        model,
        Recipe(keep=0.6, method="whitened", steps=steps, block=8, allow_dense=False),
        calibration_ids=calibration,
        progress=False,
    )
    assert ranks_of(factored) == allocate_ranks(curves, shapes, 0.6, 8)
    exact = compress_model(
        model,
        Recipe(keep=0.6, method="whitened", steps=steps, block=8, allocation_solver="exact"),
        calibration_ids=calibration,
        progress=False,
    )
    assert ranks_of(exact) == allocate_ranks(curves, shapes, 0.6, 8, allow_dense=True, solver="exact")
    by_kl = compress_model(
        model,
        Recipe(keep=0.5, method="whitened", steps=steps, block=8, allocation_loss="kl", allow_dense=False),
        calibration_ids=calibration,
        progress=False,
    )
    assert all(isinstance(layer.mlp, SVDMLP) for layer in by_kl.layers)
    with pytest.raises(ValueError, match="allow_dense: got 1, expected a bool"):
        compress_model(
            model,
            Recipe(keep=0.5, method="whitened", steps=steps, allow_dense=1),
            calibration_ids=calibration,
            progress=False,
        )
    with pytest.raises(ValueError, match=r"allocation_solver: got 'dp', expected one of \('lagrangian', 'exact'\)"):
        compress_model(
            model,
            Recipe(keep=0.5, method="whitened", steps=steps, allocation_solver="dp"),
            calibration_ids=calibration,
            progress=False,
        )
    for allocation_loss, steps, match in (
        ("fisher", ("allocate",), "'fisher' predicts from the 'fisher' step"),
        ("kl", ("fisher",), "only used by the 'allocate' step"),
        ("measured", steps, r"expected None or one of \('fisher', 'kl'\)"),
    ):
        with pytest.raises(ValueError, match=match):
            compress_model(
                model,
                Recipe(keep=0.5, method="whitened", steps=steps, allocation_loss=allocation_loss),
                calibration_ids=calibration,
                progress=False,
            )
