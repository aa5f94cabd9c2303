"""The emulator backend: jitted JAX code runs the NKI kernels on the CPU emulator and matches XLA."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from mlp_calls import svd_mlp_of_factors

import jax_neuronmm as jn
from nki_kernels import emulator
from nki_kernels.svd_matmul import svd_matmul_kernel


def factors(rng, tokens, k, r, n, dtype=np.float32):
    x = rng.standard_normal(tokens + (k,))
    u = rng.standard_normal((k, r)) / np.sqrt(k)
    v = rng.standard_normal((r, n)) / np.sqrt(r)
    return [a.astype(dtype) for a in (x, u, v)]


def mlp_factors(rng, tokens, hidden, inter, rank, dtype=np.float32):
    shapes = [(hidden, rank), (rank, inter), (hidden, rank), (rank, inter), (inter, rank), (rank, hidden)]
    return [rng.standard_normal(tokens + (hidden,)).astype(dtype)] + [
        (rng.standard_normal(s) / np.sqrt(s[0])).astype(dtype) for s in shapes
    ]


def ref64(x, u, v):
    return (np.asarray(x, np.float64) @ np.asarray(u, np.float64)) @ np.asarray(v, np.float64)


@pytest.mark.parametrize("tokens,k,r,n", [((1,), 100, 1, 1000), ((7,), 200, 130, 37), ((2, 65), 100, 13, 200)])
def test_jitted_svd_matmul_runs_the_kernel_and_matches_xla(rng, tokens, k, r, n):
    x, u, v = factors(rng, tokens, k, r, n)
    fn = jax.jit(lambda x, u, v: jn.svd_matmul(x, u, v) + 1.0)
    with jn.use_backend("emulator"), jn.profile() as prof:
        emulated = np.asarray(fn(x, u, v))
    xla = np.asarray(fn(x, u, v))
    assert [c.name for c in prof.runs] in (["svd_matmul_kernel"], ["svd_matmul_decode_kernel"])
    call = prof.runs[0]
    minimum = 4 * (x.size + u.size + v.size)
    assert call.hbm_bytes_read >= minimum and call.hbm_bytes_written >= 4 * x.size // k * n
    assert call.matmul_count > 0 and call.latency_us["trn1"] > 0 and call.latency_us["trn2"] > 0
    np.testing.assert_allclose(emulated, xla, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(emulated - 1.0, ref64(x, u, v), rtol=1e-5, atol=1e-5)


def test_bf16_on_the_emulator(rng):
    x, u, v = factors(rng, (33,), 200, 40, 300, ml_dtypes.bfloat16)
    with jn.use_backend("emulator"):
        y = jax.jit(jn.svd_matmul)(x, u, v)
    assert y.dtype == jnp.bfloat16
    want = ref64(x, u, v)
    assert np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want) <= 1e-2


def test_switching_backend_relowers_a_jitted_function(rng):
    x, u, v = factors(rng, (4,), 16, 3, 8)
    fn = jax.jit(jn.svd_matmul)
    fn(x, u, v)  # compiled for the default backend first
    with jn.use_backend("emulator"), jn.profile() as prof:
        fn(x, u, v).block_until_ready()
    assert len(prof.runs) == 1
    with jn.profile() as after:
        fn(x, u, v).block_until_ready()
    assert len(after.runs) == 0


def test_grads_run_through_kernels_and_match_xla(rng):
    x, u, v = factors(rng, (6,), 40, 5, 30)
    w = rng.standard_normal((6, 30)).astype(np.float32)
    loss = jax.jit(jax.grad(lambda x, u, v: jnp.sum(jn.svd_matmul(x, u, v) * w), argnums=(0, 1, 2)))
    with jn.use_backend("emulator"), jn.profile() as prof:
        emulated = [np.asarray(g) for g in loss(x, u, v)]
    # The loss is linear, so the forward product is dead code; x̄ = w·vᵀ·uᵀ is the one kernel launch.
    assert [c.name for c in prof.runs] == ["svd_matmul_kernel"]
    x64, u64, v64, w64 = (a.astype(np.float64) for a in (x, u, v, w))
    want = [w64 @ v64.T @ u64.T, x64.T @ (w64 @ v64.T), (x64 @ u64).T @ w64]
    for got, expected in zip(emulated, want):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_vmap_over_stacked_weights_launches_once_per_layer(rng):
    x, _, _ = factors(rng, (5,), 24, 3, 16)
    us = (rng.standard_normal((3, 24, 3)) / 5).astype(np.float32)
    vs = (rng.standard_normal((3, 3, 16)) / 2).astype(np.float32)
    with jn.use_backend("emulator"), jn.profile() as prof:
        y = jax.jit(jax.vmap(jn.svd_matmul, in_axes=(None, 0, 0)))(x, us, vs)
    assert len(prof.runs) == 3
    for i in range(3):
        np.testing.assert_allclose(y[i], ref64(x, us[i], vs[i]), rtol=1e-5, atol=1e-5)


def test_scan_over_layers_on_the_emulator(rng):
    layers = 3
    x = rng.standard_normal((4, 32)).astype(np.float32)
    us = (rng.standard_normal((layers, 32, 4)) / 6).astype(np.float32)
    vs = (rng.standard_normal((layers, 4, 32)) / 2).astype(np.float32)

    def model(x, us, vs):
        return jax.lax.scan(lambda h, w: (jnp.tanh(jn.svd_matmul(h, *w)), None), x, (us, vs))[0]

    with jn.use_backend("emulator"), jn.profile() as prof:
        emulated = jax.jit(model)(x, us, vs)
    assert len(prof.runs) == layers
    np.testing.assert_allclose(emulated, jax.jit(model)(x, us, vs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_jitted_mlp_is_two_kernel_calls(rng, activation):
    args = mlp_factors(rng, (2, 9), 100, 300, 13)
    fn = jax.jit(lambda *a: svd_mlp_of_factors(*a, activation=activation))
    with jn.use_backend("emulator"), jn.profile() as prof:
        emulated = fn(*args)
    assert [c.name for c in prof.runs] == ["svd_mlp_gate_up_kernel", "svd_mlp_down_kernel"]
    np.testing.assert_allclose(emulated, fn(*args), rtol=2e-5, atol=2e-5)


def test_mlp_grad_on_the_emulator_matches_xla(rng):
    args = mlp_factors(rng, (5,), 32, 64, 4)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(svd_mlp_of_factors(*a) ** 2), argnums=tuple(range(7))))
    with jn.use_backend("emulator"), jn.profile() as prof:
        emulated = grad(*args)
    assert len(prof.runs) >= 3
    for got, want in zip(emulated, grad(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_float64_is_refused_with_the_backend_named(rng, x64):
    x, u, v = factors(rng, (3,), 8, 2, 4, np.float64)
    with jn.use_backend("emulator"), pytest.raises(TypeError, match="backend 'emulator'.*float64"):
        jax.jit(jn.svd_matmul)(x, u, v)


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="backend: got 'tpu_kernels'"):
        with jn.use_backend("tpu_kernels"):
            pass
    with pytest.raises(RuntimeError, match="backend 'neuron' needs"):
        jn.set_backend("neuron")
    assert jn.get_backend() == "auto"


def test_environment_variable_selects_the_backend():
    code = (
        "import jax, numpy as np, jax_neuronmm as jn\n"
        "x = np.arange(12, dtype=np.float32).reshape(3, 4); u = np.ones((4, 2), np.float32)\n"
        "with jn.profile() as p:\n"
        "    jax.jit(jn.svd_matmul)(x, u, u.T).block_until_ready()\n"
        "print(jn.get_backend(), [c.name for c in p.runs])\n"
    )
    env = dict(os.environ, JAX_NEURONMM_BACKEND="emulator", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "emulator ['svd_matmul_kernel']"


def test_emulated_nki_jit_accepts_jax_arrays_like_the_real_one(rng):
    """Calling the @nki.jit kernel itself with jax arrays (eager and under jit) runs it through a callback."""
    x, u, v = factors(rng, (7,), 100, 13, 300)
    with jn.profile() as prof:
        eager = svd_matmul_kernel(jnp.asarray(x), jnp.asarray(u), jnp.asarray(v))
        jitted = jax.jit(lambda *a: svd_matmul_kernel(*a) * 2.0)(x, u, v)
        jitted.block_until_ready()
    assert isinstance(eager, jax.Array) and eager.shape == (7, 300)
    assert len(prof.runs) == 2  # output-shape inference does not count as a launch
    np.testing.assert_allclose(eager, ref64(x, u, v), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jitted, 2 * ref64(x, u, v), rtol=1e-5, atol=1e-5)


def test_mlp_with_output_width_unlike_input_width(rng):
    x = rng.standard_normal((3, 40)).astype(np.float32)
    shapes = [(40, 6), (6, 96), (40, 6), (6, 96), (96, 5), (5, 72)]  # H = 40 in, 72 out
    weights = [(rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for s in shapes]
    with jn.use_backend("emulator"), jn.profile() as prof:
        emulated = jax.jit(svd_mlp_of_factors)(x, *weights)
    assert emulated.shape == (3, 72) and len(prof.runs) == 2
    np.testing.assert_allclose(emulated, jax.jit(svd_mlp_of_factors)(x, *weights), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("op", ["svd_matmul", "svd_mlp"])
def test_shape_no_kernel_fits_fails_when_lowering_naming_op_shape_and_target(op):
    # Rank 100000: no block sizes fit SBUF. The reason comes as a ValueError when the computation is lowered,
    # not as a CpuCallback error when it runs.
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    if op == "svd_matmul":
        args = (S((7, 100), f32), S((100, 100000), f32), S((100000, 130), f32))
    else:
        args = (
            S((7, 100), f32),
            S((100, 100000), f32),
            S((100000, 200), f32),
            S((100, 13), f32),
            S((13, 200), f32),
            S((200, 13), f32),
            S((13, 100), f32),
        )
    with (
        jn.use_backend("emulator"),
        emulator.use_target("trn1"),
        pytest.raises(ValueError, match=rf"^{op}: .*\(100, 100000\).* on trn1: .*no block sizes fit"),
    ):
        jax.jit(jn.svd_matmul if op == "svd_matmul" else svd_mlp_of_factors).lower(*args)
