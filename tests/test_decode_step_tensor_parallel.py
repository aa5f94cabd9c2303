"""decode_step's partitioning rule on 2 and 4 ranks of a mesh axis: the sharded XLA step (Megatron shards, a psum
after o and after down in every layer, the logits gathered) equals the unsharded step in float64 on ragged shapes
(dense and compressed Llama, Gemma 3 with QK-norm, sandwich norms, windows and soft-capping; a vocabulary that does
not split; fp8 weights, dense and factored), compiles to exactly those collectives, and `generate` with sharded
parameters decodes through it with one device's tokens; the NKI-kernel backends refuse decode_step bound per device
on its shard, and "neuron" the whole step (the emulator runs it: test_decode_step_tensor_parallel_emulator.py); bad
layouts and sizes name what is wrong.

Runs itself in a subprocess with 8 host devices, like test_sharding_spmd.py (see spmd_helpers); the meshes use 2,
4 or all 8 of them.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from decode_operands import GEMMA3_8, LLAMA8, fp8_operands, relative_error
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from neuron_platform import stand_in_platform
from spmd_helpers import Checks, check_test, run_checks
from spmd_helpers import collectives as _collectives
from spmd_helpers import rng as _rng
from test_decode_step import VOCAB, _compressed, _operands, _random_model, _step_inputs
from test_decode_step_fp8 import _jax_operands as _fp8_jax_operands

import jax_neuronmm as jn
from jax_neuronmm import backend, decode_step
from jax_neuronmm.decode_step_parallel import (
    tensor_parallel_decode_step,
    tensor_parallel_partition_specs,
    tensor_parallel_spec,
)
from jax_neuronmm.models import Gemma, GemmaConfig, Llama, LlamaConfig, decode, generate, generation
from jax_neuronmm.pipeline import quantize_model
from nki_kernels.decode import reference

CHECKS = Checks()
check = CHECKS.check

# Ragged on purpose: hidden 64, head_dim 24, MLP 136 (68 or 34 a rank), vocabulary 97 (prime: padded to split).
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=136, num_heads=8, num_kv_heads=4, head_dim=24)


@functools.cache
def _model(name):
    if name == "llama-fp8":  # quantize_model's fp8 projections and head on the compressed model
        return quantize_model(_model("llama-compressed"))
    if name.startswith("llama"):
        model = _random_model(Llama, LlamaConfig.preset("tiny", num_layers=2, tie_word_embeddings=False, **SIZES), 0)
        return _compressed(model, (7, 19), dense_k_in_layer=0) if name == "llama-compressed" else model
    sizes = dict(SIZES, num_heads=4, num_kv_heads=1) if name.startswith("gemma3-1kv") else SIZES  # 270M's heads
    config = GemmaConfig.preset(
        "gemma3-tiny", **sizes, sliding_window=4, attn_logit_softcapping=4.0, final_logit_softcapping=10.0
    )
    model = _random_model(Gemma, config, 2)
    if name == "gemma3-1kv-compressed":
        return _compressed(model, (5, 13, 9))
    return _compressed(model, (5, 13, 9)) if name == "gemma3-compressed" else model


def _model_mesh(ranks, data=1, axis_types=None):
    devices = np.array(jax.devices()[: data * ranks]).reshape(data, ranks)
    return Mesh(devices, ("data", "model"), axis_types=axis_types)


@functools.cache
def _float32_step(name, tokens):
    """(plan, the float32 operands of one step in decode_step's order) of model `name`."""
    model = _model(name)
    plan = decode.decode_plan(model)
    return plan, _operands(model, plan, *_step_inputs(model, _rng(name), tokens))


def _step_args(name, tokens, dtype=jnp.float32):
    """(plan, the step's operands): weights and activations in dtype, the RoPE tables, mask biases and write_index
    as the contract has them (float32, int32)."""
    plan, args = _float32_step(name, tokens)
    kept = {12, 13, 14, 15}  # write_index, cos, sin, mask_bias

    def cast(i, a):
        return a if a is None or i in kept else jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf, dtype), a)

    return plan, [cast(i, a) for i, a in enumerate(args)]


def _assert_sharded_equals_unsharded(name, tokens, ranks, data=1, batch_axis=None):
    mesh = _model_mesh(ranks, data)
    plan, _ = _step_args(name, tokens)
    spec = plan.spec
    whole_step = jax.jit(functools.partial(decode_step, spec=spec))
    sharded_step = jax.jit(
        functools.partial(tensor_parallel_decode_step, spec=spec, mesh=mesh, axis_name="model", batch_axis=batch_axis)
    )
    with jax.enable_x64(True):
        _, args = _step_args(name, tokens, jnp.float64)
        whole, sharded = whole_step(*args), sharded_step(*args)
        kernel_args = [list(a) if isinstance(a, tuple) else (None if a is None else np.asarray(a)) for a in args]
        f64 = reference.decode_step_f64(kernel_args, spec)
    for got, want, ref in zip(sharded, whole, f64):
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
        # float64 everywhere but the attention softmax, which decoder_math.attend runs in float32 (so a float64
        # difference of the sums' order can move a result by float32 rounding).
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    assert float(np.std(np.asarray(sharded[0]))) > 0.1
    # The caches come back split over their KV heads, the logits whole on every device (rows split by batch_axis).
    assert sharded[1].sharding.spec == P(None, batch_axis, None, "model"), sharded[1].sharding
    assert sharded[0].sharding.spec == (P() if batch_axis is None else P(batch_axis)), sharded[0].sharding
    # float32 too (the float32 psum of partial products), against the unsharded float32 step.
    _, args32 = _step_args(name, tokens)
    for got, want in zip(sharded_step(*args32), whole_step(*args32)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@check
def xla_sharded_step_equals_unsharded_llama_2_ranks():
    _assert_sharded_equals_unsharded("llama", tokens=1, ranks=2)


@check
def xla_sharded_step_equals_unsharded_llama_compressed_4_ranks():
    # Factored projections at per-layer ranks (k dense in layer 0), a factored untied head, 3 tokens a row.
    _assert_sharded_equals_unsharded("llama-compressed", tokens=3, ranks=4)


@check
def xla_sharded_step_equals_unsharded_gemma3_4_ranks_2_data():
    # QK-norm, sandwich norms, a sliding window, soft-capping, tied head; a (data 2, model 4) mesh, replicated over
    # "data" and with "data" splitting the rows.
    _assert_sharded_equals_unsharded("gemma3", tokens=1, ranks=4, data=2)
    _assert_sharded_equals_unsharded("gemma3", tokens=1, ranks=4, data=2, batch_axis="data")


@check
def xla_sharded_step_equals_unsharded_gemma3_compressed_2_ranks():
    # Every MLP projection factored: the svd_mlp math with down's x·u summed over the ranks.
    _assert_sharded_equals_unsharded("gemma3-compressed", tokens=3, ranks=2)


@check
def decode_step_inside_your_own_shard_map_on_the_shards():
    # decode_step(..., spec=tensor_parallel_spec(spec, T), axis_name=...) on each rank's blocks, with JAX's default
    # varying-axes checks on, gives what tensor_parallel_decode_step gives (which pads the vocabulary of 97).
    plan, args = _step_args("llama-compressed", 1)
    spec = plan.spec.replace(vocab=98)
    head_u, head_v = args[17]
    args = [*args[:17], (head_u, jnp.pad(head_v, ((0, 0), (0, 1))))]
    leaves, treedef = jax.tree_util.tree_flatten(args)
    rank_spec = tensor_parallel_spec(spec, 2)

    def body(*blocks):
        return decode_step(*jax.tree_util.tree_unflatten(treedef, blocks), spec=rank_spec, axis_name="model")

    mesh = _model_mesh(2)
    cache = P(None, None, None, "model")
    in_specs = tensor_parallel_partition_specs(spec, "model")
    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(), cache, cache)))(*leaves)
    want = jax.jit(functools.partial(tensor_parallel_decode_step, spec=plan.spec, mesh=mesh, axis_name="model"))(
        *args[:17], (head_u, head_v)
    )
    assert got[0].shape == (2, 1, 98)
    np.testing.assert_array_equal(np.asarray(got[0][..., :VOCAB]), np.asarray(want[0]))
    assert not np.asarray(got[0][..., VOCAB:]).any()  # the zero column's logit
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@check
def sharded_step_compiles_to_two_all_reduces_a_layer_and_one_gather():
    plan, args = _step_args("llama-compressed", 1)
    mesh = _model_mesh(4)
    step = jax.jit(functools.partial(tensor_parallel_decode_step, spec=plan.spec, mesh=mesh, axis_name="model"))
    found = _collectives(step.lower(*args).compile().as_text())
    # In the scan's body: o's x·u [B, T, r_o] and down's x·u [B, T, r_down] (float32); after it the logits' slices
    # [B, T, V / 4] gathered along the vocabulary (97 padded to 100). No weight crosses devices.
    r_o, r_down = max(plan.spec.ranks[3]), max(plan.spec.ranks[6])
    assert sorted(found) == sorted(
        [("all-reduce", f"f32[2,1,{r_o}]"), ("all-reduce", f"f32[2,1,{r_down}]"), ("all-gather", "f32[2,1,100]")]
    ), found


def _assert_fp8_sharded_equals_unsharded(spec, ranks):
    """fp8 weights (decode_operands: values over the whole e4m3 range, per-column scales over four orders of
    magnitude; bf16 activations): column scales split with their columns, o's and down's scales replicated and
    applied after the sum. The same float32 sums in another order, rounded to bf16."""
    operands = fp8_operands(_rng(f"fp8 {spec.num_layers} {spec.hidden}"), spec, 2, 1, 8, 3)
    args = _fp8_jax_operands(operands, spec)
    whole = jax.jit(functools.partial(decode_step, spec=spec))(*args)
    step = functools.partial(tensor_parallel_decode_step, spec=spec, mesh=_model_mesh(ranks), axis_name="model")
    sharded = jax.jit(step)(*args)
    f64 = reference.decode_step_f64(operands, spec)
    for got, want, ref in zip(sharded, whole, f64):
        want = np.asarray(want, np.float64)
        assert got.shape == want.shape and relative_error(got, want) < 2e-3, relative_error(got, want)
        # As close to the float64 reference of the dequantized weights as the unsharded step is.
        assert relative_error(got, ref) < relative_error(want, ref) + 1e-3, (
            relative_error(got, ref),
            relative_error(want, ref),
        )


@check
def xla_sharded_fp8_dense_step_equals_unsharded_2_ranks():
    _assert_fp8_sharded_equals_unsharded(LLAMA8, 2)  # every weight a Quantized (w, scale)


@check
def xla_sharded_fp8_factored_step_equals_unsharded_2_ranks():
    # Factored fp8 projections and head (k dense fp8), Gemma 3's variants; 2 KV heads to split.
    _assert_fp8_sharded_equals_unsharded(GEMMA3_8.replace(num_kv_heads=2), 2)


MLP_ONLY = (
    (r"mlp/(gate_proj|up_proj)/(v|kernel)$", P(None, "model")),
    (r"mlp/down_proj/(u|kernel)$", P("model", None)),
)
MEGATRON = MLP_ONLY + (
    (r"self_attn/(q_proj|k_proj|v_proj)/(v|kernel)$", P(None, "model")),
    (r"self_attn/o_proj/(u|kernel)$", P("model", None)),
)


def _shard_megatron(model, mesh, layout=MEGATRON):
    """examples/tensor_parallel_generate.py's layout for dense or factored projections (the head stays whole: its
    vocabulary of 97 does not split, so each step pads it and splits it then); `layout` (regex, spec) pairs may
    name another one."""
    graphdef, state = nnx.split(model)

    def place(path, value):
        name = "/".join(str(key.key) for key in path if hasattr(key, "key"))
        spec = next((s for pattern, s in layout if re.search(pattern, name)), P())
        return jax.device_put(value, NamedSharding(mesh, spec))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(place, state))


def _assert_generate_on_mesh(name, mesh, layout=MEGATRON, route="decode_step_tensor_parallel"):
    """generate on `model(name)` placed by `layout` over `mesh` gives one device's tokens, every decode step
    through `route`; returns the sharded model's plan."""
    model = _model(name)
    prompts = _rng(name + "generate").integers(0, VOCAB, size=(2, 5))
    sampling = dict(temperature=0.8, seed=3)
    single = np.asarray(generate(model, prompts, 5, **sampling))
    sharded = _shard_megatron(model, mesh, layout)
    plan = decode.decode_plan(sharded)
    generation.TRACE_COUNTS.clear()
    on_mesh = np.asarray(generate(sharded, prompts, 5, **sampling))
    np.testing.assert_array_equal(on_mesh, single)
    # Every decode step went through `route`, none through the others.
    routes = ("decode_step_tensor_parallel", "decode_model_forward", "decode_step")
    assert {r: generation.TRACE_COUNTS[r] for r in routes} == {r: int(r == route) for r in routes}, (
        generation.TRACE_COUNTS
    )
    if route == "decode_step_tensor_parallel":
        assert plan.tensor_parallel == decode.TensorParallel(mesh, "model"), plan.tensor_parallel
        assert plan.spec.packed_weights == ()  # a packed operand is one rank's layout: Megatron shards pack none
        # The mesh's other axis (if any) splits the rows.
        assert plan.tensor_parallel.batch_axis(2) == ("data" if mesh.shape["data"] == 2 else None)
    return plan


@check
def generate_on_2_ranks_decodes_through_the_sharded_step():
    _assert_generate_on_mesh("llama-compressed", _model_mesh(2))


@check
def generate_fp8_on_2_ranks_decodes_through_the_sharded_step():
    # On one device the fp8 attention factors are packed (the sharded step's are not): the same tokens.
    assert decode.decode_plan(_model("llama-fp8")).spec.packed_weights == ("q", "k", "v", "o")
    _assert_generate_on_mesh("llama-fp8", _model_mesh(2))


@check
def generate_on_4_ranks_2_data_decodes_through_the_sharded_step():
    _assert_generate_on_mesh("gemma3", _model_mesh(4, data=2))


@check
def generate_on_an_explicit_mesh_decodes_through_the_sharded_step():
    # Compressed: a dense row-parallel kernel in the prefill (the model's own forward) asks for out_sharding there.
    # "data" splits the rows (RoPE tables and masks made from host positions are typed without a mesh).
    explicit = (AxisType.Explicit, AxisType.Explicit)
    _assert_generate_on_mesh("llama-compressed", _model_mesh(4, data=2, axis_types=explicit))


@check
def kernel_backends_refuse_per_device_binds():
    # decode_step bound on each device's shard inside your own shard_map: the emulator's collectives cannot meet
    # across the devices' host callbacks (tensor_parallel_decode_step runs every rank in one instead:
    # test_decode_step_tensor_parallel_emulator.py), and nothing maps them onto Trainium's NeuronCores yet.
    plan, args = _step_args("llama", 1)
    spec = plan.spec.replace(vocab=98)
    leaves, treedef = jax.tree_util.tree_flatten([*args[:17], jnp.pad(args[17], ((0, 0), (0, 1)))])
    rank_spec = tensor_parallel_spec(spec, 2)

    def body(*blocks):
        return decode_step(*jax.tree_util.tree_unflatten(treedef, blocks), spec=rank_spec, axis_name="model")

    cache = P(None, None, None, "model")
    in_specs = tensor_parallel_partition_specs(spec, "model")
    step = jax.jit(jax.shard_map(body, mesh=_model_mesh(2), in_specs=in_specs, out_specs=(P(), cache, cache)))
    with jn.use_backend("emulator"):
        _raises(
            NotImplementedError,
            "cannot run on backend 'emulator': each device would run its own host callback.*Call "
            "tensor_parallel_decode_step with the whole model's operands",
            step,
            *leaves,
        )
    whole_step = jax.jit(
        functools.partial(tensor_parallel_decode_step, spec=plan.spec, mesh=_model_mesh(2), axis_name="model")
    )
    with stand_in_platform("neuron"), backend._backend("neuron"):
        _raises(
            NotImplementedError,
            "is not supported on backend 'neuron'.*host callbacks do not run on the neuron platform",
            lambda: whole_step.trace(*args).lower(lowering_platforms=("neuron",)),
        )


def _raises(error_type, pattern, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except error_type as error:
        assert re.search(pattern, str(error)), f"{error!r} does not match {pattern!r}"
        return
    raise AssertionError(f"no {error_type.__name__} matching {pattern!r}")


@check
def bad_layouts_and_sizes_name_what_is_wrong():
    model = _model("llama")
    plan, args = _step_args("llama", 1)
    spec = plan.spec
    mesh = _model_mesh(4)
    # Sizes that do not split: 4 KV heads over 8 ranks.
    _raises(
        ValueError, r"spec\.num_kv_heads = 4 does not split over 8 tensor-parallel ranks", tensor_parallel_spec, spec, 8
    )
    _raises(
        ValueError,
        r"axis_name: \['heads'\] not among the mesh's axes",
        tensor_parallel_decode_step,
        *args,
        spec=spec,
        mesh=mesh,
        axis_name="heads",
    )
    _raises(
        TypeError,
        "mesh: got NoneType, expected a jax.sharding.Mesh",
        tensor_parallel_decode_step,
        *args,
        spec=spec,
        mesh=None,
    )
    _raises(
        ValueError,
        r"x: got B = 2 rows, expected a multiple of the 4 row groups of batch_axis 'data'",
        tensor_parallel_decode_step,
        *args,
        spec=spec,
        mesh=_model_mesh(2, data=4),
        batch_axis="data",
    )
    _raises(
        ValueError,
        "batch_axis 'model' shares mesh axes",
        tensor_parallel_decode_step,
        *args,
        spec=spec,
        mesh=mesh,
        batch_axis="model",
    )
    rank_spec = tensor_parallel_spec(spec.replace(vocab=100), 4)
    _raises(
        ValueError,
        "spec.tensor_parallel is 4, so the operands are one rank's Megatron shard: expected axis_name",
        decode_step,
        *args,
        spec=rank_spec,
    )
    _raises(
        ValueError, "axis_name 'model' is not a mesh axis bound here", decode_step, *args, spec=spec, axis_name="model"
    )
    # A projection split along the wrong dim, and a model whose KV heads do not split over the mesh axis.
    graphdef, state = nnx.split(model)
    wrong = jax.tree_util.tree_map_with_path(
        lambda path, v: (
            jax.device_put(v, NamedSharding(mesh, P("model", None)))
            if "layers/0/self_attn/q_proj/kernel" in "/".join(str(getattr(k, "key", k)) for k in path)
            else v
        ),
        state,
    )
    _raises(
        ValueError,
        r"layers/0/q_proj/kernel is split along dim 0 over mesh axes \('model',\)",
        decode.tensor_parallel_layout,
        nnx.merge(graphdef, wrong),
    )
    assert decode.decode_plan(nnx.merge(graphdef, wrong)) is None  # generate decodes it through the model's forward
    # KV heads replicate over a multiple of them that divides the query heads only.
    spec = plan.spec
    _raises(ValueError, r"spec\.num_heads = 8 does not split over 16", decode.megatron_spec, spec, 16)
    assert decode.megatron_spec(spec, 8).num_kv_heads == 8 and decode.megatron_spec(spec, 2) == spec


test_tensor_parallel = check_test(CHECKS)


if __name__ == "__main__":
    run_checks(CHECKS)
