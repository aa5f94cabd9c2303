"""Compress the MLP projections of a local Hugging Face safetensors checkpoint into SVD factors.

Reads <checkpoint_dir>/*.safetensors (one file, or the shards of model.safetensors.index.json), converts the
PyTorch layout into the Flax one used by `jax_neuronmm.models` (each 2-D `X.weight` [out, in] becomes `X/kernel`
[in, out]; `embed_tokens.weight` becomes `embed_tokens/embedding`; other tensors keep their names; `--strip_prefix`
is removed, numeric name parts become list indices), replaces every kernel matching `--include` by `u` [in, r] and
`v` [r, out] with `compress_params`, and writes

  <output_dir>/model.safetensors          all parameters, names "/"-joined (e.g. layers/0/mlp/gate_proj/u), with
                                          method / keep / ranks / per-tensor sha256 in the header (`load_compressed`)
  <output_dir>/compression_report.json    the per-layer report (rank, params before/after, relative error)
  config.json and tokenizer files         copied unchanged

    python examples/compress_checkpoint.py --checkpoint_dir ~/llama --output_dir /tmp/llama-svd --keep 0.5
    python examples/compress_checkpoint.py ... --method whitened --calibration acts.safetensors

For --method whitened, --calibration is a safetensors file mapping each layer path (e.g. layers/0/mlp/gate_proj,
after the prefix is stripped) to the activations [n, in_features] that layer sees. All tensors are held in host
memory while compressing.

Load the result (Llama / Gemma config.json, default --strip_prefix) as a model with SVD-factored projections at the
saved ranks, without running any SVD again:

    from jax_neuronmm.models import generate, load_compressed_checkpoint
    model = load_compressed_checkpoint("/tmp/llama-svd")   # dtype=jnp.bfloat16 for bf16 parameters
    tokens = generate(model, prompt_ids, 32, eos_id=model.eos_token_ids)
"""

import json
import os
import shutil

import numpy as np
from absl import app, flags
from safetensors import safe_open

from jax_neuronmm.compress import DEFAULT_INCLUDE, compress_params, save_compressed

flags.DEFINE_string("checkpoint_dir", None, "Local HF checkpoint directory (config.json + *.safetensors).")
flags.DEFINE_string("output_dir", None, "Directory to write the compressed checkpoint into (created if absent).")
flags.DEFINE_float("keep", 0.5, "Fraction of each compressed kernel's parameters to keep, in (0, 1].")
flags.DEFINE_integer("rank", None, "One rank for every compressed kernel (instead of --keep).")
flags.DEFINE_enum("method", "svd", ["svd", "whitened"], "Plain truncated SVD or SVD-LLM whitened SVD.")
flags.DEFINE_string("include", DEFAULT_INCLUDE, "Regex searched in each kernel's path (default: MLP projections).")
flags.DEFINE_string("calibration", None, "For --method whitened: safetensors file {layer path: activations [n, K]}.")
flags.DEFINE_integer("block", 128, "Rank alignment used with --keep.")
flags.DEFINE_string("strip_prefix", "model.", "Prefix removed from tensor names (HF *ForCausalLM's decoder prefix).")
flags.DEFINE_bool("progress", True, "Show a progress bar.")
FLAGS = flags.FLAGS

COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model")


def weight_files(checkpoint_dir: str) -> list[str]:
    """The safetensors files of a checkpoint directory: the shards of the index, else every *.safetensors."""
    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(name for name in os.listdir(checkpoint_dir) if name.endswith(".safetensors"))
    files = [os.path.join(checkpoint_dir, name) for name in names]
    missing = [path for path in files if not os.path.isfile(path)]
    if not files or missing:
        raise FileNotFoundError(f"checkpoint_dir {checkpoint_dir!r} has no safetensors weights (missing: {missing})")
    return files


def flax_keys(name: str, array: np.ndarray, strip_prefix: str) -> tuple[tuple, np.ndarray]:
    """(Flax key path, array in Flax layout) of one HF tensor."""
    if strip_prefix and name.startswith(strip_prefix):
        name = name[len(strip_prefix):]
    *modules, leaf = (int(part) if part.isdigit() else part for part in name.split("."))
    if leaf == "weight" and modules and modules[-1] == "embed_tokens":
        return (*modules, "embedding"), array
    if leaf == "weight" and array.ndim == 2:
        return (*modules, "kernel"), np.ascontiguousarray(array.T)
    return (*modules, leaf), array


def read_checkpoint(checkpoint_dir: str, strip_prefix: str) -> dict:
    """All tensors of the checkpoint as a nested dict in Flax layout."""
    params: dict = {}
    for path in weight_files(checkpoint_dir):
        with safe_open(path, framework="numpy") as reader:
            for name in reader.keys():
                keys, array = flax_keys(name, reader.get_tensor(name), strip_prefix)
                node = params
                for key in keys[:-1]:
                    node = node.setdefault(key, {})
                if keys[-1] in node:
                    raise ValueError(f"tensor {name!r} maps to {'/'.join(map(str, keys))}, which is already taken")
                node[keys[-1]] = array
    return params


def read_calibration(path: str) -> dict[str, np.ndarray]:
    with safe_open(path, framework="numpy") as reader:
        return {name: reader.get_tensor(name) for name in reader.keys()}


def compress_checkpoint(checkpoint_dir, output_dir, *, keep=None, rank=None, method="svd", include=DEFAULT_INCLUDE,
                        calibration=None, block=128, strip_prefix="model.", progress=True):
    """Compress `checkpoint_dir` into `output_dir` (see the module docstring); returns the CompressionReport."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"checkpoint_dir {checkpoint_dir!r} is not a directory")
    params = read_checkpoint(checkpoint_dir, strip_prefix)
    compressed, report = compress_params(params, keep=keep, rank=rank, method=method, include=include,
                                         calibration=calibration, block=block, progress=progress)
    os.makedirs(output_dir, exist_ok=True)
    save_compressed(os.path.join(output_dir, "model.safetensors"), compressed, report=report, metadata={
        "source": os.path.abspath(checkpoint_dir), "include": include, "strip_prefix": strip_prefix,
        "block": str(block), "layout": "flax: kernel [in, out], u [in, r], v [r, out], y = x·u·v",
    })
    report_path = os.path.join(output_dir, "compression_report.json")
    with open(report_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=1)
    os.replace(report_path + ".tmp", report_path)
    for name in COPIED_FILES:
        if os.path.isfile(os.path.join(checkpoint_dir, name)):
            shutil.copyfile(os.path.join(checkpoint_dir, name), os.path.join(output_dir, name))
    return report


def main(argv):
    del argv
    if FLAGS.method == "whitened" and FLAGS.calibration is None:
        raise app.UsageError("--method whitened needs --calibration")
    calibration = read_calibration(FLAGS.calibration) if FLAGS.calibration else None
    report = compress_checkpoint(
        FLAGS.checkpoint_dir, FLAGS.output_dir, keep=None if FLAGS.rank is not None else FLAGS.keep, rank=FLAGS.rank,
        method=FLAGS.method, include=FLAGS.include, calibration=calibration, block=FLAGS.block,
        strip_prefix=FLAGS.strip_prefix, progress=FLAGS.progress)
    print(report)
    print(f"wrote {os.path.join(FLAGS.output_dir, 'model.safetensors')}")


if __name__ == "__main__":
    flags.mark_flags_as_required(["checkpoint_dir", "output_dir"])
    app.run(main)
