"""decode_step: the primitive's XLA lowering equals the models' own cached forward (Llama, Gemma 1, Gemma 3; dense
and compressed with per-layer ranks), under jit and vmap; bad operands name the argument; the emulator's looped
kernel equals XLA and the float64 reference; generate runs each decode step as one launch, with XLA's tokens."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_neuronmm
from jax_neuronmm import decode_step
from jax_neuronmm.decode_step import decode_step_p
from jax_neuronmm.decode_step_operands import ROW_OPERANDS, operand_names
from jax_neuronmm.models import Gemma, GemmaConfig, Llama, LlamaConfig, decode, generate
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear
from nki_kernels.activations import HF_ACTIVATIONS
from nki_kernels.decode import reference, traffic

VOCAB = 97
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=136)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _random_model(cls, config, seed):
    """A model whose every parameter is random (built abstractly, then filled): weights around a few times the init
    scale, norm weights around their identity value (1 for Llama, 0 for Gemma's 1 + w)."""
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    identity = 0.0 if cls is Gemma else 1.0
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        noise = rng.standard_normal(param.shape).astype(np.float32)
        if "norm" in "/".join(map(str, path)):
            param.set_value(jnp.asarray(identity + 0.3 * noise))
        else:
            param.set_value(jnp.asarray((0.08 if "embed" in str(path) else 0.15) * noise))
    return model


def _compressed(model, ranks, dense_k_in_layer=None):
    """A copy whose attention projections and MLPs are truncated-SVD factors of rank ranks[layer] (MLP: r, r + 3,
    r + 1); k_proj of layer `dense_k_in_layer` stays dense (a projection factored in some layers only); an untied
    LM head is factored at rank 23."""
    model = nnx.clone(model)
    if model.lm_head is not None:
        model.lm_head = SVDLinear.from_linear(model.lm_head, rank=23)
    for index, (layer, rank) in enumerate(zip(model.layers, ranks)):
        for name in ATTENTION:
            if not (name == "k_proj" and index == dense_k_in_layer):
                setattr(layer.self_attn, name, SVDLinear.from_linear(getattr(layer.self_attn, name), rank=rank))
        mlp = layer.mlp
        layer.mlp = SVDMLP.from_linears(
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
            rank=(rank, rank + 3, rank + 1),
            activation=HF_ACTIVATIONS[mlp.activation],
        )
    return model


@functools.cache
def _llama(**overrides):
    return _random_model(Llama, LlamaConfig.preset("tiny", num_layers=2, **SIZES, **overrides), seed=0)


@functools.cache
def _gemma():
    return _random_model(Gemma, GemmaConfig.preset("gemma-tiny", **SIZES), seed=1)


@functools.cache
def _gemma3():
    # Window 4 < the cache positions used below, soft-capping on: every Gemma 3 variant of the step is exercised.
    config = GemmaConfig.preset(
        "gemma3-tiny", **SIZES, sliding_window=4, attn_logit_softcapping=4.0, final_logit_softcapping=10.0
    )
    return _random_model(Gemma, config, seed=2)


MODELS = {
    "llama": _llama,
    "gemma3": _gemma3,
    # Untied, factored head, and k_proj dense in layer 0 but factored in layer 1.
    "llama-compressed": lambda: _compressed(_llama(tie_word_embeddings=False), (7, 19), dense_k_in_layer=0),
    "gemma-compressed": lambda: _compressed(_gemma(), (11, 5)),
    "gemma3-compressed": lambda: _compressed(_gemma3(), (5, 13, 9)),
}


@nnx.jit
def _cached_forward(model, ids, positions, cache, token_mask=None):
    return model(ids, positions=positions, token_mask=token_mask, cache=cache)


@functools.cache
def _model(name):
    return MODELS[name]()


def _prefilled(model, rng, batch=2, prompt=6, slots=12):
    """A cache holding a prompt (row 1 left-padded by 2) and each row's next position [B]."""
    ids = rng.integers(0, VOCAB, size=(batch, prompt))
    mask = np.ones((batch, prompt), bool)
    mask[1, :2] = False
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    cache = model.init_cache(batch, slots)
    _, cache = _cached_forward(model, jnp.asarray(ids), jnp.asarray(positions), cache, jnp.asarray(mask))
    return cache, mask.sum(axis=1)


def _step_inputs(model, rng, tokens):
    cache, next_positions = _prefilled(model, rng)
    ids = jnp.asarray(rng.integers(0, VOCAB, size=(2, tokens)))
    positions = jnp.asarray(next_positions[:, None] + np.arange(tokens), jnp.int32)
    return ids, positions, cache


def _operands(model, plan, ids, positions, cache):
    """The operands of one decode step, in `decode_step`'s order."""
    weights = decode.stack_weights(model, plan)
    x, cos, sin, bias = _step_operands(model, plan, ids, positions, cache)
    return [
        x,
        weights.norms,
        weights.qk_norms,
        *weights.projections,
        cache.keys,
        cache.values,
        jnp.reshape(cache.length, (1, 1)),
        cos,
        sin,
        bias,
        weights.final_norm,
        weights.head,
    ]


@nnx.jit(static_argnums=(1,))
def _step_operands(model, plan, ids, positions, cache):
    key_valid, key_positions = cache.key_slots(positions, jnp.ones(ids.shape, bool))
    return (model.embed(ids), *decode.step_tables(plan, positions, key_positions, key_valid))


@pytest.mark.parametrize(
    ("name", "tokens"),
    [("llama", 1), ("gemma3", 1), ("llama-compressed", 1), ("gemma-compressed", 1), ("gemma3-compressed", 3)],
)
def test_xla_lowering_equals_the_models_cached_forward(name, tokens, rng):
    model = _model(name)
    plan = decode.decode_plan(model)
    assert plan is not None, decode.unsupported_reason(model)
    if "compressed" in name:
        assert plan.spec.ranks[0] is not None and len(set(plan.spec.ranks[0])) > 1  # per-layer ranks differ
    assert (plan.spec.head_rank == 23) == (name == "llama-compressed")
    ids, positions, cache = _step_inputs(model, rng, tokens)
    want_logits, want = _cached_forward(model, ids, positions, cache)
    got_logits, got = jax.jit(decode.decode, static_argnums=(1,))(
        model, plan, decode.stack_weights(model, plan), ids, positions, cache
    )
    assert got_logits.dtype == jnp.float32 and got_logits.shape == (2, tokens, VOCAB)
    np.testing.assert_allclose(got_logits, want_logits, rtol=2e-5, atol=2e-5)
    assert float(jnp.std(want_logits)) > 0.3  # logits that vary: the comparison proves something
    for field in ("keys", "values"):
        np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=2e-5, atol=2e-6)
        assert float(jnp.abs(getattr(got, field)[:, :, 6 : 6 + tokens]).min()) > 0  # this step's slots written
    for field in ("slot_valid", "slot_positions", "length"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))


def test_jit_and_eager_agree_and_ranks_are_padded(rng):
    model = _model("gemma3-compressed")
    plan = decode.decode_plan(model)
    args = _operands(model, plan, *_step_inputs(model, rng, 1))
    q_u, q_v = args[3]
    assert q_u.shape == (3, 64, 13) and q_v.shape == (3, 13, 128)
    # Layer 0 has rank 5: its padding is zeros, which the kernels skip and the scan adds exactly.
    assert not np.asarray(q_u[0, :, 5:]).any() and not np.asarray(q_v[0, 5:]).any()
    eager = decode_step(*args, spec=plan.spec)
    jitted = jax.jit(functools.partial(decode_step, spec=plan.spec))(*args)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _split_rows(args, names):
    """Row operands with a leading group axis of 2 (one row each), at their own B axis for vmap."""
    out, in_axes = [], []
    for name, a in zip(names, args):
        if name in ROW_OPERANDS:
            axis = ROW_OPERANDS[name]
            out.append(a.reshape(a.shape[:axis] + (2, 1) + a.shape[axis + 1 :]))
            in_axes.append(axis)
        else:
            out.append(a)
            in_axes.append(None)
    return out, in_axes


def test_vmap_over_rows_folds_them_into_the_batch(rng):
    model = _model("gemma3-compressed")
    plan = decode.decode_plan(model)
    args = _operands(model, plan, *_step_inputs(model, rng, 1))
    names = operand_names(plan.spec)
    flat = _flat(args)
    want = decode_step_p.bind(*flat, spec=plan.spec)
    split, in_axes = _split_rows(flat, names)
    bind = functools.partial(decode_step_p.bind, spec=plan.spec)
    got = jax.vmap(lambda *a: tuple(bind(*a)), in_axes=in_axes, out_axes=(0, 1, 1))(*split)
    np.testing.assert_allclose(got[0].reshape(want[0].shape), want[0], rtol=2e-5, atol=2e-5)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g.reshape(w.shape), w, rtol=2e-5, atol=2e-6)


def test_vmap_over_write_index_runs_one_step_per_instance(rng):
    model = _model("llama")
    plan = decode.decode_plan(model)
    args = _operands(model, plan, *_step_inputs(model, rng, 1))
    step = functools.partial(decode_step, spec=plan.spec)
    indices = jnp.asarray([[[6]], [[9]]], jnp.int32)
    xs = jnp.stack([args[0], args[0][::-1]])

    def one(x, write_index):
        return step(x, *args[1:12], write_index, *args[13:])

    got = jax.vmap(one)(xs, indices)
    for i in range(2):
        want = one(xs[i], indices[i])
        for g, w in zip(got, want):
            np.testing.assert_allclose(g[i], w, rtol=2e-5, atol=2e-6)
    assert not np.allclose(got[1][0], got[1][1])  # the two instances wrote different slots


def test_bad_operands_name_the_argument(rng):
    model = _model("gemma3-compressed")
    plan = decode.decode_plan(model)
    args = _operands(model, plan, *_step_inputs(model, rng, 1))
    step = functools.partial(decode_step, spec=plan.spec)

    def replaced(index, value):
        return [value if i == index else a for i, a in enumerate(args)]

    with pytest.raises(ValueError, match=r"decode_step: q.u: got shape \(3, 64, 12\), expected \(3, 64, 13\)"):
        step(*replaced(3, (args[3][0][..., :12], args[3][1])))
    with pytest.raises(ValueError, match=r"decode_step: k_cache: got shape .*, expected \(3, 2, 12, 2, 32\)"):
        step(*replaced(10, args[10][:, :, :, :1]))
    with pytest.raises(ValueError, match="v_cache: got shape"):
        step(*replaced(11, args[11][:, :1]))
    with pytest.raises(TypeError, match="decode_step: cos: got dtype bfloat16, expected float32"):
        step(*replaced(13, args[13].astype(jnp.bfloat16)))
    with pytest.raises(TypeError, match="write_index: got dtype float32, expected int32"):
        step(*replaced(12, args[12].astype(jnp.float32)))
    with pytest.raises(ValueError, match="mask_bias: got shape"):
        step(*replaced(15, args[15][:1]))
    with pytest.raises(ValueError, match="qk_norms: got None"):
        step(*replaced(2, None))
    with pytest.raises(ValueError, match="gate: expected a factored pair"):
        step(*replaced(7, args[7][0]))
    with pytest.raises(TypeError, match="spec: got dict"):
        decode_step(*args, spec={})
    # Under jit the same checks run at trace time.
    with pytest.raises(ValueError, match="final_norm: got shape"):
        jax.jit(step)(*replaced(16, args[16][:10]))


@pytest.mark.parametrize("index", [-1, 12, 1000, 2**31 - 1])
def test_write_index_out_of_range_is_rejected_on_both_backends(rng, index):
    # XLA used to clamp it and write slot S - 1; the emulator raised an error that did not name it.
    model = _model("llama")
    plan = decode.decode_plan(model)
    args = _operands(model, plan, *_step_inputs(model, rng, 1))  # S = 12 slots, T = 1 token
    step = functools.partial(decode_step, spec=plan.spec)
    bad = [*args[:12], jnp.full((1, 1), index, jnp.int32), *args[13:]]
    message = rf"decode_step: write_index: got {index}, expected 0 <= write_index <= S - T = 11"
    with pytest.raises(ValueError, match=message):
        step(*bad)  # a concrete write_index: checked before anything runs
    for backend in ("xla", "emulator"):
        with jax_neuronmm.use_backend(backend), pytest.raises(Exception, match=message):
            jax.block_until_ready(jax.jit(step)(*bad))  # traced: checked when the step runs
    last = [*args[:12], jnp.full((1, 1), 11, jnp.int32), *args[13:]]
    logits, k_cache, _ = jax.jit(step)(*last)  # the last slot is in range
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(k_cache[:, :, :11], args[10][:, :, :11])
    assert not np.allclose(k_cache[:, :, 11], args[10][:, :, 11])


@pytest.mark.parametrize("field", ["norm_eps", "query_scaling"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1e-6, "1e-6"])
def test_spec_scalars_must_be_finite_and_positive(field, value):
    spec = decode.decode_plan(_model("llama")).spec
    with pytest.raises(ValueError, match=rf"DecodeSpec\.{field}: got .*, expected a finite positive float"):
        spec.replace(**{field: value})
    for cap in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"DecodeSpec\.final_logit_softcap: got .*, expected None or a finite"):
            spec.replace(final_logit_softcap=cap)


def test_empty_batch_or_cache_names_the_argument(rng):
    model = _model("llama")
    plan = decode.decode_plan(model)
    args = _operands(model, plan, *_step_inputs(model, rng, 1))
    step = functools.partial(decode_step, spec=plan.spec)
    with pytest.raises(ValueError, match=r"decode_step: x: got shape \(0, 1, 64\) with B \(rows\) = 0, expected >= 1"):
        step(args[0][:0], *args[1:])
    no_slots = [*args[:10], args[10][:, :, :0], args[11][:, :, :0], *args[12:]]
    with pytest.raises(ValueError, match=r"decode_step: k_cache: got shape .* with S \(slots\) = 0, expected >= 1"):
        step(*no_slots)
    with pytest.raises(ValueError, match=r"decode_step: k_cache: got shape .* with S \(slots\) = 0"):
        jax.jit(step)(*no_slots)


def test_it_is_inference_only(rng):
    model = _model("llama")
    plan = decode.decode_plan(model)
    args = _operands(model, plan, *_step_inputs(model, rng, 1))
    with pytest.raises(TypeError, match="decode_step is inference only"):
        jax.grad(lambda x: decode_step(x, *args[1:], spec=plan.spec)[0].sum())(args[0])


def test_models_with_biases_keep_their_own_decode():
    model = _llama(attention_bias=True)
    assert decode.decode_plan(model) is None
    assert "has a bias" in decode.unsupported_reason(model)
    prompt = np.random.default_rng(5).integers(0, VOCAB, size=(1, 4))
    got = np.asarray(generate(model, prompt, 5))
    full = np.asarray(model(jnp.asarray(got))).argmax(-1)
    np.testing.assert_array_equal(got[:, 4:], full[:, 3:-1])


def _flat(args):
    return [x for a in args if a is not None for x in (a if isinstance(a, tuple) else (a,))]


@pytest.mark.parametrize("name", ["llama-compressed", "gemma3"])
def test_emulator_kernel_equals_xla_and_the_float64_reference(name, rng):
    model = _model(name)
    plan = decode.decode_plan(model)
    args = _operands(model, plan, *_step_inputs(model, rng, 1))
    step = jax.jit(functools.partial(decode_step, spec=plan.spec))
    on_xla = step(*args)
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        on_emulator = jax.block_until_ready(step(*args))
    assert [run.name for run in prof.runs] == ["decode_step_kernel"]
    if name == "llama-compressed":  # k_proj dense in layer 0: the spec marks it, and the kernel reads its W alone
        assert [plan.spec.rank("k", layer) for layer in range(2)] == [None, 19]
        assert traffic.weight_bytes(plan.spec, itemsize=4) == decode.decode_weight_bytes(model, bytes_per_weight=4)
    kernel_args = [list(a) if isinstance(a, tuple) else (None if a is None else np.asarray(a)) for a in args]
    want = reference.decode_step_f64(kernel_args, plan.spec)
    for got_xla, got_emulator, f64 in zip(on_xla, on_emulator, want):
        np.testing.assert_allclose(got_xla, f64, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got_emulator, f64, rtol=1e-4, atol=1e-4)
    # vmap over rows folds them into one launch.
    split, in_axes = _split_rows(_flat(args), operand_names(plan.spec))
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        folded = jax.block_until_ready(
            jax.jit(
                jax.vmap(lambda *a: tuple(decode_step_p.bind(*a, spec=plan.spec)), in_axes=in_axes, out_axes=(0, 1, 1))
            )(*split)
        )
    assert len(prof.runs) == 1
    np.testing.assert_allclose(folded[0].reshape(on_emulator[0].shape), on_emulator[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama-compressed", "gemma3"])
def test_generate_on_the_emulator_is_one_launch_per_decode_step(name):
    model = _model(name)
    prompt = np.random.default_rng(6).integers(0, VOCAB, size=(2, 5))
    steps = 5
    on_xla = np.asarray(generate(model, prompt, steps))
    # Each new token is the argmax of a cache-free forward over everything before it (test_generate.py checks the
    # same for dense Llama and Gemma 3, whose decode steps go through decode_step too).
    full = np.asarray(nnx.jit(lambda m, ids: m(ids))(model, jnp.asarray(on_xla))).argmax(-1)
    np.testing.assert_array_equal(on_xla[:, 5:], full[:, 4:-1])
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        on_emulator = np.asarray(generate(model, prompt, steps))
    np.testing.assert_array_equal(on_emulator, on_xla)
    names = [run.name for run in prof.runs]
    first = names.index("decode_step_kernel")
    # The prefill's kernels (the compressed model's svd_matmul / svd_mlp; none for a dense one), then exactly one
    # launch per decode step.
    assert names[first:] == ["decode_step_kernel"] * (steps - 1)
    assert "decode_step_kernel" not in names[:first] and (first > 0) == ("compressed" in name)


def test_sliding_windows_on_the_emulator_with_right_padding(rng):
    """Gemma 3's sliding layers read only their window on the emulator (decode_plan sets spec.mask_windows). With
    right padding the pads between a row's prompt and its continuation lie inside the window's slot span:
    widen_windows covers them, and the logits equal XLA's (the unwidened window drops visible keys)."""
    model = _model("gemma3")
    plan = decode.decode_plan(model)
    assert plan.spec.mask_windows == tuple(plan.windows) and 4 in plan.windows
    ids = rng.integers(0, VOCAB, size=(2, 6))
    mask = np.ones((2, 6), bool)
    mask[0, 3:] = False  # row 0: 3 prompt tokens, then 3 pads
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    cache = model.init_cache(2, 12)
    _, cache = _cached_forward(model, jnp.asarray(ids), jnp.asarray(positions), cache, jnp.asarray(mask))
    step_ids = jnp.asarray(rng.integers(0, VOCAB, size=(2, 1)))
    step_positions = jnp.asarray(mask.sum(axis=1)[:, None], jnp.int32)
    weights = decode.stack_weights(model, plan)
    run = jax.jit(decode.decode, static_argnums=(1,))
    want, _ = run(model, plan, weights, step_ids, step_positions, cache)
    widened = decode.widen_windows(plan, 3)
    assert widened.spec.mask_windows == tuple(None if w is None else w + 3 for w in plan.windows)
    with jax_neuronmm.use_backend("emulator"):
        got, _ = run(model, widened, weights, step_ids, step_positions, cache)
        narrow, _ = run(model, plan, weights, step_ids, step_positions, cache)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(narrow[0]) - np.asarray(want[0])).max() > 1e-3  # row 0's prompt keys dropped
    np.testing.assert_allclose(narrow[1], want[1], rtol=1e-4, atol=1e-4)  # row 1 has no pads
    with pytest.raises(ValueError, match="pad_slots"):
        decode.widen_windows(plan, -1)


def test_pad_slots_counts_pads_after_a_rows_first_token():
    mask = np.array(
        [[False, False, True, True, True], [True, True, False, False, False], [True, False, True, True, False]]
    )
    assert decode.pad_slots(mask[:1]) == 0  # left padding: the window's slots hold consecutive positions
    assert decode.pad_slots(mask) == 3
    assert decode.pad_slots(mask[2:]) == 2
