"""Qwen3 (models/qwen3.py) end to end.

load_hf's fp32 logits and greedy tokens equal transformers' Qwen3ForCausalLM on tiny random checkpoints (every
parameter randomized, QK-norms included; tied head, and untied with attention biases); the presets; compression
(factored MLPs and attention, pruned MLPs) and fp8 weights, each decoding through the decode step; the decode step's
XLA lowering against the model's own cached forward, and its looped kernel on the emulator against XLA and float64;
a GGUF file written like llama.cpp's converter writes Qwen3 against transformers' GGUF loader; and generate on a
2-device mesh (Megatron shards) equal to one device, run in an 8-device subprocess like the other sharding tests.
"""

import dataclasses
import functools
import re

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from gguf_files import byte_level_vocab, random_tensor
from hf_checkpoints import HF_CONFIG, write_hf_checkpoint
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from spmd_helpers import Checks, check_test, run_checks
from test_decode_step import VOCAB, _cached_forward, _compressed, _operands, _random_model, _step_inputs
from test_models_gguf import _transformers_from_gguf
from test_models_hf import SEQ_LEN, SHAPE, _prompt, _randomized_reference
from test_models_quantization import _reference as _dequantized_reference

import jax_neuronmm
from jax_neuronmm import decode_step
from jax_neuronmm.models import (
    Qwen3,
    Qwen3Config,
    decode,
    from_preset,
    generate,
    load_compressed_checkpoint,
    load_gguf,
    load_hf,
    presets,
)
from jax_neuronmm.models.layers import GatedMLP
from jax_neuronmm.nn.nnx import SVDMLP, Linear, SVDLinear
from jax_neuronmm.pipeline import Recipe, compress_checkpoint, compress_model, quantize_model
from jax_neuronmm.pipeline.compression import NoCalibrationWarning
from jax_neuronmm.weights import WeightFormat
from nki_kernels.decode import reference

_forward = nnx.jit(lambda model, ids: model(ids))


@functools.cache
def _tiny(**overrides):
    """A 2-layer Qwen3 with every parameter random (norms around 1): hidden 64, MLP 136, vocabulary 97."""
    config = Qwen3Config.preset("tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=136, **overrides)
    return _random_model(Qwen3, config, seed=5)


def _assert_greedy_by_full_forward(model, prompt, tokens):
    """tokens [B, P + n] from generate(model, prompt, n): each new token is the argmax of a cache-free forward over
    everything before it."""
    tokens = np.asarray(tokens)
    np.testing.assert_array_equal(tokens[:, : prompt.shape[1]], prompt)
    full = np.asarray(_forward(model, jnp.asarray(tokens))).argmax(-1)
    np.testing.assert_array_equal(tokens[:, prompt.shape[1] :], full[:, prompt.shape[1] - 1 : -1])
    assert len(set(tokens[:, prompt.shape[1] :].ravel().tolist())) > 2, "degenerate continuation proves little"


# --- Hugging Face checkpoints against transformers -------------------------------------------------------------


def _hf_config(tie: bool) -> transformers.Qwen3Config:
    rope = {"rope_type": "default", "rope_theta": 1e6} if tie else {"rope_type": "linear", "factor": 2.0}
    return transformers.Qwen3Config(
        **SHAPE,
        num_hidden_layers=3,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        attention_bias=not tie,
        rope_parameters={"rope_theta": 1e4, **rope},
        eos_token_id=3,
    )


@pytest.fixture(scope="module", params=["tied", "untied_bias"])
def checkpoint(request, tmp_path_factory):
    reference_model = _randomized_reference(
        transformers.Qwen3ForCausalLM, _hf_config(request.param == "tied"), seed=11 + len(request.param)
    )
    path = str(tmp_path_factory.mktemp(request.param))
    reference_model.save_pretrained(path, safe_serialization=True)
    return request.param, reference_model, load_hf(path, dtype=jnp.float32)


def test_load_hf_logits_match_transformers(checkpoint):
    name, reference_model, model = checkpoint
    assert isinstance(model, Qwen3) and model.eos_token_ids == (3,)
    assert (model.lm_head is None) == (name == "tied")
    attn = model.layers[0].self_attn
    assert attn.q_norm.unit_offset is False and attn.k_norm.weight.shape == (SHAPE["head_dim"],)
    assert (attn.q_proj.bias is not None) == (name == "untied_bias")
    ids = _prompt(2, SEQ_LEN, SHAPE["vocab_size"], seed=4)
    with torch.no_grad():
        expected = reference_model(torch.from_numpy(ids)).logits.double().numpy()
    got = np.asarray(_forward(model, jnp.asarray(ids)), np.float64)
    assert got.shape == expected.shape == (2, SEQ_LEN, SHAPE["vocab_size"])
    assert np.std(expected) > 0.05, "reference logits are degenerate; the comparison would prove little"
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0, err_msg=name)


def test_greedy_decode_matches_transformers(checkpoint):
    name, reference_model, model = checkpoint
    # The tied model decodes through decode_step; attention biases keep the model's own forward.
    assert (decode.decode_plan(model) is None) == (name == "untied_bias")
    ids = _prompt(1, 7, SHAPE["vocab_size"], seed=5)
    steps = 12
    with torch.no_grad():
        expected = reference_model.generate(
            torch.from_numpy(ids), max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0
        ).numpy()
    assert len(set(expected[0, 7:].tolist())) > 1, "reference continuation is constant; pick another seed"
    np.testing.assert_array_equal(np.asarray(generate(model, ids, steps)), expected, err_msg=name)


def test_sliding_window_configs_are_refused():
    config = _hf_config(tie=True).to_dict()
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen3Config.from_hf({**config, "use_sliding_window": True})
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen3Config.from_hf({**config, "layer_types": ["full_attention", "sliding_attention", "full_attention"]})


# --- presets ------------------------------------------------------------------------------------------------------


def test_presets():
    assert presets.FAMILY_PRESETS["qwen3"] == ("tiny", "0.6b")
    assert presets.PUBLISHED["Qwen3-0.6B"][:2] == ("qwen3", "0.6b")
    tiny = from_preset("qwen3", "tiny", seed=1)
    assert isinstance(tiny, Qwen3) and tiny.lm_head is None
    logits = np.asarray(_forward(tiny, jnp.asarray(_prompt(1, 5, 512, seed=1))))
    assert logits.shape == (1, 5, 512) and np.isfinite(logits).all()
    # Qwen3-0.6B's published shape: 0.44B parameters besides the (tied) embedding; covered by the decode step.
    abstract = nnx.eval_shape(lambda: from_preset("qwen3", "0.6b", dtype=jnp.bfloat16))
    sizes = {"/".join(map(str, path)): v.size for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
    assert abs(sum(sizes.values()) - sizes["embed_tokens/embedding"] - 0.44e9) < 0.005e9
    spec = decode.preset_decode_spec("qwen3", "0.6b")
    assert (spec.num_layers, spec.hidden, spec.intermediate, spec.vocab) == (28, 1024, 3072, 151936)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (16, 8, 128)
    assert spec.qk_norm and not spec.norm_unit_offset and not spec.sandwich
    with pytest.raises(ValueError, match="preset: got '7b'"):
        from_preset("qwen3", "7b")


# --- compression and fp8 -------------------------------------------------------------------------------------------


def _calibration_ids(seed=7):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(12, 29))


def test_full_rank_factors_reproduce_dense_logits():
    model = _tiny()
    with pytest.warns(NoCalibrationWarning):
        factored = compress_model(model, Recipe(rank="full", include=("mlp", "attention")), progress=False)
    assert isinstance(factored.layers[0].mlp, SVDMLP) and isinstance(factored.layers[1].self_attn.k_proj, SVDLinear)
    ids = jnp.asarray(_prompt(2, 9, VOCAB, seed=2))
    dense = np.asarray(_forward(model, ids), np.float64)
    np.testing.assert_allclose(np.asarray(_forward(factored, ids)), dense, rtol=0, atol=1e-4 * np.abs(dense).max())


@pytest.mark.filterwarnings("ignore::jax_neuronmm.pipeline.compression.RankRoundingWarning")
def test_whitened_factors_of_mlp_and_attention_decode_through_the_decode_step():
    model, ids = _tiny(), _calibration_ids()
    recipe = Recipe(keep=0.6, include=("mlp", "attention"), block=8, mlp_form="factored")
    whitened = compress_model(
        model, dataclasses.replace(recipe, method="whitened", steps=()), calibration_ids=ids, progress=False
    )
    plain = compress_model(model, dataclasses.replace(recipe, method="svd"), progress=False)
    assert isinstance(whitened.layers[0].mlp, SVDMLP) and isinstance(whitened.layers[0].self_attn.q_proj, SVDLinear)
    # Whitening fits the calibration activations better than plain truncation at the same ranks.
    dense = np.asarray(_forward(model, jnp.asarray(ids)), np.float64)
    errors = [np.linalg.norm(np.asarray(_forward(m, jnp.asarray(ids)), np.float64) - dense) for m in (whitened, plain)]
    assert errors[0] < errors[1], errors
    plan = decode.decode_plan(whitened)
    assert plan is not None and plan.spec.ranks[0] is not None and plan.spec.qk_norm
    prompt = _prompt(2, 5, VOCAB, seed=3)
    _assert_greedy_by_full_forward(whitened, prompt, generate(whitened, prompt, 6))


@pytest.mark.filterwarnings("ignore::jax_neuronmm.pipeline.compression.RankRoundingWarning")
def test_pruned_mlps_decode_through_the_decode_step():
    model = _tiny()
    pruned = compress_model(
        model,
        Recipe(keep=0.6, mlp_form="pruned", steps=(), block=8),
        calibration_ids=_calibration_ids(),
        progress=False,
    )
    assert isinstance(pruned.layers[0].mlp, GatedMLP) and pruned.config.intermediate_size < 136
    assert model.config.intermediate_size == 136, "the input model must stay unchanged"
    assert decode.decode_plan(pruned) is not None
    prompt = _prompt(2, 5, VOCAB, seed=4)
    _assert_greedy_by_full_forward(pruned, prompt, generate(pruned, prompt, 6))


@pytest.mark.filterwarnings("ignore::jax_neuronmm.pipeline.compression.NoCalibrationWarning")
@pytest.mark.filterwarnings("ignore::jax_neuronmm.pipeline.compression.RankRoundingWarning")
def test_compressed_checkpoint_round_trip(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf", {**HF_CONFIG, "model_type": "qwen3"})
    recipe = Recipe(keep=0.5, block=16, include=("mlp", "attention"))
    compress_checkpoint(tmp_path / "hf", tmp_path / "out", recipe)
    loaded = load_compressed_checkpoint(tmp_path / "out")
    expected = compress_model(load_hf(str(tmp_path / "hf")), recipe, progress=False)
    assert isinstance(loaded, Qwen3) and isinstance(loaded.layers[1].self_attn.v_proj, SVDLinear)
    ids = jnp.asarray(_prompt(2, 7, HF_CONFIG["vocab_size"], seed=10))
    want = np.asarray(_forward(expected, ids))
    np.testing.assert_allclose(np.asarray(_forward(loaded, ids)), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_fp8_weights_compute_their_dequantized_values_and_decode():
    model = _tiny(tie_word_embeddings=False)
    quantized = quantize_model(model)
    for module in (quantized.layers[1].self_attn.k_proj, quantized.lm_head):
        assert isinstance(module, Linear) and module.format is WeightFormat.FP8_E4M3
    ids = jnp.asarray(_prompt(2, 9, VOCAB, seed=6))
    got = np.asarray(_forward(quantized, ids), np.float64)
    want = np.asarray(_forward(_dequantized_reference(model, quantized), ids), np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    dense = np.asarray(_forward(model, ids), np.float64)
    assert 0 < np.abs(got - dense).max() <= 0.1 * np.abs(dense).max()  # rounding to fp8 shows, mildly
    assert set(decode.decode_plan(quantized).spec.fp8_weights) == {"q", "k", "v", "o", "gate", "up", "down", "head"}
    prompt = _prompt(2, 5, VOCAB, seed=7)
    _assert_greedy_by_full_forward(quantized, prompt, generate(quantized, prompt, 6))


# --- the decode step ---------------------------------------------------------------------------------------------

MODELS = {
    "dense": _tiny,
    # Untied head factored at rank 23, k_proj dense in layer 0 and factored in layer 1, per-layer ranks.
    "compressed": lambda: _compressed(_tiny(tie_word_embeddings=False), (7, 19), dense_k_in_layer=0),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_decode_step_on_xla_equals_the_models_cached_forward(name, rng):
    model = MODELS[name]()
    plan = decode.decode_plan(model)
    assert plan is not None, decode.unsupported_reason(model)
    assert plan.spec.qk_norm and not plan.spec.norm_unit_offset
    ids, positions, cache = _step_inputs(model, rng, 1)
    want_logits, want = _cached_forward(model, ids, positions, cache)
    got_logits, got = jax.jit(decode.decode, static_argnums=(1,))(
        model, plan, decode.stack_weights(model, plan), ids, positions, cache
    )
    assert float(jnp.std(want_logits)) > 0.3  # logits that vary: the comparison proves something
    np.testing.assert_allclose(got_logits, want_logits, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got.keys, want.keys, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(got.values, want.values, rtol=2e-5, atol=2e-6)


def test_decode_step_on_the_emulator_equals_xla_and_float64(rng):
    model = MODELS["compressed"]()
    plan = decode.decode_plan(model)
    args = _operands(model, plan, *_step_inputs(model, rng, 1))
    step = jax.jit(functools.partial(decode_step, spec=plan.spec))
    on_xla = step(*args)
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        on_emulator = jax.block_until_ready(step(*args))
    assert [run.name for run in prof.runs] == ["decode_step_kernel"]
    kernel_args = [list(a) if isinstance(a, tuple) else (None if a is None else np.asarray(a)) for a in args]
    want = reference.decode_step_f64(kernel_args, plan.spec)
    for got_xla, got_emulator, f64 in zip(on_xla, on_emulator, want):
        np.testing.assert_allclose(got_xla, f64, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got_emulator, f64, rtol=1e-4, atol=1e-4)


def test_generate_on_the_emulator_equals_xla():
    model = _tiny()
    prompt = _prompt(2, 5, VOCAB, seed=8)
    on_xla = np.asarray(generate(model, prompt, 6))
    _assert_greedy_by_full_forward(model, prompt, on_xla)
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        on_emulator = np.asarray(generate(model, prompt, 3))
    np.testing.assert_array_equal(on_emulator, on_xla[:, :8])
    assert [run.name for run in prof.runs].count("decode_step_kernel") == 2  # one launch per decode step


# --- GGUF ----------------------------------------------------------------------------------------------------------

# head_dim 48: heads x head_dim (192) differs from the width (256), as in Qwen3-0.6B (16 x 128 vs 1024).
GGUF_SHAPES = dict(hidden=256, intermediate=320, heads=4, kv_heads=2, head_dim=48, layers=2)
GGUF_TYPES = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def _write_qwen3_gguf(path, *, tied: bool, seed: int):
    """A random Qwen3 GGUF as llama.cpp's converter lays it out: HF's rotate-half Q/K rows and plain (w) norms kept,
    head size in attention.key_length, byte-level BPE vocabulary."""
    rng = np.random.default_rng(seed)
    s = GGUF_SHAPES
    writer = gguf.GGUFWriter(path, "qwen3")
    tokens, merges, types, special = byte_level_vocab()
    # Merges of digits: "qwen2" splits numbers into single digits first, so they never apply (GPT-2's split would).
    tokens, merges, types = tokens + ["12", "23"], merges + ["1 2", "2 3"], types + [1, 1]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_eos_token_id(special["eos"])
    writer.add_context_length(64)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_block_count(s["layers"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    q_out, kv_out, hidden, inter = (
        s["heads"] * s["head_dim"],
        s["kv_heads"] * s["head_dim"],
        s["hidden"],
        s["intermediate"],
    )
    matrices = [("token_embd.weight", (len(tokens), hidden))] + (
        [] if tied else [("output.weight", (len(tokens), hidden))]
    )
    norms = [("output_norm.weight", (hidden,))]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        matrices += [
            (b + "attn_q.weight", (q_out, hidden)),
            (b + "attn_k.weight", (kv_out, hidden)),
            (b + "attn_v.weight", (kv_out, hidden)),
            (b + "attn_output.weight", (hidden, q_out)),
            (b + "ffn_gate.weight", (inter, hidden)),
            (b + "ffn_up.weight", (inter, hidden)),
            (b + "ffn_down.weight", (hidden, inter)),
        ]
        norms += [(b + n + ".weight", (hidden,)) for n in ("attn_norm", "ffn_norm")]
        norms += [(b + n + ".weight", (s["head_dim"],)) for n in ("attn_q_norm", "attn_k_norm")]
    for index, (name, shape) in enumerate(matrices):
        data, _ = random_tensor(rng, shape, GGUF_TYPES[index % len(GGUF_TYPES)])
        writer.add_tensor(name, data, raw_dtype=GGUF_TYPES[index % len(GGUF_TYPES)] if data.dtype == np.uint8 else None)
    for name, shape in norms:
        writer.add_tensor(name, random_tensor(rng, shape, gguf.GGMLQuantizationType.F32, offset=1.0, scale=0.3)[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gguf_logits_match_transformers(tmp_path, tied):
    path = str(tmp_path / "qwen3.gguf")
    _write_qwen3_gguf(path, tied=tied, seed=21 + tied)
    ours = load_gguf(path)
    assert isinstance(ours, Qwen3) and ours.config.head_dim == GGUF_SHAPES["head_dim"]
    assert ours.config.rope.theta == 1e6 and (ours.lm_head is None) == tied
    # transformers' GGUF config for qwen3 does not read attention.key_length: the head size is given to it.
    reference_model = _transformers_from_gguf(path, head_dim=GGUF_SHAPES["head_dim"])
    ids = np.random.default_rng(7).integers(0, ours.config.vocab_size, size=(2, 13))
    with torch.no_grad():
        expected = reference_model(torch.from_numpy(ids)).logits.double().numpy()
    got = np.asarray(_forward(ours, jnp.asarray(ids)), np.float64)
    assert got.shape == expected.shape and np.abs(expected).max() > 1.0
    np.testing.assert_allclose(got, expected, atol=2e-4 * np.abs(expected).max(), rtol=0)


def test_gguf_tokenizer_matches_transformers(tmp_path):
    path = str(tmp_path / "qwen3.gguf")
    _write_qwen3_gguf(path, tied=True, seed=2)
    text = "the 12345 hello:the world 2023\n\nthen"
    expected = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="qwen3.gguf")(text)["input_ids"]
    got = load_gguf(path).tokenizer.encode(text).ids
    assert got == expected
    vocab = load_gguf(path).tokenizer.get_vocab()
    assert vocab["12"] not in got and vocab["1"] in got  # digits one at a time, as Qwen's split regex has them
    assert len(set(got)) > 8


def test_gguf_rope_frequency_table_is_refused(tmp_path):
    path = str(tmp_path / "qwen3.gguf")
    _write_qwen3_gguf(path, tied=True, seed=3)
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "with_rope_freqs.gguf"), "qwen3")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=field.types[-1])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.add_tensor("rope_freqs.weight", np.ones(GGUF_SHAPES["head_dim"] // 2, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        load_gguf(str(tmp_path / "with_rope_freqs.gguf"))


# --- tensor parallelism (8-device subprocess) ------------------------------------------------------------------------

CHECKS = Checks()

# Megatron layout (examples/tensor_parallel_generate.py's): q/k/v/gate/up by output columns, o/down by input rows,
# dense kernels or SVD factors; the rest (norms, QK-norms, embedding, head) replicated.
MEGATRON = (
    (r"mlp/(gate_proj|up_proj)/(v|kernel)$", P(None, "model")),
    (r"mlp/down_proj/(u|kernel)$", P("model", None)),
    (r"self_attn/(q_proj|k_proj|v_proj)/(v|kernel)$", P(None, "model")),
    (r"self_attn/o_proj/(u|kernel)$", P("model", None)),
)


def _on_two_devices(model):
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    graphdef, state = nnx.split(model)

    def place(path, value):
        name = "/".join(str(key.key) for key in path if hasattr(key, "key"))
        spec = next((s for pattern, s in MEGATRON if re.search(pattern, name)), P())
        return jax.device_put(value, NamedSharding(mesh, spec))

    return mesh, nnx.merge(graphdef, jax.tree_util.tree_map_with_path(place, state))


def _assert_two_devices_equal_one(model):
    prompt = _prompt(2, 5, VOCAB, seed=9)
    single = np.asarray(generate(model, prompt, 5, temperature=0.8, seed=3))
    mesh, sharded = _on_two_devices(model)
    plan = decode.decode_plan(sharded)
    assert plan.tensor_parallel == decode.TensorParallel(mesh, "model"), plan.tensor_parallel
    assert plan.spec.qk_norm and plan.spec.num_kv_heads == 2  # one KV head (and its QK-norms) per device
    np.testing.assert_array_equal(np.asarray(generate(sharded, prompt, 5, temperature=0.8, seed=3)), single)


@CHECKS.check
def generate_dense_on_2_devices_equals_one():
    _assert_two_devices_equal_one(_tiny())


@CHECKS.check
def generate_compressed_on_2_devices_equals_one():
    _assert_two_devices_equal_one(MODELS["compressed"]())


test_tensor_parallel = check_test(CHECKS)


if __name__ == "__main__":
    run_checks(CHECKS)
