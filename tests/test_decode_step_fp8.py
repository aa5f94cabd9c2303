"""decode_step with fp8 weights: the emulator's looped kernel and the XLA backend compute the same logits and
caches to bf16 precision (both scale the float32 sums of fp8 weights; they round activations at different places,
as for bf16 weights) and pick the same greedy tokens wherever the logits' difference cannot flip them, the float64
reference of the dequantized weights agrees, and an fp8 weight without its scales names the argument.

Operands as tests/decode_operands.py makes them (a Gemma-3-like spec: factored projections and head, k
dense; values across the whole e4m3 range, scales over four orders of magnitude; a 40-token vocabulary without the
final soft-cap, so that most greedy choices are clear), given to JAX as float8_e4m3fn (the storage
`compress.quantize_fp8` makes; the same bits as Trainium's e4m3 within ±240).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from decode_operands import GEMMA3_8, WEIGHT_INDEX, fp8_operands

import jax_neuronmm
from jax_neuronmm import decode_step
from nki_kernels.decode import DecodeOperands, Factored, Quantized, layouts, packing, reference

B, SLOTS, STEPS = 4, 8, 3
SPEC = GEMMA3_8.replace(vocab=40, head_rank=23, final_logit_softcap=None)


def _jax_operands(operands, spec):
    """Kernel-test operands as decode_step takes them: jnp arrays, fp8 values as float8_e4m3fn, stored weights as
    Factored (stacked to the largest rank, as decode_step wants: the kernel tests pad further) / Quantized."""
    names = {i: name for name, i in WEIGHT_INDEX.items()}
    out = []
    for i, op in enumerate(operands):
        if isinstance(op, list):
            parts = [jnp.asarray(p.view(ml_dtypes.float8_e4m3fn) if p.dtype.itemsize == 1 else p) for p in op]
            if spec.factored(names[i]):
                rank = spec.head_rank if names[i] == "head" else max(spec.ranks[WEIGHT_INDEX[names[i]] - 3])
                u, v, u_scale, v_scale = parts
                op = Factored(u[..., :rank], v[..., :rank, :], u_scale[..., :rank], v_scale)
            else:
                op = Quantized(*parts)
        elif op is not None:
            op = jnp.asarray(op)
        out.append(op)
    return out


def _causal_mask(spec, write_index):
    """[NM, B, 1, S] float32: slots up to the step's own visible, every table alike."""
    visible = np.arange(SLOTS) <= write_index
    return np.broadcast_to(np.where(visible, 0.0, np.finfo(np.float32).min), (spec.num_masks, B, 1, SLOTS)).astype(
        np.float32
    )


@pytest.fixture(scope="module")
def steps():
    """Operands of a first step at slot 0 and, per backend, (logits, k_cache, v_cache, tokens) of STEPS greedy
    steps and the kernel launches. Each step embeds the XLA backend's tokens of the step before (both backends
    see the same inputs, so one flipped choice cannot derail the steps after it)."""
    rng = np.random.default_rng(24)
    spec = SPEC
    operands = fp8_operands(rng, spec, B, 1, SLOTS, 0)
    operands[15] = _causal_mask(spec, 0)
    embedding = rng.standard_normal((spec.vocab, spec.hidden)).astype(ml_dtypes.bfloat16)
    step = jax.jit(functools.partial(decode_step, spec=spec))
    runs = {}
    for backend in ("xla", "emulator"):
        ops = _jax_operands(operands, spec)
        history = []
        with jax_neuronmm.use_backend(backend), jax_neuronmm.profile() as prof:
            for index in range(STEPS):
                ops[12] = jnp.full((1, 1), index, jnp.int32)
                ops[15] = jnp.asarray(_causal_mask(spec, index))
                logits, k_cache, v_cache = jax.block_until_ready(step(*ops))
                history.append((logits, k_cache, v_cache, np.asarray(logits[:, 0]).argmax(-1)))
                tokens = runs["xla"][0][index][3] if backend == "emulator" else history[-1][3]
                ops[0], ops[10], ops[11] = jnp.asarray(embedding[tokens][:, None]), k_cache, v_cache
        runs[backend] = (history, [run.name for run in prof.runs])
    return spec, operands, runs


def test_emulator_equals_xla_and_the_float64_reference(steps):
    spec, operands, runs = steps
    (xla, _), (emulator, launches) = runs["xla"], runs["emulator"]
    assert launches == ["decode_step_kernel"] * STEPS  # one looped launch per step, fp8 weights included
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    for got in (xla[0], emulator[0]):
        logits, k_cache, v_cache, _ = got
        assert logits.dtype == jnp.float32 and np.std(want_logits) > 0.1
        np.testing.assert_allclose(logits, want_logits, atol=3e-2 * np.abs(want_logits).max())
        np.testing.assert_allclose(np.asarray(k_cache[:, :, 0], np.float32), want_k[:, :, 0], atol=3e-2, rtol=3e-2)
        np.testing.assert_allclose(np.asarray(v_cache[:, :, 0], np.float32), want_v[:, :, 0], atol=3e-2, rtol=3e-2)
    for (xla_logits, *_), (emulator_logits, *_) in zip(xla, emulator):
        np.testing.assert_allclose(emulator_logits, xla_logits, atol=2e-2 * np.abs(xla_logits).max())


def test_greedy_tokens_on_the_emulator_equal_xla(steps):
    """Where XLA's best logit leads its runner-up by more than twice the backends' largest logit difference in that
    row (no rounding could flip it), the emulator picks the same token; most choices here are that clear."""
    _, _, runs = steps
    xla, emulator = runs["xla"][0], runs["emulator"][0]
    assert len({tuple(step[3]) for step in xla}) > 1  # the steps pick different tokens: the loop carries state
    clear = 0
    for (xla_logits, *_, xla_tokens), (emulator_logits, *_, emulator_tokens) in zip(xla, emulator):
        top2 = np.sort(np.asarray(xla_logits[:, 0]), axis=-1)[:, -2:]
        difference = np.abs(np.asarray(emulator_logits[:, 0]) - np.asarray(xla_logits[:, 0])).max(axis=-1)
        decisive = top2[:, 1] - top2[:, 0] > 2 * difference
        np.testing.assert_array_equal(emulator_tokens[decisive], xla_tokens[decisive])
        clear += decisive.sum()
    assert clear >= 0.75 * B * STEPS


def test_fp8_weights_without_their_scales_name_the_argument():
    rng = np.random.default_rng(7)
    spec = SPEC
    ops = _jax_operands(fp8_operands(rng, spec, B, 1, SLOTS, 0), spec)
    step = functools.partial(decode_step, spec=spec)

    def replaced(name, value):
        return [value if i == WEIGHT_INDEX[name] else op for i, op in enumerate(ops)]

    gate, k = ops[WEIGHT_INDEX["gate"]], ops[WEIGHT_INDEX["k"]]
    with pytest.raises(ValueError, match="decode_step: gate.u_scale: got None: spec.fp8_weights names gate"):
        step(*replaced("gate", Factored(gate.u, gate.v)))
    with pytest.raises(ValueError, match=r"decode_step: k: got one array, expected Quantized\(w, scale\)"):
        step(*replaced("k", k.w))
    with pytest.raises(ValueError, match=r"decode_step: k.scale: got shape \(3, 63\), expected \(3, 64\)"):
        jax.jit(step)(*replaced("k", Quantized(k.w, k.scale[:, 1:])))
    # fp8 values in any other 8-bit format are refused (float8_e4m3, the same bits, is taken: test_fp8_range.py).
    with pytest.raises(TypeError, match="decode_step: k.w: got dtype float8_e5m2, expected float8_e4m3fn"):
        step(*replaced("k", Quantized(k.w.astype(jnp.float8_e5m2), k.scale)))
    # A pair of parts is read as the spec stores the weight.
    logits, _, _ = jax.eval_shape(step, *replaced("k", (k.w, k.scale)))
    assert logits.shape == (B, 1, spec.vocab)


def test_packed_attention_weights_compute_the_unpacked_step_on_both_backends():
    """decode_step with the attention's fp8 values packed (spec.packed_weights, packing.pack_weights of the
    float8_e4m3fn arrays JAX holds): the XLA backend unpacks them and computes exactly the unpacked step; the
    emulator's looped kernel reads the packed operand and returns exactly what it returns unpacked."""
    rng = np.random.default_rng(11)
    spec = SPEC
    packed_spec = spec.replace(packed_weights=("q", "k", "v", "o"))
    operands = fp8_operands(rng, spec, B, 1, SLOTS, 2)
    operands[15] = _causal_mask(spec, 2)
    ops = DecodeOperands.of(_jax_operands(operands, spec), spec)
    packed = packing.pack_weights(ops, packed_spec, jnp)
    assert packed.packed.dtype == jnp.float8_e4m3fn and packed.q.u is None
    for backend in ("xla", "emulator"):
        with jax_neuronmm.use_backend(backend):
            want = jax.jit(functools.partial(decode_step, spec=spec))(ops)
            got = jax.jit(functools.partial(decode_step, spec=packed_spec))(packed)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    with pytest.raises(ValueError, match=r"decode_step: q.u: expected None since spec.packed_weights names q"):
        decode_step(packed.replace(q=ops.q), spec=packed_spec)


def test_generate_packs_a_compressed_fp8_models_attention_factors(monkeypatch):
    """A compressed Gemma 3 (bf16 activations) in fp8: attention and MLPs factored at per-layer ranks, k dense in
    layer 1 (stacked as exact fp8 factors of another rank). Its decode plan packs the attention's factors
    (model_spec's packed_weights: attention_packing's choice, all four); stack_weights keeps their scales only and
    the values in packed [L, 128, E], once per generate call. A decode step's logits equal the unpacked step's
    exactly (XLA), and generate gives the same greedy tokens packed on XLA, unpacked on XLA (attention_packing
    patched to pack none) and packed on the emulator (the looped kernel reading the packed operand)."""
    from test_decode_step import VOCAB, _compressed, _random_model

    from jax_neuronmm.models import Gemma, GemmaConfig, decode, generate
    from jax_neuronmm.pipeline import quantize_model

    config = GemmaConfig.preset("gemma3-tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=136)
    dense = _random_model(functools.partial(Gemma, dtype=jnp.bfloat16), config, 5)
    model = quantize_model(_compressed(dense, (5, 13, 9), dense_k_in_layer=1), progress=False)
    spec = decode.model_spec(model)
    unpacked = packing.unpacked_spec(spec)
    assert spec.packed_weights == packing.attention_packing(unpacked) == ("q", "k", "v", "o")
    assert [spec.rank("k", layer) for layer in range(3)] == [5, None, 9]  # k dense in layer 1, read as such
    plan = decode.decode_plan(model)
    assert plan.spec == spec
    weights = decode.stack_weights(model, plan)
    assert weights.packed.shape == layouts.packed_shape(spec) and weights.packed.dtype == jnp.float8_e4m3fn
    q = weights.projections[0]
    assert q.u is None and q.v is None and q.u_scale.shape == (3, 13) and q.v_scale.shape == (3, 128)

    unpacked_plan = dataclasses.replace(plan, spec=unpacked)
    unpacked_weights = decode.stack_weights(model, unpacked_plan)
    assert unpacked_weights.packed is None and unpacked_weights.projections[0].u.dtype == jnp.float8_e4m3fn
    rng = np.random.default_rng(9)
    ids = rng.integers(0, VOCAB, size=(2, 5))
    _, cache = model(jnp.asarray(ids), positions=jnp.tile(jnp.arange(5), (2, 1)), cache=model.init_cache(2, 8))
    tokens, positions = jnp.asarray(ids[:, -1:]), jnp.full((2, 1), 5, jnp.int32)
    got, got_cache = decode.decode(model, plan, weights, tokens, positions, cache)
    want, want_cache = decode.decode(model, unpacked_plan, unpacked_weights, tokens, positions, cache)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_cache.keys, np.float32), np.asarray(want_cache.keys, np.float32))

    # 3 new tokens: two decode steps on the emulator (each a full looped-kernel emulation, the test's cost)
    packed_tokens = np.asarray(generate(model, ids, 3))
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        on_emulator = np.asarray(generate(model, ids, 3))
    assert [run.name for run in prof.runs].count("decode_step_kernel") == 2
    monkeypatch.setattr(decode, "attention_packing", lambda spec, **_: ())
    assert decode.decode_plan(model).spec == unpacked
    np.testing.assert_array_equal(np.asarray(generate(model, ids, 3)), packed_tokens)
    np.testing.assert_array_equal(on_emulator, packed_tokens)
