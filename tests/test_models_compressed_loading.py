"""load_compressed_checkpoint: the output of examples/compress_checkpoint.py loads back as compress_model's model."""

import json
import os
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from jax_neuronmm.compress import CheckpointError
from jax_neuronmm.models import GatedMLP, compress_model, generate, load_compressed_checkpoint, load_hf
from jax_neuronmm.models.hf_loading import model_from_config
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")
HF_CONFIG = {
    "model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 136, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": [5, 7],
}
KEEP, BLOCK = 0.5, 16
_logits = nnx.jit(lambda model, ids: model(ids))


def _compress_checkpoint_module():
    sys.path.insert(0, EXAMPLES)
    try:
        import compress_checkpoint
    finally:
        sys.path.pop(0)
    return compress_checkpoint


def write_hf_checkpoint(rng, directory):
    """A random Llama of HF_CONFIG's shapes in PyTorch layout (model.*, [out, in] weights), with a tokenizer."""
    import tokenizers

    abstract = nnx.eval_shape(lambda: model_from_config(HF_CONFIG, rngs=nnx.Rngs(0)))
    tensors = {}
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        *modules, leaf = (str(key) for key in path)
        if leaf == "kernel":  # [in, out] in our layout
            weight = rng.standard_normal(variable.shape) / np.sqrt(variable.shape[0])
            name, array = ".".join(modules) + ".weight", weight.T
        elif leaf == "embedding":
            name, array = ".".join(modules) + ".weight", rng.standard_normal(variable.shape)
        else:  # norm weights: away from 1 so a misplaced norm shows
            name, array = ".".join(modules) + "." + leaf, 1 + 0.3 * rng.standard_normal(variable.shape)
        tensors[name if name.startswith("lm_head.") else "model." + name] = np.ascontiguousarray(array, np.float32)
    os.makedirs(directory)
    safetensors.numpy.save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(HF_CONFIG, f)
    vocab = {f"w{i}": i for i in range(HF_CONFIG["vocab_size"])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))


@pytest.mark.parametrize(("include_regex", "include"), [
    (None, ("mlp",)),
    (r"(?:^|/)(?:mlp|self_attn)/", ("mlp", "attention")),
], ids=["mlp", "mlp+attention"])
def test_loads_what_compress_model_builds(rng, tmp_path, include_regex, include):
    write_hf_checkpoint(rng, tmp_path / "hf")
    options = {} if include_regex is None else {"include": include_regex}
    _compress_checkpoint_module().compress_checkpoint(
        str(tmp_path / "hf"), str(tmp_path / "out"), keep=KEEP, block=BLOCK, progress=False, **options)

    loaded = load_compressed_checkpoint(tmp_path / "out")
    dense = load_hf(str(tmp_path / "hf"))
    expected = compress_model(dense, keep=KEEP, block=BLOCK, include=include)

    for loaded_layer, expected_layer in zip(loaded.layers, expected.layers, strict=True):
        assert isinstance(loaded_layer.mlp, SVDMLP)
        assert [getattr(loaded_layer.mlp, name).rank for name in ("gate_proj", "up_proj", "down_proj")] == \
            [getattr(expected_layer.mlp, name).rank for name in ("gate_proj", "up_proj", "down_proj")]
        attention_type = SVDLinear if "attention" in include else nnx.Linear
        assert all(isinstance(getattr(loaded_layer.self_attn, name), attention_type)
                   for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert loaded.layers[0].mlp.gate_proj.rank < HF_CONFIG["hidden_size"]  # really compressed
    assert loaded.eos_token_ids == (5, 7)
    assert loaded.tokenizer.encode("w3 w11").ids == [3, 11]

    ids = jnp.asarray(np.random.default_rng(1).integers(0, HF_CONFIG["vocab_size"], size=(2, 9)))
    got = np.asarray(_logits(loaded, ids), np.float64)
    want = np.asarray(_logits(expected, ids), np.float64)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.max(np.abs(got - np.asarray(_logits(dense, ids), np.float64))) > 1e-2  # differs from the dense model
    np.testing.assert_array_equal(np.asarray(generate(loaded, ids, 6)), np.asarray(generate(expected, ids, 6)))


def test_bfloat16_load(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    _compress_checkpoint_module().compress_checkpoint(
        str(tmp_path / "hf"), str(tmp_path / "out"), keep=KEEP, block=BLOCK, progress=False)
    model = load_compressed_checkpoint(tmp_path / "out", dtype=jnp.bfloat16)
    assert model.layers[1].mlp.down_proj.u.dtype == jnp.bfloat16
    ids = jnp.asarray(np.random.default_rng(2).integers(0, HF_CONFIG["vocab_size"], size=(1, 7)))
    want = np.asarray(_logits(load_compressed_checkpoint(tmp_path / "out"), ids), np.float64)
    got = np.asarray(_logits(model, ids).astype(jnp.float32), np.float64)
    assert np.max(np.abs(got - want)) < 0.1 * np.max(np.abs(want))


def test_not_a_compressed_checkpoint(rng, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_compressed_checkpoint(tmp_path / "absent")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_compressed_checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(FileNotFoundError, match="no model.safetensors.*compress_checkpoint"):
        load_compressed_checkpoint(tmp_path / "empty")
    write_hf_checkpoint(rng, tmp_path / "hf")  # a plain HF checkpoint is not ours
    with pytest.raises(CheckpointError, match="not written by save_compressed"):
        load_compressed_checkpoint(tmp_path / "hf")

    _compress_checkpoint_module().compress_checkpoint(
        str(tmp_path / "hf"), str(tmp_path / "out"), keep=KEEP, block=BLOCK, progress=False)
    shutil.copytree(tmp_path / "out", tmp_path / "deeper")
    (tmp_path / "deeper" / "config.json").write_text(json.dumps({**HF_CONFIG, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"missing tensors \['layers/2/"):
        load_compressed_checkpoint(tmp_path / "deeper")
    (tmp_path / "out" / "config.json").write_text(json.dumps({**HF_CONFIG, "hidden_size": 80, "head_dim": 20}))
    with pytest.raises(CheckpointError, match="shape"):
        load_compressed_checkpoint(tmp_path / "out")


def test_partially_factored_mlp_stays_unfused(rng, tmp_path):
    write_hf_checkpoint(rng, tmp_path / "hf")
    _compress_checkpoint_module().compress_checkpoint(
        str(tmp_path / "hf"), str(tmp_path / "out"), rank=8, include=r"layers/1/mlp/(?:gate|up)_proj",
        progress=False)
    model = load_compressed_checkpoint(tmp_path / "out")
    assert isinstance(model.layers[0].mlp, GatedMLP) and isinstance(model.layers[0].mlp.gate_proj, nnx.Linear)
    mlp = model.layers[1].mlp
    assert isinstance(mlp, GatedMLP) and isinstance(mlp.down_proj, nnx.Linear)
    assert isinstance(mlp.gate_proj, SVDLinear) and mlp.gate_proj.rank == 8 and mlp.up_proj.rank == 8
    # The gate projection computes x·u·v with the saved factors.
    x = np.random.default_rng(3).standard_normal((4, HF_CONFIG["hidden_size"]))
    u, v = (np.asarray(mlp.gate_proj.u[...], np.float64), np.asarray(mlp.gate_proj.v[...], np.float64))
    np.testing.assert_allclose(np.asarray(mlp.gate_proj(jnp.asarray(x, jnp.float32))), x @ u @ v, atol=1e-4)
    dense = load_hf(str(tmp_path / "hf")).layers[1].mlp.gate_proj.kernel[...]
    assert np.linalg.norm(u @ v - np.asarray(dense)) < np.linalg.norm(np.asarray(dense))  # a truncation of it
