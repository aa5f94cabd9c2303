"""Compressed checkpoint directories: `load_compressed_checkpoint` loads one (written by
`jax_neuronmm.pipeline.compress_checkpoint`) as an NNX model; `load_checkpoint` loads whichever kind `path` holds.

The directory holds the HF config.json (and tokenizer files) copied from the source, `compression_report.json`,
and `model.safetensors` written by `jax_neuronmm.compress.save_compressed` in our (Flax) layout: the compressed
model's `nnx.state`, dense kernels [in, out] under ".../kernel", each factored projection as u [in, r] and v [r, out]
under its module path (e.g. layers/0/mlp/gate_proj/u). Its metadata records the sha256 of each copied file, so an
edited config.json or tokenizer fails to load rather than changing the model's outputs, and a checkpoint without
those checksums is refused. Loading reads the ranks from the u/v shapes, so no SVD runs: the model is built
abstractly from config.json, each factored projection is swapped for an `SVDLinear` at its saved rank (a gated MLP
whose three projections are all factored becomes one fused `SVDMLP`, as compression makes it), and the parameters
are filled from the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax.numpy as jnp
import safetensors
from flax import nnx

from jax_neuronmm.compress import tree
from jax_neuronmm.compress.checkpoint import FORMAT, FORMAT_V1, CheckpointError, fit_problems, load_compressed
from jax_neuronmm.compress.projections import MLP_PROJECTIONS
from jax_neuronmm.compress.prune import PrunedKernel
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.gguf_loading import load_gguf
from jax_neuronmm.models.hf_loading import abstract_model, load_hf, read_config
from jax_neuronmm.models.layers import GatedMLP, fused_mlp_activation
from jax_neuronmm.models.validation import check_param_dtype
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear

CHECKPOINT_FILE = "model.safetensors"
REPORT_FILE = "compression_report.json"
# Copied unchanged from the source directory when present.
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
# model.safetensors' user metadata key: JSON {copied file name: sha256 hex of its bytes}.
FILES_SHA256 = "files_sha256"
# model.safetensors' user metadata key of a checkpoint with pruned MLPs: JSON [[dense model's index of each neuron a
# layer's MLP kept], ...] one list per layer, so a loaded model's kernels are PrunedKernels that distillation trains.
PRUNED_NEURONS = "pruned_neurons"


def is_compressed_checkpoint(path) -> bool:
    """Whether the directory `path` holds a model.safetensors written by `save_compressed` (read from its header)."""
    weights_path = os.path.join(os.fspath(path), CHECKPOINT_FILE)
    if not os.path.isfile(weights_path):
        return False
    try:
        with safetensors.safe_open(weights_path, framework="numpy") as reader:
            return (reader.metadata() or {}).get("format") in (FORMAT, FORMAT_V1)
    except Exception:  # unreadable: not ours; the loader reports what is wrong
        return False


def load_checkpoint(path, dtype=jnp.float32) -> CausalLM:
    """The model at `path`: a GGUF file (`load_gguf`), a compressed checkpoint directory
    (`load_compressed_checkpoint`) or a Hugging Face checkpoint directory (`load_hf`), in `dtype`. Raises
    FileNotFoundError when nothing is at `path`, and the loader's errors otherwise."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return load_gguf(path, dtype=dtype)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"path: {path!r} does not exist (expected a GGUF file, a compressed checkpoint directory or a Hugging "
            "Face checkpoint directory)"
        )
    if is_compressed_checkpoint(path):
        return load_compressed_checkpoint(path, dtype=dtype)
    return load_hf(os.fspath(path), dtype=dtype)


def load_compressed_checkpoint(path, dtype=jnp.float32) -> CausalLM:
    """Load a directory written by `compress_checkpoint` as a Llama or Gemma model in `dtype`.

    Returns the model (`model(token_ids [B, T]) -> logits [B, T, vocab]`) with the same module structure
    `compress_model` gives at the saved ranks, with the tokenizer and end-of-sequence ids `load_hf` gives. Raises
    FileNotFoundError when `path` is not a directory or lacks config.json / model.safetensors, ValueError naming
    the file for a malformed config.json or tokenizer.json, `jax_neuronmm.compress.CheckpointError` (a
    ValueError) naming the file when model.safetensors was not written by save_compressed, is corrupt, or does not
    fit the model config.json describes, or when config.json or a tokenizer file differs from the one the
    checkpoint was written with (checksums recorded in model.safetensors). A `dtype` that is not a float parameter
    dtype (fp8 included: `quantize_model` makes fp8 weights) is a TypeError.
    """
    check_param_dtype("load_compressed_checkpoint", dtype)
    path = os.fspath(path)
    read_config(path)
    weights_path = os.path.join(path, CHECKPOINT_FILE)
    if not os.path.isfile(weights_path):
        raise FileNotFoundError(
            f"path: {path!r} has no {CHECKPOINT_FILE}; expected a directory written by pipeline.compress_checkpoint"
        )
    params, info = load_compressed(weights_path)
    tensors = dict(tree.iter_leaves(params))
    ranks = {
        keys[:-1]: int(u.shape[-1]) for keys, u in tensors.items() if keys[-1] == "u" and keys[:-1] + ("v",) in tensors
    }

    model = abstract_model(path, dtype)
    _narrow_pruned_mlps(model, tensors, weights_path, info.user)
    _factor_projections(model, ranks, weights_path)
    graphdef, abstract_state = nnx.split(model)
    expected = dict(nnx.to_flat_state(abstract_state))
    problems = fit_problems(expected, tensors, check_dtype=False)
    if problems:
        raise CheckpointError(f"checkpoint {weights_path!r} does not fit {path}/config.json: " + "; ".join(problems))
    # Last, so that a config.json that does not describe these tensors at all gets the more specific error above.
    _verify_copied_files(path, weights_path, info.user)
    loaded = [(keys, variable.replace(jnp.asarray(tensors[keys], dtype=dtype))) for keys, variable in expected.items()]
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _verify_copied_files(path: str, weights_path: str, user: dict) -> None:
    """Raises CheckpointError naming the file when a copied file differs from the checksum model.safetensors
    records, when a config / tokenizer file is there that it records no checksum of, or when it records none:
    integrity fails closed, so a checkpoint without its checksums (stripped, or written before compress_checkpoint
    recorded them) is refused rather than trusted."""
    if FILES_SHA256 not in user:
        raise CheckpointError(
            f"checkpoint {weights_path!r} records no checksums of config.json and the tokenizer files (metadata "
            f"{FILES_SHA256!r}); refusing to load files it cannot verify. Re-create it with compress_checkpoint"
        )
    try:
        recorded = json.loads(user[FILES_SHA256])
    except json.JSONDecodeError as error:
        raise CheckpointError(f"checkpoint {weights_path!r} has damaged metadata {FILES_SHA256!r} ({error})") from error
    if not isinstance(recorded, dict) or "config.json" not in recorded:
        raise CheckpointError(
            f"checkpoint {weights_path!r} has damaged metadata {FILES_SHA256!r}: expected {{file name: sha256}} "
            "naming config.json"
        )
    unrecorded = [name for name in COPIED_FILES if name not in recorded and os.path.lexists(os.path.join(path, name))]
    if unrecorded:
        raise CheckpointError(
            f"{os.path.join(path, unrecorded[0])}: not one of the files {weights_path!r} was written with (it "
            f"records checksums of {sorted(recorded)}); remove it, or re-create the checkpoint with compress_checkpoint"
        )
    for name, digest in recorded.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(
                f"{file}: missing; {weights_path!r} records its checksum (it belongs to the checkpoint)"
            )
        with open(file, "rb") as f:
            found = hashlib.sha256(f.read()).hexdigest()
        if found != digest:
            raise CheckpointError(
                f"{file}: checksum mismatch: the file differs from the one the checkpoint was written with "
                f"(sha256 {found}, expected {digest} as {CHECKPOINT_FILE} records); restore it"
            )


def _narrow_pruned_mlps(model: CausalLM, tensors: dict, weights_path: str, user: dict) -> None:
    """Where the checkpoint's MLP kernels are narrower than config.json's intermediate_size (MLPs whose neurons
    compress_model pruned), every layer's dense MLP rebuilt at that width with PrunedKernels that record the kept
    neurons (user metadata PRUNED_NEURONS), and the model's config saying so."""
    widths = {
        keys[1]: int(value.shape[-1])
        for keys, value in tensors.items()
        if len(keys) == 5 and keys[2:] == ("mlp", "gate_proj", "kernel") and value.ndim == 2
    }
    intermediate = model.config.intermediate_size
    if not widths or set(widths.values()) == {intermediate}:
        return
    if len(set(widths.values())) != 1 or len(widths) != len(model.layers):
        raise CheckpointError(
            f"checkpoint {weights_path!r}: MLP widths {sorted(widths.items())} differ between layers; pruned MLPs "
            "keep one width in every layer"
        )
    width = next(iter(widths.values()))
    kept = _kept_neurons(user, len(model.layers), width, intermediate, weights_path)
    for layer, layer_kept in zip(model.layers, kept):
        mlp = layer.mlp
        for name in MLP_PROJECTIONS:
            linear = getattr(mlp, name)
            shape = (linear.in_features, width) if name != "down_proj" else (width, linear.out_features)
            narrow = nnx.eval_shape(
                lambda shape=shape, linear=linear: nnx.Linear(
                    *shape, use_bias=False, dtype=linear.dtype, param_dtype=linear.param_dtype, rngs=nnx.Rngs(0)
                )
            )
            narrow.kernel = PrunedKernel(narrow.kernel.get_value(), kept=layer_kept)
            setattr(mlp, name, narrow)
    model.config = dataclasses.replace(model.config, intermediate_size=width)


def _kept_neurons(user: dict, layers: int, width: int, intermediate: int, weights_path: str) -> list[tuple]:
    """Each layer's kept neuron indices from the user metadata PRUNED_NEURONS, checked against the kernels' width."""
    if PRUNED_NEURONS not in user:
        raise CheckpointError(
            f"checkpoint {weights_path!r}: its MLPs are {width} wide where config.json says {intermediate}, but its "
            f"metadata has no {PRUNED_NEURONS!r} saying which neurons they kept (not written by compress_checkpoint?)"
        )
    try:
        kept = [tuple(int(i) for i in indices) for indices in json.loads(user[PRUNED_NEURONS])]
    except (json.JSONDecodeError, TypeError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint {weights_path!r} has damaged metadata {PRUNED_NEURONS!r} ({error})"
        ) from error
    for indices in kept:
        if (
            len(indices) != width
            or list(indices) != sorted(set(indices))
            or not 0 <= indices[0]
            or indices[-1] >= intermediate
        ):
            raise CheckpointError(
                f"checkpoint {weights_path!r}: metadata {PRUNED_NEURONS!r} does not list {width} distinct sorted "
                f"neuron indices in [0, {intermediate}) for every layer"
            )
    if len(kept) != layers:
        raise CheckpointError(
            f"checkpoint {weights_path!r}: metadata {PRUNED_NEURONS!r} lists {len(kept)} layers, the model has {layers}"
        )
    return kept


def _factor_projections(model: CausalLM, ranks: dict[tuple, int], weights_path: str) -> None:
    """Swap each nnx.Linear named by a key of `ranks` for an SVDLinear of that rank; fuse fully factored MLPs."""
    dense_kernels = {keys[:-1] for keys, _ in nnx.to_flat_state(nnx.state(model)) if keys[-1] == "kernel"}
    for keys, rank in ranks.items():
        if keys not in dense_kernels:
            raise CheckpointError(
                f"checkpoint {weights_path!r} has factors u, v at {tree.join(keys)}, but the model config.json "
                "describes has no dense projection there (does config.json belong to this checkpoint?)"
            )
        parent = model
        for key in keys[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        linear = getattr(parent, keys[-1])
        try:
            factored = nnx.eval_shape(lambda linear=linear, rank=rank: SVDLinear.like(linear, rank))
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"checkpoint {weights_path!r}: {tree.join(keys)}: {error}") from error
        setattr(parent, keys[-1], factored)

    for layer in model.layers:
        mlp = layer.mlp
        if not isinstance(mlp, GatedMLP):
            continue
        projections = [getattr(mlp, name) for name in MLP_PROJECTIONS]
        fused_activation = fused_mlp_activation(mlp)
        if fused_activation is not None and all(isinstance(p, SVDLinear) for p in projections):
            layer.mlp = SVDMLP.from_projections(*projections, activation=fused_activation)
