"""examples/compress_checkpoint.py on a small HF-layout checkpoint written here (sharded, bf16 + f32)."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from jax_neuronmm.compress import load_compressed, truncated_svd, whitened_svd

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "compress_checkpoint.py")
HIDDEN, INTERMEDIATE, LAYERS = 48, 136, 2


def write_hf_checkpoint(rng, directory):
    """A Llama-shaped checkpoint in PyTorch layout ([out, in] weights), split over two shards with an index."""
    tensors = {"model.embed_tokens.weight": rng.standard_normal((50, HIDDEN)).astype(np.float32),
               "model.norm.weight": rng.standard_normal(HIDDEN).astype(np.float32),
               "lm_head.weight": rng.standard_normal((50, HIDDEN)).astype(np.float32)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "self_attn.q_proj.weight"] = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
        tensors[prefix + "input_layernorm.weight"] = rng.standard_normal(HIDDEN).astype(np.float32)
        for name, shape in (("gate_proj", (INTERMEDIATE, HIDDEN)), ("up_proj", (INTERMEDIATE, HIDDEN)),
                            ("down_proj", (HIDDEN, INTERMEDIATE))):
            tensors[prefix + f"mlp.{name}.weight"] = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    os.makedirs(directory)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, shard_names in shards.items():
        safetensors.numpy.save_file({n: tensors[n] for n in shard_names}, os.path.join(directory, shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "hidden_size": HIDDEN}, f)
    return tensors


def test_cli_compresses_mlp_projections(rng, tmp_path):
    tensors = write_hf_checkpoint(rng, tmp_path / "hf")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, EXAMPLE, f"--checkpoint_dir={tmp_path / 'hf'}", f"--output_dir={out}", "--keep=0.5",
         "--block=16", "--noprogress"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "6 layers, method=svd" in result.stdout
    assert sorted(os.listdir(out)) == ["compression_report.json", "config.json", "model.safetensors"]
    params, info = load_compressed(out / "model.safetensors")
    rank = 16  # 48·136·0.5 / (184·16) = 1.1 blocks of 16
    assert info.method == "svd" and info.keep == 0.5
    assert info.ranks == {f"layers/{i}/mlp/{name}": rank
                          for i in range(LAYERS) for name in ("down_proj", "gate_proj", "up_proj")}
    # Flax layout: kernels [in, out]; MLP kernels replaced by u [in, r], v [r, out] in the source dtype.
    gate = params["layers"][1]["mlp"]["gate_proj"]
    assert set(gate) == {"u", "v"} and gate["u"].shape == (HIDDEN, rank) and gate["u"].dtype == ml_dtypes.bfloat16
    want_u, want_v = truncated_svd(tensors["model.layers.1.mlp.gate_proj.weight"].T, rank)
    np.testing.assert_array_equal(gate["u"], want_u)
    np.testing.assert_array_equal(gate["v"], want_v)
    np.testing.assert_array_equal(params["layers"][0]["self_attn"]["q_proj"]["kernel"],
                                  tensors["model.layers.0.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(params["embed_tokens"]["embedding"], tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["norm"]["weight"], tensors["model.norm.weight"])
    np.testing.assert_array_equal(params["lm_head"]["kernel"], tensors["lm_head.weight"].T)
    with open(out / "compression_report.json") as f:
        report = json.load(f)
    assert [layer["rank"] for layer in report["layers"]] == [rank] * 6
    assert all(0 < layer["relative_error"] < 1 for layer in report["layers"])


def test_whitened_with_calibration_file(rng, tmp_path):
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    try:
        import compress_checkpoint
    finally:
        sys.path.pop(0)
    tensors = write_hf_checkpoint(rng, tmp_path / "hf")
    calibration = {}
    for layer in range(LAYERS):
        for name, width in (("gate_proj", HIDDEN), ("up_proj", HIDDEN), ("down_proj", INTERMEDIATE)):
            calibration[f"layers/{layer}/mlp/{name}"] = rng.standard_normal((300, width)) * np.logspace(0, -2, width)
    report = compress_checkpoint.compress_checkpoint(
        str(tmp_path / "hf"), str(tmp_path / "out"), rank=8, method="whitened", calibration=calibration,
        progress=False)
    assert report.method == "whitened" and all(layer.output_error is not None for layer in report.layers)
    params, info = load_compressed(tmp_path / "out" / "model.safetensors")
    kernel = tensors["model.layers.0.mlp.down_proj.weight"].T
    want_u, _ = whitened_svd(kernel, calibration["layers/0/mlp/down_proj"], 8)
    np.testing.assert_array_equal(params["layers"][0]["mlp"]["down_proj"]["u"], want_u)
    assert info.method == "whitened" and info.keep is None
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        compress_checkpoint.compress_checkpoint(str(tmp_path / "empty"), str(tmp_path / "o2"), keep=0.5)
