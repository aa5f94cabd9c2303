"""JAX's sharding in types: svd_matmul and svd_mlp under Auto and Explicit mesh axes on 8 CPU devices.

Every layout the README lists (tokens-, N-, K-, r-sharded svd_matmul and the Megatron svd_mlp) x {Auto,
Explicit} x {xla, emulator}: the result against float64 numpy, its type, the collectives of the compiled HLO
(Explicit gives the same as Auto: weights never gathered), and gradients. Then out_sharding's errors,
vmap, and jax.shard_map over an Explicit mesh. Like test_sharding_spmd.py, the checks run in one 8-device
subprocess (`python tests/test_sharding_explicit.py`) and each pytest test reports one check.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mlp_calls import svd_mlp_of_factors
from spmd_helpers import (
    Checks,
    collectives,
    matmul_f64,
    matmul_operands,
    mlp_f64,
    mlp_operands,
    rng,
    run_checks,
)

import jax_neuronmm as jn
from jax_neuronmm._compat import ShardingTypeError

CHECKS = Checks()
BACKENDS = ("xla", "emulator")
MESH_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def _mesh(kind):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(MESH_TYPES[kind],) * 2)


class Layout:
    """Operand specs of one layout, the out_sharding it needs under Explicit axes (None: the result's type
    follows from the operands'), the result's spec under Explicit axes, and the collectives expected."""

    def __init__(self, op, operands, specs, out_spec, result_spec, expected):
        self.op, self.operands, self.specs = op, operands, specs
        self.out_spec, self.result_spec, self.expected = out_spec, result_spec, expected


MEGATRON = (P("data"), P(), P(None, "model"), P(), P(None, "model"), P("model"), P())
LAYOUTS = {
    "tokens": Layout(
        jn.svd_matmul, lambda: matmul_operands("tokens"), (P("data"), P(), P()), None, P("data", None), []
    ),
    "column": Layout(
        jn.svd_matmul,
        lambda: matmul_operands("column", n=44),
        (P("data"), P(), P(None, "model")),
        None,
        P("data", "model"),
        [],
    ),
    "row": Layout(
        jn.svd_matmul,
        lambda: matmul_operands("row"),
        (P("data", "model"), P("model"), P()),
        P("data"),
        P("data", None),
        [("all-reduce", "f32[7,40]")],
    ),
    "row_reduce_scatter": Layout(
        jn.svd_matmul,
        lambda: matmul_operands("row_rs"),
        (P(None, "model"), P("model"), P()),
        P(None, "model"),
        P(None, "model"),
        [("reduce-scatter", "f32[14,10]")],
    ),
    "rank": Layout(
        jn.svd_matmul,
        lambda: matmul_operands("rank"),
        (P("data"), P(None, "model"), P("model")),
        P("data"),
        P("data", None),
        [("all-reduce", "f32[7,40]")],
    ),
    "megatron_mlp": Layout(
        svd_mlp_of_factors,
        lambda: mlp_operands("megatron"),
        MEGATRON,
        P("data"),
        P("data", None, None),
        [("all-reduce", "f32[1,6,48]")],
    ),
}


def _reference(layout, args):
    return (mlp_f64 if layout.op is svd_mlp_of_factors else matmul_f64)(*args)


def _call(layout, mesh_kind):
    """The op as a user writes it: out_sharding under Explicit axes; under Auto, a jit out_sharding."""
    if mesh_kind == "explicit":
        return lambda *a: layout.op(*a, out_sharding=layout.out_spec), None
    out = None if layout.out_spec is None else NamedSharding(_mesh("auto"), layout.out_spec)
    return lambda *a: layout.op(*a), out


def _place(mesh, args, specs):
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]


def _check_layout(name, mesh_kind, backend):
    layout = LAYOUTS[name]
    args = layout.operands()
    mesh = _mesh(mesh_kind)
    fn, out = _call(layout, mesh_kind)
    with jax.set_mesh(mesh), jn.use_backend(backend):
        placed = _place(mesh, args, layout.specs)
        jitted = jax.jit(fn, out_shardings=out)
        result = jitted(*placed)
        found = collectives(jitted.lower(*placed).compile().as_text())
    reference = _reference(layout, args)
    np.testing.assert_allclose(np.asarray(result), reference, rtol=1e-4, atol=1e-5 * np.abs(reference).max())
    assert found == layout.expected, f"collectives {found}, expected {layout.expected}"
    if mesh_kind == "explicit":
        assert jax.typeof(result).sharding.spec == layout.result_spec, jax.typeof(result)
        assert result.sharding.spec == layout.result_spec, result.sharding


def _gathered_weights(found, weights):
    """The all-gathers in `found` whose result is a whole weight (or its transpose)."""
    shapes = {tuple(w.shape) for w in weights} | {tuple(w.shape[::-1]) for w in weights}
    return [c for c in found if c[0] == "all-gather" and tuple(map(int, c[1][4:-1].split(","))) in shapes]


def _check_layout_grads(name, mesh_kind, backend):
    # Reverse mode: gradients typed like their primals, weights never gathered (a cotangent may be: with the
    # output N-split, ȳ·vᵀ needs all of ȳ's columns).
    layout = LAYOUTS[name]
    args = layout.operands()
    mesh = _mesh(mesh_kind)
    fn, _ = _call(layout, mesh_kind)
    cotangent = rng(name + "_ct").standard_normal(_reference(layout, args).shape).astype(np.float32)

    def loss(*a):
        return jnp.sum(fn(*a) * cotangent)

    argnums = tuple(range(len(args)))
    with jax.set_mesh(mesh), jn.use_backend(backend):
        placed = _place(mesh, args, layout.specs)
        grad = jax.jit(jax.grad(loss, argnums=argnums))
        grads = grad(*placed)
        found = collectives(grad.lower(*placed).compile().as_text())
    reference_op = jn.svd_mlp_ref if layout.op is svd_mlp_of_factors else jn.svd_matmul_ref
    with jax.enable_x64(True):
        expected = jax.grad(lambda *a: jnp.sum(reference_op(*a) * cotangent), argnums=argnums)(
            *(a.astype(np.float64) for a in args)
        )
    for index, (got, want, spec) in enumerate(zip(grads, expected, layout.specs)):
        want = np.asarray(want)
        np.testing.assert_allclose(
            np.asarray(got), want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=f"gradient {index}"
        )
        if mesh_kind == "explicit":
            padded = P(*spec, *(None,) * (got.ndim - len(spec)))
            assert jax.typeof(got).sharding.spec == padded, (index, jax.typeof(got))
    assert not _gathered_weights(found, args[1:]), found


for _name in LAYOUTS:
    for _kind in MESH_TYPES:
        for _backend in BACKENDS:
            CHECKS[f"{_name}_{_kind}_{_backend}"] = lambda n=_name, k=_kind, b=_backend: _check_layout(n, k, b)
        CHECKS[f"{_name}_{_kind}_xla_grads"] = lambda n=_name, k=_kind: _check_layout_grads(n, k, "xla")
    CHECKS[f"{_name}_explicit_emulator_grads"] = lambda n=_name: _check_layout_grads(n, "explicit", "emulator")

check = CHECKS.check


def _raises(error, fn, *fragments):
    try:
        fn()
    except error as err:
        assert all(f in str(err) for f in fragments), err
    else:
        raise AssertionError(f"no {error.__name__}")


@check
def explicit_row_parallel_without_out_sharding_asks_for_it():
    # The bug: on the XLA backend this was dot_general's error from inside the lowering.
    mesh = _mesh("explicit")
    layout = LAYOUTS["row"]
    for backend in BACKENDS:
        with jax.set_mesh(mesh), jn.use_backend(backend):
            placed = _place(mesh, layout.operands(), layout.specs)
            _raises(
                ShardingTypeError,
                lambda: jax.jit(jn.svd_matmul)(*placed),
                "svd_matmul",
                "out_sharding",
                "x dim 1 and u dim 0",
            )


@check
def explicit_megatron_mlp_without_out_sharding_asks_for_it():
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
        placed = _place(mesh, mlp_operands("mlp_ask"), MEGATRON)
        _raises(
            ShardingTypeError, lambda: jax.jit(svd_mlp_of_factors)(*placed), "svd_mlp", "out_sharding", "down.u dim 0"
        )


@check
def explicit_inconsistent_splits_of_one_dimension_raise():
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
        placed = _place(mesh, matmul_operands("inconsistent"), (P(None, "model"), P("data"), P()))
        _raises(ShardingTypeError, lambda: jn.svd_matmul(*placed), "svd_matmul", "same mesh axes")


@check
def out_sharding_bad_values_raise_naming_the_argument():
    explicit = _mesh("explicit")
    with jax.set_mesh(explicit):
        x, u, v = _place(explicit, matmul_operands("bad"), (P(), P(), P()))
        _raises(TypeError, lambda: jn.svd_matmul(x, u, v, out_sharding="model"), "svd_matmul", "out_sharding")
        _raises(
            ValueError,
            lambda: jn.svd_matmul(x, u, v, out_sharding=P(None, None, "model")),
            "svd_matmul",
            "out_sharding",
            "2 dims",
        )
    # As jnp.matmul: a PartitionSpec needs a mesh set with jax.set_mesh, and may only name Explicit axes.
    _raises(
        ValueError,
        lambda: jn.svd_matmul(*matmul_operands("bad"), out_sharding=P("model")),
        "svd_matmul",
        "out_sharding",
    )
    auto = _mesh("auto")
    with jax.set_mesh(auto):
        args = _place(auto, mlp_operands("bad"), MEGATRON)
        _raises(
            ValueError, lambda: svd_mlp_of_factors(*args, out_sharding=P("data")), "svd_mlp", "out_sharding", "Auto"
        )


@check
def explicit_result_type_is_known_at_trace_time():
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
        x, u, v = _place(mesh, matmul_operands("trace", n=44), (P("data"), P(), P(None, "model")))
        assert jax.eval_shape(jn.svd_matmul, x, u, v).sharding.spec == P("data", "model")
        x, u, v = _place(mesh, matmul_operands("trace"), (P("data", "model"), P("model"), P()))
        typed = jax.eval_shape(lambda *a: jn.svd_matmul(*a, out_sharding=P(None, "model")), x, u, v)
        assert typed.sharding.spec == P(None, "model")


@check
def explicit_vmap_over_stacked_layers_and_over_tokens():
    mesh = _mesh("explicit")
    stream = rng("vmap")
    x = stream.standard_normal((3, 14, 64)).astype(np.float32)
    us = stream.standard_normal((3, 64, 24)).astype(np.float32)
    vs = stream.standard_normal((3, 24, 44)).astype(np.float32)
    with jax.set_mesh(mesh):
        # Stacked layers, column-parallel: no communication, layer dim unsplit.
        px, pu, pv = _place(mesh, (x, us, vs), (P(None, "data"), P(), P(None, None, "model")))
        stacked = jax.jit(jax.vmap(jn.svd_matmul))
        y = stacked(px, pu, pv)
        assert jax.typeof(y).sharding.spec == P(None, "data", "model"), jax.typeof(y)
        assert collectives(stacked.lower(px, pu, pv).compile().as_text()) == []
        np.testing.assert_allclose(
            np.asarray(y),
            np.einsum("btk,bkr,brn->btn", *(a.astype(np.float64) for a in (x, us, vs))),
            rtol=1e-4,
            atol=1e-4,
        )
        # vmap over a token dim, row-parallel: the per-example out_sharding gains the vmapped dim.
        px, pu, pv = _place(mesh, (x, us[0], vs[0, :, :40]), (P(None, "data", "model"), P("model"), P()))
        over_tokens = jax.jit(
            jax.vmap(lambda x, u, v: jn.svd_matmul(x, u, v, out_sharding=P("data")), in_axes=(0, None, None))
        )
        y = over_tokens(px, pu, pv)
        assert jax.typeof(y).sharding.spec == P(None, "data", None), jax.typeof(y)
        assert collectives(over_tokens.lower(px, pu, pv).compile().as_text()) == [("all-reduce", "f32[3,7,40]")]
    np.testing.assert_allclose(np.asarray(y), matmul_f64(x, us[0], vs[0, :, :40]), rtol=1e-4, atol=1e-4)


@check
def mixed_mesh_explicit_data_auto_model_row_parallel():
    # Types name only the Explicit "data" axis; the partitioner still sees K split over the Auto "model" axis.
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    args = matmul_operands("mixed")
    for backend in BACKENDS:
        with jax.set_mesh(mesh), jn.use_backend(backend):
            placed = _place(mesh, args, (P("data", "model"), P("model"), P()))
            jitted = jax.jit(jn.svd_matmul)
            result = jitted(*placed)
            assert jax.typeof(result).sharding.spec == P("data", None), jax.typeof(result)
            assert collectives(jitted.lower(*placed).compile().as_text()) == [("all-reduce", "f32[7,40]")]
        np.testing.assert_allclose(np.asarray(result), matmul_f64(*args), rtol=1e-4, atol=1e-4, err_msg=backend)


def _explicit_shard_map(fn, in_specs, out_specs, **kwargs):
    return jax.jit(jax.shard_map(fn, mesh=_mesh("explicit"), in_specs=in_specs, out_specs=out_specs, **kwargs))


@check
def explicit_shard_map_tokens_sharded_both_backends_and_grads():
    x, u, v = matmul_operands("sm_tokens", tokens=(16,))
    tokens = P(("data", "model"))
    cotangent = rng("sm_tokens_ct").standard_normal((16, 40)).astype(np.float32)
    apply = _explicit_shard_map(jn.svd_matmul, (tokens, P(), P()), tokens)
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
        placed = _place(mesh, (x, u, v), (tokens, P(), P()))
        for backend in BACKENDS:
            with jn.use_backend(backend):
                np.testing.assert_allclose(np.asarray(apply(*placed)), matmul_f64(x, u, v), rtol=1e-4, atol=1e-4)
        ct = jax.device_put(cotangent, NamedSharding(mesh, tokens))
        dx, du, dv = jax.grad(lambda *a: jnp.sum(apply(*a) * ct), argnums=(0, 1, 2))(*placed)
    x, u, v, cotangent = (a.astype(np.float64) for a in (x, u, v, cotangent))
    for got, want in ((dx, cotangent @ v.T @ u.T), (du, x.T @ cotangent @ v.T), (dv, (x @ u).T @ cotangent)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@check
def explicit_shard_map_matmul_layouts_both_backends():
    # The user's own column/row/rank-parallel svd_matmul on blocks: K- and r-split layouts psum the partial sums.
    mesh = _mesh("explicit")
    summed = {"column": False, "row": True, "rank": True}
    for name, needs_psum in summed.items():
        layout = LAYOUTS[name]
        args = layout.operands()
        per_block = (lambda *b: jax.lax.psum(jn.svd_matmul(*b), "model")) if needs_psum else jn.svd_matmul
        apply = _explicit_shard_map(per_block, layout.specs, layout.result_spec)
        with jax.set_mesh(mesh):
            placed = _place(mesh, args, layout.specs)
            for backend in BACKENDS:
                with jn.use_backend(backend):
                    result = apply(*placed)
                np.testing.assert_allclose(
                    np.asarray(result), matmul_f64(*args), rtol=1e-4, atol=1e-4, err_msg=f"{name} {backend}"
                )
                assert jax.typeof(result).sharding.spec == layout.result_spec, (name, jax.typeof(result))


@check
def explicit_shard_map_megatron_mlp_both_backends():
    args = mlp_operands("sm_mlp", tokens=(4, 3))
    apply = _explicit_shard_map(lambda *blocks: jax.lax.psum(svd_mlp_of_factors(*blocks), "model"), MEGATRON, P("data"))
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
        placed = _place(mesh, args, MEGATRON)
        for backend in BACKENDS:
            with jn.use_backend(backend):
                np.testing.assert_allclose(np.asarray(apply(*placed)), mlp_f64(*args), rtol=1e-4, atol=1e-4)


@check
def explicit_partial_shard_map_manual_model_axis_explicit_data_axis():
    # Manual over "model" only: inside, the blocks' types still say tokens are split over the Explicit "data".
    args = mlp_operands("sm_partial", tokens=(4, 3))
    mesh = _mesh("explicit")

    def tp_mlp(*blocks):
        y = svd_mlp_of_factors(*blocks)
        assert jax.typeof(y).sharding.spec[0] == "data", jax.typeof(y)
        return jax.lax.psum(y, "model")

    specs = (P(), P(), P(None, "model"), P(), P(None, "model"), P("model"), P())
    apply = _explicit_shard_map(tp_mlp, specs, P(), axis_names={"model"})
    with jax.set_mesh(mesh):
        # Weights typed as their in_specs split them (JAX 0.12's shard_map requires it on Explicit meshes).
        placed = _place(mesh, args, (P("data"),) + specs[1:])
        for backend in BACKENDS:
            with jn.use_backend(backend):
                np.testing.assert_allclose(np.asarray(apply(*placed)), mlp_f64(*args), rtol=1e-4, atol=1e-4)


def _attention_f64(q, keys, values, bias, scaling):
    """Grouped-query attention in float64: query head h reads kv head h // (heads / kv_heads)."""
    q, keys, values, bias = (np.asarray(a, np.float64) for a in (q, keys, values, bias))
    groups = q.shape[2] // keys.shape[2]
    keys, values = np.repeat(keys, groups, axis=2), np.repeat(values, groups, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, keys) * scaling + bias[:, None]
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshd->bthd", weights, values)
    return out.reshape(*out.shape[:2], -1)


@check
def attention_queries_take_the_caches_split():
    # The attention dots need q's batch and kv-head dims split as the cache's; how a reshape carries the heads'
    # split into (kv_heads, groups) differs between JAX releases, so attend reshards q to the cache's split.
    from jax_neuronmm import decoder_math

    r = rng("attend_split")
    q = r.standard_normal((2, 3, 8, 16)).astype(np.float32)
    keys, values = (r.standard_normal((2, 5, 4, 16)).astype(np.float32) for _ in range(2))
    bias = np.where(r.random((2, 3, 5)) < 0.3, decoder_math.MASKED, 0.0).astype(np.float32)
    bias[..., 0] = 0.0  # every query sees at least one key
    expected = _attention_f64(q, keys, values, bias, 0.25)
    attend = jax.jit(lambda *a: decoder_math.attend(*a, scaling=0.25, logit_softcap=None))
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
        for cache_spec in (P(None, None, "model"), P("data", None, "model")):
            for q_spec in (P(), P(None, None, None, "model"), P("data", None, "model"), P(None, None, "data")):
                placed_q = jax.device_put(q, NamedSharding(mesh, q_spec))
                kv = [jax.device_put(a, NamedSharding(mesh, cache_spec)) for a in (keys, values)]
                got = attend(placed_q, *kv, jax.device_put(bias, NamedSharding(mesh, P())))
                np.testing.assert_allclose(
                    np.asarray(got), expected, rtol=1e-5, atol=1e-5, err_msg=f"q {q_spec}, cache {cache_spec}"
                )


# The Megatron layout of a compressed Llama (examples/tensor_parallel_generate.py): (path regex, spec).
_MEGATRON = (
    (r"mlp/(gate_proj|up_proj)/v$", P(None, "model")),
    (r"mlp/down_proj/u$", P("model", None)),
    (r"self_attn/(q_proj|k_proj|v_proj)/v$", P(None, "model")),
    (r"self_attn/o_proj/u$", P("model", None)),
)


@check
def generate_on_explicit_mesh_matches_one_device():
    # The bug: the KV-cache dynamic_update_slice got heads-split keys into an unsplit cache (ShardingTypeError).
    import re

    from flax import nnx

    from jax_neuronmm import models, pipeline

    config = models.LlamaConfig.preset("tiny", num_heads=8, num_kv_heads=4, head_dim=16)
    model = models.Llama(config, rngs=nnx.Rngs(3))
    model = pipeline.compress_model(model, pipeline.Recipe(keep=0.5, include=("mlp", "attention"), method="svd"))
    graphdef, state = nnx.split(model)
    prompts = rng("generate_explicit").integers(0, config.vocab_size, size=(4, 7))
    sampling = dict(temperature=0.8, seed=5)
    expected = np.asarray(models.generate(model, prompts, 6, **sampling))
    for kind in ("explicit", "auto"):
        mesh = _mesh(kind)

        def place(path, value, mesh=mesh):
            name = "/".join(str(key.key) for key in path if hasattr(key, "key"))
            spec = next((s for pattern, s in _MEGATRON if re.search(pattern, name)), P())
            return jax.device_put(value, NamedSharding(mesh, spec))

        sharded = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(place, state))
        assert sharded.layers[0].mlp.gate_proj.v[...].sharding.spec == P(None, "model")
        np.testing.assert_array_equal(np.asarray(models.generate(sharded, prompts, 6, **sampling)), expected)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_explicit_sharding(check_results, name):
    failure = check_results[name]
    assert failure is None, failure


if __name__ == "__main__":
    run_checks(CHECKS)
