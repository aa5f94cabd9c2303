"""decode_step's partitioning rule on the emulator backend: `tensor_parallel_decode_step` (and so `generate` with
parameters in the Megatron layout) runs every rank's looped kernel with its collectives in one emulated launch. On 2
and 4 ranks of a mesh axis it gives one device's tokens (XLA backend), logits and caches equal to the unsharded XLA
step and the float64 reference, the XLA path's shardings, one profile run per rank (per group of rows); with fp8
weights (bf16 activations) the logits agree to bf16 precision and generate gives one device's tokens; what fails
inside the host call (a traced write_index out of range) raises on every device instead of leaving some waiting in
a collective, and a shard no kernel fits fails when traced.

Tiny random models with ragged shapes: hidden 64, MLP 136 (68 or 34 a rank), vocabulary 97 (prime: the head is
padded to split), head_dim 32 (the kernels' heads tile the partitions); dense and compressed (SVD factors at
per-layer ranks, k dense in one layer, a factored untied head) Llama and Gemma 3 (QK-norm, sandwich norms, a
sliding window, soft-capping). Runs itself in a subprocess with 8 host devices, like test_sharding_spmd.py (see
spmd_helpers); the meshes use 2, 4 or 8 of them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from decode_operands import GEMMA3_8, LLAMA8, fp8_operands, relative_error
from jax.sharding import AxisType
from spmd_helpers import Checks, check_test, run_checks
from spmd_helpers import rng as _rng
from test_decode_step import VOCAB, _compressed, _operands, _random_model, _step_inputs
from test_decode_step_fp8 import _jax_operands as _fp8_jax_operands
from test_decode_step_tensor_parallel import _model_mesh, _shard_megatron

import jax_neuronmm as jn
from jax_neuronmm import decode_step
from jax_neuronmm.decode_step_parallel import tensor_parallel_decode_step
from jax_neuronmm.models import Gemma, GemmaConfig, Llama, LlamaConfig, decode, generate, generation
from jax_neuronmm.pipeline import quantize_model
from nki_kernels.decode import reference

CHECKS = Checks()
check = CHECKS.check

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=136, num_heads=8, num_kv_heads=4, head_dim=32)


@functools.cache
def _model(name):
    if name == "llama-fp8":  # bf16 activations (the kernels' fp8 matmuls need them), fp8 dense projections, head
        config = LlamaConfig.preset("tiny", num_layers=2, tie_word_embeddings=False, **SIZES)
        model = _random_model(functools.partial(Llama, dtype=jnp.bfloat16), config, 0)
        return quantize_model(model, progress=False)
    if name.startswith("llama"):
        config = LlamaConfig.preset("tiny", num_layers=2, tie_word_embeddings=name == "llama", **SIZES)
        model = _random_model(Llama, config, 0)
        return _compressed(model, (7, 19), dense_k_in_layer=0) if name == "llama-compressed" else model
    sizes = dict(SIZES, num_heads=4, num_kv_heads=1) if name == "gemma3-1kv" else SIZES  # Gemma 3 270M's heads
    config = GemmaConfig.preset(
        "gemma3-tiny", **sizes, sliding_window=4, attn_logit_softcapping=4.0, final_logit_softcapping=10.0
    )
    model = _random_model(Gemma, config, 2)
    return _compressed(model, (5, 13, 9)) if name == "gemma3-compressed" else model


def _step_args(name, tokens):
    """(plan, one step's float32 operands in decode_step's order) of model `name`."""
    model = _model(name)
    plan = decode.decode_plan(model)
    return plan, _operands(model, plan, *_step_inputs(model, _rng(name), tokens))


def _assert_emulated_step_equals_xla(name, tokens, ranks, data=1):
    plan, args = _step_args(name, tokens)
    spec = plan.spec
    mesh = _model_mesh(ranks, data)
    batch_axis = "data" if data > 1 else None
    sharded_step = jax.jit(
        functools.partial(tensor_parallel_decode_step, spec=spec, mesh=mesh, axis_name="model", batch_axis=batch_axis)
    )
    whole = jax.jit(functools.partial(decode_step, spec=spec))(*args)
    on_xla = sharded_step(*args)
    with jn.use_backend("emulator"), jn.profile() as prof:
        emulated = jax.block_until_ready(sharded_step(*args))
    kernel_args = [list(a) if isinstance(a, tuple) else (None if a is None else np.asarray(a)) for a in args]
    f64 = reference.decode_step_f64(kernel_args, spec)
    for got, want, xla, ref in zip(emulated, whole, on_xla, f64):
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)
        assert got.sharding == xla.sharding, (got.sharding, xla.sharding)  # placed as the shard_map's results
    assert float(np.std(np.asarray(emulated[0]))) > 0.1
    # One looped kernel per rank, for each group of rows: two all-reduces a layer and the logits' gather each.
    assert [(run.name, run.rank) for run in prof.runs] == [("decode_step_kernel", r) for r in range(ranks)] * data
    assert all(run.collectives == 2 * spec.num_layers + 1 for run in prof.runs)


@check
def emulated_step_equals_xla_llama_2_ranks():
    _assert_emulated_step_equals_xla("llama", tokens=1, ranks=2)


@check
def emulated_step_equals_xla_llama_compressed_4_ranks():
    # Factored projections at per-layer ranks (k dense in layer 0), a factored untied head, 3 tokens a row.
    _assert_emulated_step_equals_xla("llama-compressed", tokens=3, ranks=4)


@check
def emulated_step_equals_xla_gemma3_compressed_2_ranks_2_data():
    # Every MLP projection factored, QK-norm, sandwich norms, a window, soft-capping; "data" splits the rows: one
    # launch of the 2 ranks per row group.
    _assert_emulated_step_equals_xla("gemma3-compressed", tokens=1, ranks=2, data=2)


def _assert_emulated_fp8_step(spec, ranks):
    """fp8 weights (decode_operands: values over the whole e4m3 range, per-column scales over four orders of
    magnitude; bf16 activations): the sharded kernels agree with the unsharded kernel and the XLA step to bf16
    rounding (the same float32 sums in another order), are as close to the float64 reference of the dequantized
    weights, and pick XLA's tokens wherever the logits' difference cannot flip them."""
    operands = fp8_operands(_rng(f"fp8 emulated {spec.num_layers} {spec.hidden}"), spec, 2, 1, 8, 3)
    args = _fp8_jax_operands(operands, spec)
    step = jax.jit(functools.partial(decode_step, spec=spec))
    xla = step(*args)
    sharded_step = jax.jit(
        functools.partial(tensor_parallel_decode_step, spec=spec, mesh=_model_mesh(ranks), axis_name="model")
    )
    with jn.use_backend("emulator"):
        single = step(*args)
        with jn.profile() as prof:
            sharded = jax.block_until_ready(sharded_step(*args))
    assert [run.rank for run in prof.runs] == list(range(ranks))
    f64 = reference.decode_step_f64(operands, spec)
    for got, one, want, ref in zip(sharded, single, xla, f64):
        one, want = np.asarray(one, np.float64), np.asarray(want, np.float64)
        assert got.shape == want.shape and relative_error(got, one) < 2e-2, relative_error(got, one)
        assert relative_error(got, want) < 2e-2, relative_error(got, want)
        errors = relative_error(got, ref), relative_error(one, ref)
        assert errors[0] < errors[1] + 1e-2, errors
    logits, want = np.asarray(sharded[0][:, 0]), np.asarray(xla[0][:, 0])
    top2 = np.sort(want, axis=-1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] > 2 * np.abs(logits - want).max(axis=-1)
    assert decisive.any()
    np.testing.assert_array_equal(logits.argmax(-1)[decisive], want.argmax(-1)[decisive])


@check
def emulated_fp8_dense_step_2_ranks():
    _assert_emulated_fp8_step(LLAMA8, 2)  # every weight a Quantized (w, scale)


@check
def emulated_fp8_factored_step_2_ranks():
    # Factored fp8 projections and head (k dense fp8), Gemma 3's variants; 2 KV heads to split.
    _assert_emulated_fp8_step(GEMMA3_8.replace(num_kv_heads=2), 2)


def _assert_generate_on_the_emulator(name, mesh, **sampling):
    model = _model(name)
    prompts = _rng(name + " emulated generate").integers(0, VOCAB, size=(2, 5))
    single = np.asarray(generate(model, prompts, 5, **sampling))  # one device, XLA backend
    sharded = _shard_megatron(model, mesh)
    assert decode.decode_plan(sharded).tensor_parallel == decode.TensorParallel(mesh, "model")
    generation.TRACE_COUNTS.clear()
    with jn.use_backend("emulator"), jn.profile() as prof:
        on_mesh = np.asarray(generate(sharded, prompts, 5, **sampling))
    np.testing.assert_array_equal(on_mesh, single)
    assert generation.TRACE_COUNTS["decode_step_tensor_parallel"] == 1, generation.TRACE_COUNTS
    # Four decode steps after the prefill, each one launch of every rank (per row group).
    ranks, groups = mesh.shape["model"], mesh.shape["data"]
    steps = [run.rank for run in prof.runs if run.name == "decode_step_kernel"]
    assert steps == list(range(ranks)) * groups * 4, steps


@check
def emulated_generate_llama_2_ranks_gives_one_devices_tokens():
    _assert_generate_on_the_emulator("llama", _model_mesh(2))


@check
def emulated_generate_llama_compressed_4_ranks_sampled_gives_one_devices_tokens():
    _assert_generate_on_the_emulator("llama-compressed", _model_mesh(4), temperature=0.8, seed=3)


@check
def emulated_generate_gemma3_4_ranks_2_data_gives_one_devices_tokens():
    _assert_generate_on_the_emulator("gemma3", _model_mesh(4, data=2))


@check
def emulated_generate_one_kv_head_on_4_ranks_gives_one_devices_tokens():
    # Gemma 3 270M's single KV head repeated on the 4 ranks: each rank's kernel reads its own copy and cache of it.
    assert decode.decode_plan(_shard_megatron(_model("gemma3-1kv"), _model_mesh(4))).spec.num_kv_heads == 4
    _assert_generate_on_the_emulator("gemma3-1kv", _model_mesh(4))


@check
def emulated_generate_on_an_explicit_mesh_gives_one_devices_tokens():
    # Explicit mesh axes: the operands typed whole for the host call, the results resharded as the XLA path's.
    explicit = (AxisType.Explicit, AxisType.Explicit)
    _assert_generate_on_the_emulator("llama-compressed", _model_mesh(2, data=2, axis_types=explicit))


@check
def emulated_generate_llama_fp8_2_ranks_gives_one_devices_tokens():
    # XLA and the kernels round bf16 activations at different points, so a near-tie could flip a token (the fp8
    # step checks bound the logits' difference); none does in these steps.
    assert len(decode.decode_plan(_model("llama-fp8")).spec.fp8_weights) == 8  # every projection and the head
    _assert_generate_on_the_emulator("llama-fp8", _model_mesh(2))


@check
def a_failure_inside_the_callback_raises_on_every_device():
    plan, args = _step_args("llama", 1)
    step = jax.jit(
        functools.partial(tensor_parallel_decode_step, spec=plan.spec, mesh=_model_mesh(4, 2), axis_name="model")
    )
    bad = list(args)
    bad[12] = jnp.full((1, 1), 12, jnp.int32)  # traced: checked when the step runs; S - T = 11
    with jn.use_backend("emulator"):
        try:
            jax.block_until_ready(step(*bad))
        except Exception as error:  # JAX's runtime error around the callback's
            assert "decode_step: write_index: got 12, expected 0 <= write_index <= S - T = 11" in str(error), error
        else:
            raise AssertionError("a write_index out of range ran")
        # Every device stopped at the check (none waits in a collective): the next step runs.
        logits, _, _ = jax.block_until_ready(step(*args))
    np.testing.assert_allclose(logits, jax.jit(functools.partial(decode_step, spec=plan.spec))(*args)[0], atol=2e-5)


@check
def a_shard_no_kernel_fits_fails_when_traced():
    # head_dim 24: the kernels' heads must tile the partitions.
    config = LlamaConfig.preset("tiny", num_layers=2, **{**SIZES, "head_dim": 24})
    model = _random_model(Llama, config, 0)
    plan = decode.decode_plan(model)
    args = _operands(model, plan, *_step_inputs(model, _rng("head_dim 24"), 1))
    step = jax.jit(
        functools.partial(tensor_parallel_decode_step, spec=plan.spec, mesh=_model_mesh(2), axis_name="model")
    )
    with jn.use_backend("emulator"):
        try:
            step.trace(*args)
        except ValueError as error:
            message = str(error)
            assert "decode_step: one rank's shard" in message and "DecodeSpec.head_dim: got 24" in message, message
        else:
            raise AssertionError("traced a step no kernel fits")


test_tensor_parallel_emulator = check_test(CHECKS)


if __name__ == "__main__":
    run_checks(CHECKS)
