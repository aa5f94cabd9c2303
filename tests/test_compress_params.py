"""compress_params over Linen variables and NNX state: selection, factors, report, errors."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_neuronmm.compress import DEFAULT_INCLUDE, block_aligned_rank, compress_params, truncated_svd, whitened_svd
from jax_neuronmm.nn import SVDDense


def linen_params(rng, hidden=48, intermediate=100, layers=2):
    """A Linen-style variables dict: attention + gated MLP per layer, plus an embedding."""

    def dense(k, n, bias=False):
        entry = {"kernel": jnp.asarray(rng.standard_normal((k, n)), jnp.float32)}
        if bias:
            entry["bias"] = jnp.asarray(rng.standard_normal(n), jnp.float32)
        return entry

    params = {"embed": {"embedding": jnp.asarray(rng.standard_normal((30, hidden)), jnp.float32)}}
    for index in range(layers):
        params[f"layers_{index}"] = {
            "attn": {"q_proj": dense(hidden, hidden), "o_proj": dense(hidden, hidden, bias=True)},
            "mlp": {
                "gate_proj": dense(hidden, intermediate),
                "up_proj": dense(hidden, intermediate),
                "down_proj": dense(intermediate, hidden, bias=True),
            },
        }
    return {"params": params}


def test_default_include_matches_mlp_projections_only():
    pattern = re.compile(DEFAULT_INCLUDE)
    for path in [
        "params/layers_0/mlp/gate_proj/kernel",
        "layers/3/mlp/down_proj/kernel",
        "params/MlpBlock_0/Dense_0/kernel",
        "model/h/0/ffn/fc1/kernel",
        "params/feed_forward/w1/kernel",
        "blocks/0/fc2/kernel",
        "transformer/h/0/c_fc/kernel",
        "params/layer/up/kernel",
    ]:
        assert pattern.search(path), path
    for path in [
        "params/layers_0/attn/q_proj/kernel",
        "params/lm_head/kernel",
        "params/embed/embedding",
        "params/self_attention/out/kernel",
        "params/upsample/kernel",
        "params/downsample/kernel",
    ]:
        assert not pattern.search(path), path


def test_linen_tree_replaces_mlp_kernels_by_factors(rng):
    params = linen_params(rng)
    new, report = compress_params(params, rank=20, progress=False)
    for index in range(2):
        layer, old = new["params"][f"layers_{index}"], params["params"][f"layers_{index}"]
        assert set(layer["attn"]["q_proj"]) == {"kernel"}  # attention untouched
        np.testing.assert_array_equal(layer["attn"]["o_proj"]["kernel"], old["attn"]["o_proj"]["kernel"])
        for name in ("gate_proj", "up_proj", "down_proj"):
            entry = layer["mlp"][name]
            assert "kernel" not in entry
            assert isinstance(entry["u"], jax.Array) and entry["u"].dtype == jnp.float32
            u_want, v_want = truncated_svd(np.asarray(old["mlp"][name]["kernel"]), 20)
            np.testing.assert_array_equal(np.asarray(entry["u"]), u_want)
            np.testing.assert_array_equal(np.asarray(entry["v"]), v_want)
        np.testing.assert_array_equal(layer["mlp"]["down_proj"]["bias"], old["mlp"]["down_proj"]["bias"])
    np.testing.assert_array_equal(new["params"]["embed"]["embedding"], params["params"]["embed"]["embedding"])
    assert [layer.path for layer in report.layers] == [
        f"params/layers_{i}/mlp/{name}" for i in range(2) for name in ("gate_proj", "up_proj", "down_proj")
    ]


def test_report_counts_and_errors(rng):
    params = linen_params(rng, hidden=64, intermediate=200, layers=1)
    new, report = compress_params(params, keep=0.5, block=16, progress=False)
    rank = block_aligned_rank(64, 200, 0.5, 16)
    assert report.method == "svd" and report.keep == 0.5 and report.rank is None
    for layer in report.layers:
        k, n = layer.shape
        assert layer.rank == rank
        assert layer.params_before == k * n and layer.params_after == rank * (k + n)
        kernel = np.asarray(params["params"]["layers_0"]["mlp"][layer.path.split("/")[-1]]["kernel"], np.float64)
        sigma = np.linalg.svd(kernel, compute_uv=False)
        want = np.sqrt(np.sum(sigma[rank:] ** 2) / np.sum(sigma**2))
        np.testing.assert_allclose(layer.relative_error, want, rtol=1e-4)
        assert layer.output_error is None and layer.damping == 0.0
    assert report.params_before == 3 * 64 * 200 and report.params_after == 3 * rank * 264
    assert report.ranks == {f"params/layers_0/mlp/{name}": rank for name in ("gate_proj", "up_proj", "down_proj")}
    text = str(report)
    assert "params/layers_0/mlp/gate_proj" in text and f"{report.params_after:,}" in text
    assert report.to_dict()["layers"][0]["shape"] == [64, 200]


def test_nnx_state_keeps_variable_types(rng):
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.Linear(24, 24, rngs=rngs)
            self.mlp = nnx.Dict(
                gate_proj=nnx.Linear(24, 50, use_bias=False, rngs=rngs), down_proj=nnx.Linear(50, 24, rngs=rngs)
            )
            self.layers = nnx.List([nnx.Linear(24, 24, rngs=rngs)])

    state = nnx.state(Block(nnx.Rngs(int(rng.integers(1 << 30)))))
    new, report = compress_params(state, rank=7, progress=False)
    assert isinstance(new, nnx.State)
    assert isinstance(new["mlp"]["gate_proj"]["u"], nnx.Param)
    assert new["mlp"]["gate_proj"]["u"].shape == (24, 7) and new["mlp"]["down_proj"]["v"].shape == (7, 24)
    assert "kernel" in new["attn"] and "kernel" in new["layers"][0]
    assert sorted(report.ranks) == ["mlp/down_proj", "mlp/gate_proj"]
    kernel = np.asarray(state["mlp"]["down_proj"]["kernel"][...])
    u_want, _ = truncated_svd(kernel, 7)
    np.testing.assert_array_equal(np.asarray(new["mlp"]["down_proj"]["u"][...]), u_want)


def test_include_regex_and_stacked_kernels(rng):
    stacked = {
        "params": {
            "scan": {
                "mlp": {"wi": {"kernel": rng.standard_normal((3, 40, 30)).astype(np.float32)}},
                "attn": {"kernel": rng.standard_normal((3, 30, 30)).astype(np.float32)},
            }
        }
    }
    new, report = compress_params(stacked, rank=5, include=r"scan/", progress=False)
    assert new["params"]["scan"]["mlp"]["wi"]["u"].shape == (3, 40, 5)
    assert isinstance(new["params"]["scan"]["mlp"]["wi"]["u"], np.ndarray)  # numpy stays numpy
    assert new["params"]["scan"]["attn"]["v"].shape == (3, 5, 30)
    layer = report.layers[0]
    assert layer.params_before == 3 * 40 * 30 and layer.params_after == 3 * 5 * 70
    for index in range(3):
        u, v = truncated_svd(stacked["params"]["scan"]["mlp"]["wi"]["kernel"][index], 5)
        np.testing.assert_allclose(new["params"]["scan"]["mlp"]["wi"]["u"][index], u, rtol=1e-5, atol=1e-6)


def test_whitened_method_uses_calibration(rng):
    params = linen_params(rng, hidden=32, intermediate=64, layers=1)
    mixing = np.linalg.qr(rng.standard_normal((32, 32)))[0] * np.logspace(0, -2, 32)
    x = rng.standard_normal((400, 32)) @ mixing.T
    hidden_x = rng.standard_normal((400, 64))
    calibration = {
        "params/layers_0/mlp/gate_proj": x,
        "params/layers_0/mlp/up_proj/kernel": x,
        "params/layers_0/mlp/down_proj": hidden_x,
    }
    new, report = compress_params(params, rank=6, method="whitened", calibration=calibration, progress=False)
    mlp = params["params"]["layers_0"]["mlp"]
    u_want, v_want = whitened_svd(np.asarray(mlp["gate_proj"]["kernel"]), x, 6)
    np.testing.assert_allclose(new["params"]["layers_0"]["mlp"]["gate_proj"]["u"], u_want, rtol=1e-4, atol=1e-5)
    gate_report = report.layers[0]
    kernel = np.asarray(mlp["gate_proj"]["kernel"], np.float64)
    want = np.linalg.norm(x @ kernel - x @ u_want @ v_want) / np.linalg.norm(x @ kernel)
    np.testing.assert_allclose(gate_report.output_error, want, rtol=1e-3)
    # Same rank, plain SVD: the whitened factors have the smaller output error on this input distribution.
    _, plain = compress_params(params, rank=6, progress=False)
    u_plain, v_plain = truncated_svd(kernel, 6)
    assert gate_report.output_error < np.linalg.norm(x @ kernel - x @ u_plain @ v_plain) / np.linalg.norm(x @ kernel)
    assert gate_report.relative_error > plain.layers[0].relative_error  # it trades weight error for output error


def test_deterministic(rng):
    params = linen_params(rng, layers=1)
    first, first_report = compress_params(params, keep=0.4, progress=False)
    second, second_report = compress_params(params, keep=0.4, progress=False)
    jax.tree.map(np.testing.assert_array_equal, first, second)
    assert first_report == second_report


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), "exactly one of keep= or rank="),
        (dict(keep=0.5, rank=4), "exactly one of keep= or rank="),
        (dict(keep=0.0), "keep"),
        (dict(keep=1.2), "keep"),
        (dict(rank=0), "rank"),
        (dict(rank=49), r"params/layers_0/mlp/gate_proj/kernel: rank"),
        (dict(rank=4, method="qr"), "method"),
        (dict(rank=4, method="whitened"), "calibration"),
        (dict(rank=4, calibration={"x": np.ones((2, 2))}), "calibration"),
        (dict(rank=4, include=r"nothing_here"), "matched no kernel"),
    ],
)
def test_bad_arguments(rng, kwargs, match):
    with pytest.raises(ValueError, match=match):
        compress_params(linen_params(rng, layers=1), progress=False, **kwargs)


def test_bad_calibration_and_weights(rng):
    params = linen_params(rng, hidden=16, intermediate=20, layers=1)
    good = {
        f"params/layers_0/mlp/{name}": rng.standard_normal((50, 16 if name != "down_proj" else 20))
        for name in ("gate_proj", "up_proj", "down_proj")
    }
    missing = dict(good)
    del missing["params/layers_0/mlp/up_proj"]
    with pytest.raises(ValueError, match="no activations for layer 'params/layers_0/mlp/up_proj'"):
        compress_params(params, rank=3, method="whitened", calibration=missing, progress=False)
    extra = dict(good, **{"params/layers_0/attn/q_proj": good["params/layers_0/mlp/gate_proj"]})
    with pytest.raises(ValueError, match="not compressed.*attn/q_proj"):
        compress_params(params, rank=3, method="whitened", calibration=extra, progress=False)
    wrong_width = dict(good, **{"params/layers_0/mlp/down_proj": rng.standard_normal((50, 16))})
    with pytest.raises(ValueError, match="down_proj/kernel: activations must have shape \\[n, 20\\]"):
        compress_params(params, rank=3, method="whitened", calibration=wrong_width, progress=False)
    params["params"]["layers_0"]["mlp"]["up_proj"]["kernel"] = (
        params["params"]["layers_0"]["mlp"]["up_proj"]["kernel"].at[2, 3].set(jnp.nan)
    )
    with pytest.raises(ValueError, match="up_proj/kernel: w contains NaN or Inf"):
        compress_params(params, rank=3, progress=False)


class DenseMLP(nn.Module):
    """A two-layer Linen model: the rank sweep below compresses its fc layers."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(96, name="fc1")(x))
        return nn.Dense(40, name="fc2")(x)


class FactoredMLP(nn.Module):
    rank: int

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(SVDDense(96, self.rank, name="fc1")(x))
        return SVDDense(40, self.rank, name="fc2")(x)


def test_compressed_model_error_shrinks_with_rank(rng):
    x = jnp.asarray(rng.standard_normal((16, 40)), jnp.float32)
    variables = DenseMLP().init(jax.random.key(int(rng.integers(1 << 30))), x)
    exact = np.asarray(DenseMLP().apply(variables, x), np.float64)
    errors = []
    for rank in (4, 12, 24, 40):
        compressed, _ = compress_params(variables, rank=rank, progress=False)
        got = np.asarray(FactoredMLP(rank).apply(compressed, x), np.float64)
        errors.append(np.linalg.norm(got - exact) / np.linalg.norm(exact))
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-5  # rank 40 = min(K, N) for both layers: exact up to float32 rounding


def test_nnx_sharding_names_map_to_megatron_factor_layout(rng):
    def param(shape, names):
        return nnx.Param(jnp.asarray(rng.standard_normal(shape), jnp.float32), out_sharding=names, eager_sharding=False)

    state = nnx.State(
        {
            "mlp": {
                "up_proj": {"kernel": param((16, 40), (None, "model"))},
                "down_proj": {"kernel": param((40, 16), ("model", None))},
            }
        }
    )
    new, _ = compress_params(state, rank=4, progress=False)
    up, down = new["mlp"]["up_proj"], new["mlp"]["down_proj"]
    assert up["u"].get_metadata()["out_sharding"] == (None, None)
    assert up["v"].get_metadata()["out_sharding"] == (None, "model")
    assert down["u"].get_metadata()["out_sharding"] == ("model", None)
    assert down["v"].get_metadata()["out_sharding"] == (None, None)
