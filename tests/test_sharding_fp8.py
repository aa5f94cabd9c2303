"""fp8 factors under tensor parallelism on 8 CPU devices: scales split with their factor's columns.

Runs itself in a subprocess with 8 host devices, like test_sharding_spmd.py (see spmd_helpers).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mlp_calls import svd_mlp_of_factors
from spmd_helpers import Checks, check_test, run_checks
from spmd_helpers import collectives as _collectives
from spmd_helpers import mesh as _mesh
from spmd_helpers import rng as _rng

import jax_neuronmm as jn
from jax_neuronmm.compress import quantize_fp8

CHECKS = Checks()
check = CHECKS.check


def _matmul_operands(name, tokens=14, k=64, r=24, n=40, dtype=np.float32):
    stream = _rng(name)
    x = stream.standard_normal((tokens, k)).astype(dtype)
    u = stream.standard_normal((k, r)) * np.logspace(-2, 2, r) / np.sqrt(k)
    v = stream.standard_normal((r, n)) / np.logspace(-2, 2, r)[:, None] / np.sqrt(r)
    (uq, us), (vq, vs) = quantize_fp8(u), quantize_fp8(v)
    return x, uq, vq, us, vs


def _dequantized(values, scale):
    return np.asarray(values, np.float64) * np.asarray(scale, np.float64)


def _matmul(x, uq, vq, us, vs):
    return jn.svd_matmul(x, uq, vq, u_scale=us, v_scale=vs)


def _run_layout(fn, args, specs):
    shardings = [NamedSharding(_mesh(), s) for s in specs]
    jitted = jax.jit(fn, in_shardings=shardings)
    placed = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    return np.asarray(jitted(*placed)), _collectives(jitted.lower(*placed).compile().as_text())


def _assert_matmul_layout(name, specs, expected, dtype=np.float32, rtol=1e-5):
    x, uq, vq, us, vs = _matmul_operands(name, dtype=dtype)
    sharded, collectives = _run_layout(_matmul, (x, uq, vq, us, vs), specs)
    want = np.asarray(x, np.float64) @ _dequantized(uq, us) @ _dequantized(vq, vs)
    np.testing.assert_allclose(sharded.astype(np.float64), want, rtol=rtol, atol=rtol * np.abs(want).max())
    assert collectives == expected, f"collectives {collectives}, expected {expected}"


@check
def matmul_column_parallel_v_scale_splits_with_v():
    _assert_matmul_layout("column", (P("data"), P(), P(None, "model"), P(), P("model")), [])


@check
def matmul_rank_parallel_u_scale_splits_with_rank():
    _assert_matmul_layout(
        "rank", (P("data"), P(None, "model"), P("model"), P("model"), P()), [("all-reduce", "f32[7,40]")]
    )


@check
def matmul_row_parallel_one_all_reduce():
    _assert_matmul_layout("row", (P(None, "model"), P("model"), P(), P(), P()), [("all-reduce", "f32[14,40]")])


@check
def matmul_rank_parallel_on_the_emulator_backend():
    with jn.use_backend("emulator"):
        _assert_matmul_layout(
            "rank_emulated",
            (P("data"), P(None, "model"), P("model"), P("model"), P()),
            [("all-reduce", "f32[7,40]")],
            dtype=jnp.bfloat16,
            rtol=2e-2,
        )


@check
def mlp_megatron_scales_split_with_the_intermediate():
    stream = _rng("mlp")
    h, i, (rg, ru, rd) = 48, 64, (16, 12, 20)
    x = stream.standard_normal((2, 6, h)).astype(np.float32)
    shapes = [(h, rg), (rg, i), (h, ru), (ru, i), (i, rd), (rd, h)]
    quantized = [quantize_fp8(stream.standard_normal(s) / np.sqrt(s[0])) for s in shapes]
    factors, scales = [q[0] for q in quantized], [q[1] for q in quantized]

    def mlp(x, *weights):
        return svd_mlp_of_factors(x, *weights)

    factor_specs = [P(), P(None, "model"), P(), P(None, "model"), P("model"), P()]
    scale_specs = [P(), P("model"), P(), P("model"), P(), P()]
    sharded, collectives = _run_layout(mlp, (x, *factors, *scales), [P("data"), *factor_specs, *scale_specs])
    d = [_dequantized(q, s) for q, s in quantized]
    x64 = x.astype(np.float64)
    gate = x64 @ d[0] @ d[1]
    want = (gate / (1 + np.exp(-gate)) * (x64 @ d[2] @ d[3])) @ d[4] @ d[5]
    np.testing.assert_allclose(sharded, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert collectives == [("all-reduce", "f32[1,6,48]")], collectives


test_sharding = check_test(CHECKS)  # one subprocess runs every check (conftest.py's check_results)


if __name__ == "__main__":
    run_checks(CHECKS)
