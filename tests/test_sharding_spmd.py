"""Tensor parallelism on 8 CPU devices: layouts under jit, collectives in the compiled HLO, AD in shard_map.

The device count must be fixed before JAX starts, so this module runs itself once in a subprocess with
`--xla_force_host_platform_device_count=8` (`python tests/test_sharding_spmd.py`); the subprocess runs every
check in CHECKS and prints one JSON line {check name: null or the failure}. Each pytest test reports one check.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mlp_calls import svd_mlp_of_factors
from spmd_helpers import DEVICE_COUNT, Checks, check_test, run_checks
from spmd_helpers import collectives as _collectives
from spmd_helpers import matmul_f64 as _matmul_f64
from spmd_helpers import matmul_operands as _matmul_operands
from spmd_helpers import mesh as _mesh
from spmd_helpers import mlp_f64 as _mlp_f64
from spmd_helpers import mlp_operands as _mlp_operands
from spmd_helpers import rng as _rng

import jax_neuronmm as jn
from jax_neuronmm import lowering
from jax_neuronmm.host_callback import HostKernel
from jax_neuronmm.svd_mlp import WEIGHT_NAMES

# ---------------------------------------------------------------------------------------------------------------
# The checks (run in the 8-device subprocess only).

CHECKS = Checks()
check = CHECKS.check


def _run_layout(fn, args, specs, out_spec=None):
    shardings = [NamedSharding(_mesh(), s) for s in specs]
    out = None if out_spec is None else NamedSharding(_mesh(), out_spec)
    jitted = jax.jit(fn, in_shardings=shardings, out_shardings=out)
    placed = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    collectives = _collectives(jitted.lower(*placed).compile().as_text())
    return np.asarray(jitted(*placed)), collectives


def _assert_matmul_layout(name, specs, expected, out_spec=None, **shape):
    x, u, v = _matmul_operands(name, **shape)
    single = np.asarray(jax.jit(jn.svd_matmul)(x, u, v))
    sharded, collectives = _run_layout(jn.svd_matmul, (x, u, v), specs, out_spec)
    reference = _matmul_f64(x, u, v)
    scale = np.abs(reference).max()
    np.testing.assert_allclose(sharded, reference, rtol=1e-5, atol=1e-6 * scale)
    # Summed factors change the summation order only.
    np.testing.assert_allclose(sharded, single, rtol=1e-5, atol=1e-6 * scale)
    assert collectives == expected, f"collectives {collectives}, expected {expected}"


@check
def matmul_tokens_sharded_no_communication():
    _assert_matmul_layout("tokens", (P("data"), P(), P()), [])


@check
def matmul_column_parallel_no_communication():
    _assert_matmul_layout("column", (P("data"), P(), P(None, "model")), [], n=44)


@check
def matmul_row_parallel_one_all_reduce_of_output():
    _assert_matmul_layout("row", (P("data", "model"), P("model"), P()), [("all-reduce", "f32[7,40]")])


@check
def matmul_rank_parallel_one_all_reduce_of_output():
    _assert_matmul_layout("rank", (P("data"), P(None, "model"), P("model")), [("all-reduce", "f32[7,40]")])


@check
def matmul_row_parallel_reduce_scatter_when_output_wants_n_split():
    _assert_matmul_layout(
        "row_rs", (P(None, "model"), P("model"), P()), [("reduce-scatter", "f32[14,10]")], out_spec=P(None, "model")
    )


@check
def matmul_row_and_rank_on_two_axes_one_all_reduce():
    _assert_matmul_layout("row_rank", (P(None, "model"), P("model", "data"), P("data")), [("all-reduce", "f32[14,40]")])


@check
def matmul_3d_activations_batch_and_sequence_sharded():
    _assert_matmul_layout("3d", (P("data", "model"), P(), P()), [], tokens=(4, 12))


@check
def matmul_bf16_row_parallel_sums_in_float32():
    x, u, v = _matmul_operands("bf16", dtype="float32")
    x, u, v = (a.astype(jnp.bfloat16) for a in (x, u, v))
    sharded, collectives = _run_layout(jn.svd_matmul, (x, u, v), (P(None, "model"), P("model"), P()))
    assert sharded.dtype == jnp.bfloat16
    assert collectives == [("all-reduce", "f32[14,40]")], collectives
    reference = _matmul_f64(*(np.asarray(a, np.float64) for a in (x, u, v)))
    np.testing.assert_allclose(sharded.astype(np.float64), reference, rtol=0.05, atol=0.05 * np.abs(reference).max())


@check
def matmul_per_shard_host_callback_sees_only_blocks():
    # A backend that is a host callback (like the emulator) must run on each device's blocks.
    seen = []

    def on_host(x, u, v, *, n_batch, precision, out_dtype):
        seen.append((x.shape, u.shape, v.shape))
        return (x.astype(np.float64) @ u @ v).astype(out_dtype)

    original = lowering.local_impl
    lowering.local_impl = lambda primitive, platform: (
        HostKernel(on_host) if primitive is jn.svd_matmul_p else original(primitive, platform)
    )
    try:
        x, u, v = _matmul_operands("callback")

        def fn(*a):
            return jn.svd_matmul(*a)  # a fresh function: no cached lowering

        sharded, collectives = _run_layout(fn, (x, u, v), (P("data", "model"), P("model"), P()))
    finally:
        lowering.local_impl = original
    np.testing.assert_allclose(sharded, _matmul_f64(x, u, v), rtol=1e-4, atol=1e-4)
    assert collectives == [("all-reduce", "f32[7,40]")], collectives
    assert seen and set(seen) == {((7, 16), (16, 24), (24, 40))}, seen


@check
def matmul_emulator_backend_runs_kernels_on_blocks():
    # The real emulator backend: one NKI kernel launch per device, each reading only that device's blocks.
    x, u, v = _matmul_operands("emulator")

    def fn(*a):
        return jn.svd_matmul(*a)  # a fresh function: no cached lowering

    with jn.use_backend("emulator"), jn.profile() as prof:
        sharded, collectives = _run_layout(fn, (x, u, v), (P("data", "model"), P("model"), P()))
    np.testing.assert_allclose(sharded, _matmul_f64(x, u, v), rtol=1e-4, atol=1e-4)
    assert collectives == [("all-reduce", "f32[7,40]")], collectives
    block_bytes = 4 * (7 * 16 + 16 * 24 + 24 * 40)  # x, u, v blocks read once each
    assert len(prof.runs) == DEVICE_COUNT, [c.name for c in prof.runs]
    assert {c.hbm_bytes_read for c in prof.runs} == {block_bytes}, [c.hbm_bytes_read for c in prof.runs]


@check
def emulator_blocks_no_kernel_fits_fail_when_compiling():
    # Rank 400000 split over "model" (4) is 100000 per device: no block sizes fit. The blocks are known only
    # once the partitioner has chosen them, so the reason (op, block shapes, target) comes when compiling, from
    # the partition callback, not inside a host callback at run time.
    S = jax.ShapeDtypeStruct
    mesh = _mesh()

    def operands(rank):
        return (
            S((8, 100), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
            S((100, rank), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))),
            S((rank, 8), jnp.float32, sharding=NamedSharding(mesh, P("model"))),
        )

    with jn.use_backend("emulator"):
        # 100000 in all is 25000 per device, which fits: the blocks are checked, not the whole arrays.
        jax.jit(lambda *a: jn.svd_matmul(*a)).lower(*operands(100000)).compile()
        try:
            jax.jit(lambda *a: jn.svd_matmul(*a)).lower(*operands(400000)).compile()
        except Exception as error:  # JAX reports a partition callback's error as a JaxRuntimeError
            message = str(error)
        else:
            raise AssertionError("no error")
    assert re.search(
        r"svd_matmul: operands of shapes \(4, 100\), \(100, 100000\), \(100000, 8\) cannot run as "
        r"NKI kernels on trn2: .*no block sizes fit",
        message,
    ), message


@check
def mlp_emulator_backend_megatron_two_kernels_per_device():
    x, *weights = _mlp_operands("mlp_emulator")
    specs = (P("data"), P(), P(None, "model"), P(), P(None, "model"), P("model"), P())

    def fn(*a):
        return svd_mlp_of_factors(*a)

    with jn.use_backend("emulator"), jn.profile() as prof:
        sharded, collectives = _run_layout(fn, (x, *weights), specs)
    np.testing.assert_allclose(sharded, _mlp_f64(x, *weights), rtol=1e-4, atol=1e-4)
    assert [op for op, _ in collectives] == ["all-reduce"], collectives
    names = sorted(c.name for c in prof.runs)
    assert names == ["svd_mlp_down_kernel"] * DEVICE_COUNT + ["svd_mlp_gate_up_kernel"] * DEVICE_COUNT, names


MEGATRON = (P("data"), P(), P(None, "model"), P(), P(None, "model"), P("model"), P())


@check
def mlp_megatron_one_all_reduce_for_whole_mlp():
    args = _mlp_operands("megatron")
    single = np.asarray(jax.jit(svd_mlp_of_factors)(*args))
    sharded, collectives = _run_layout(svd_mlp_of_factors, args, MEGATRON)
    np.testing.assert_allclose(sharded, _mlp_f64(*args), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(sharded, single, rtol=1e-5, atol=1e-5)
    assert collectives == [("all-reduce", "f32[1,6,48]")], collectives


@check
def mlp_tokens_sharded_no_communication():
    args = _mlp_operands("mlp_tokens", tokens=(4, 8))
    sharded, collectives = _run_layout(svd_mlp_of_factors, args, (P("data", "model"),) + (P(),) * 6)
    np.testing.assert_allclose(sharded, _mlp_f64(*args), rtol=1e-4, atol=1e-4)
    assert collectives == [], collectives


@check
def mlp_down_rank_sharded_one_all_reduce():
    args = _mlp_operands("mlp_rd")
    specs = (P(), P(), P(), P(), P(), P(None, "model"), P("model"))
    sharded, collectives = _run_layout(svd_mlp_of_factors, args, specs)
    np.testing.assert_allclose(sharded, _mlp_f64(*args), rtol=1e-4, atol=1e-4)
    assert collectives == [("all-reduce", "f32[2,6,48]")], collectives


@check
def layer_of_two_matmuls_megatron_attention_style():
    # Column-parallel then row-parallel svd_matmul (attention-style): one all-reduce for both.
    rng = _rng("two")
    x = rng.standard_normal((8, 32)).astype(np.float32)
    u1, v1 = rng.standard_normal((32, 8)).astype(np.float32), rng.standard_normal((8, 64)).astype(np.float32)
    u2, v2 = rng.standard_normal((64, 8)).astype(np.float32), rng.standard_normal((8, 32)).astype(np.float32)

    def fn(x, u1, v1, u2, v2):
        return jn.svd_matmul(jnp.tanh(jn.svd_matmul(x, u1, v1)), u2, v2)

    sharded, collectives = _run_layout(fn, (x, u1, v1, u2, v2), (P(), P(), P(None, "model"), P("model"), P()))
    reference = np.tanh(_matmul_f64(x, u1, v1)) @ u2.astype(np.float64) @ v2
    np.testing.assert_allclose(sharded, reference, rtol=1e-4, atol=1e-4)
    assert collectives == [("all-reduce", "f32[8,32]")], collectives


def _shard_map(fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=_mesh(), in_specs=in_specs, out_specs=out_specs))


@check
def shard_map_grads_replicated_weights_sharded_tokens():
    with jax.enable_x64(True):
        x, u, v = (a.astype(np.float64) for a in _matmul_operands("sm_grad", tokens=(16,)))
        cotangent = _rng("sm_ct").standard_normal((16, 40))
        tokens = P(("data", "model"))
        apply = _shard_map(jn.svd_matmul, (tokens, P(), P()), tokens)

        def loss(x, u, v):
            return jnp.sum(apply(x, u, v) * cotangent)

        dx, du, dv = jax.grad(loss, argnums=(0, 1, 2))(x, u, v)
    np.testing.assert_allclose(dx, cotangent @ v.T @ u.T, rtol=1e-10)
    np.testing.assert_allclose(du, x.T @ cotangent @ v.T, rtol=1e-10)
    np.testing.assert_allclose(dv, (x @ u).T @ cotangent, rtol=1e-10)


@check
def shard_map_megatron_mlp_grads_match_single_device():
    # The user's own Megatron MLP inside shard_map: x invariant over "model", weights split on I.
    with jax.enable_x64(True):
        args = [a.astype(np.float64) for a in _mlp_operands("sm_mlp", tokens=(4, 3))]
        cotangent = _rng("sm_mlp_ct").standard_normal((4, 3, 48))

        def tp_mlp(*blocks):
            return jax.lax.psum(svd_mlp_of_factors(*blocks), "model")

        specs = (P("data"), P(), P(None, "model"), P(), P(None, "model"), P("model"), P())
        apply = _shard_map(tp_mlp, specs, P("data"))
        grads = jax.grad(lambda *a: jnp.sum(apply(*a) * cotangent), argnums=tuple(range(7)))(*args)
        expected = jax.grad(lambda *a: jnp.sum(jn.svd_mlp_ref(*a) * cotangent), argnums=tuple(range(7)))(*args)
        forward = apply(*args)
    np.testing.assert_allclose(forward, _mlp_f64(*args), rtol=1e-10, atol=1e-12)
    for name, got, want in zip(("x",) + WEIGHT_NAMES, grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=name)


@check
def shard_map_direct_bind_with_mismatched_varying_axes_raises():
    x, u, v = _matmul_operands("bind", tokens=(16,))

    def direct(x, u, v):
        return jn.svd_matmul_p.bind(
            x, u, v, n_batch=0, precision=None, out_dtype=np.dtype("float32"), out_sharding=None
        )

    try:
        _shard_map(direct, (P("data"), P(), P()), P("data"))(x, u, v)
    except ValueError as err:
        assert "vary over different manual mesh axes" in str(err) and "u=[]" in str(err), err
    else:
        raise AssertionError("binding with mismatched varying axes did not raise")


# ---------------------------------------------------------------------------------------------------------------
# The pytest side: one subprocess for all checks (conftest.py's check_results).

test_sharding = check_test(CHECKS)


if __name__ == "__main__":
    run_checks(CHECKS)
