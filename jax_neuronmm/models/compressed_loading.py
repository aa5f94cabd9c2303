"""Compressed checkpoint directories: `compress_checkpoint` writes one from a local HF checkpoint,
`load_compressed_checkpoint` loads it back as an NNX model.

The directory holds the HF config.json (and tokenizer files) copied from the source, `compression_report.json`,
and `model.safetensors` written by `jax_neuronmm.compress.save_compressed` in our (Flax) layout (its metadata also
records the sha256 of each copied file, so an edited config.json or tokenizer fails to load rather than changing
the model's outputs; a checkpoint without those checksums is refused, and save_compressed's metadata checksum
keeps them from being stripped): the model's
`nnx.state` after `compress_model`, dense kernels [in, out] under ".../kernel", each compressed projection as
u [in, r] and v [r, out] under its module path (e.g. layers/0/mlp/gate_proj/u). HF names are translated once, by
`load_hf` (hf_loading.flax_keys). Loading reads the ranks from the u/v shapes, so no SVD runs: the model is built
abstractly from config.json, each factored projection is swapped for an `SVDLinear` at its saved rank (a gated MLP
whose three projections are all factored becomes one fused `SVDMLP`, as `compress_model` does), and the
parameters are filled from the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile

import jax.numpy as jnp
import numpy as np
import safetensors
from flax import nnx

from jax_neuronmm.compress import tree
from jax_neuronmm.compress.checkpoint import (
    FORMAT,
    FORMAT_V1,
    CheckpointError,
    fit_problems,
    load_compressed,
    save_compressed,
    write_atomically,
)
from jax_neuronmm.compress.params import CompressionReport, LayerReport
from jax_neuronmm.compress.projections import layer_projections
from jax_neuronmm.compress.prune import PrunedKernel
from jax_neuronmm.models import pruning
from jax_neuronmm.models.compression import (
    ALLOCATION_BLOCK,
    BLOCK,
    MLP_PROJECTIONS,
    RECOMMENDED_ALLOCATION_SOLVER,
    check_rank,
    compress_model,
    fused_mlp_activation,
    resolve_mlp_form,
    resolve_pipeline,
)
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.gguf_loading import load_gguf
from jax_neuronmm.models.hf_loading import abstract_model, load_hf, read_config
from jax_neuronmm.models.layers import GatedMLP
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
DEFAULT_KEEP = 0.8
# model.safetensors' user metadata key: JSON {copied file name: sha256 hex of its bytes}.
FILES_SHA256 = "files_sha256"
# model.safetensors' user metadata key of a checkpoint with pruned MLPs: JSON [[dense model's index of each neuron a
# layer's MLP kept], ...] one list per layer, so a loaded model's kernels are PrunedKernels that distillation trains.
PRUNED_NEURONS = "pruned_neurons"


def compress_checkpoint(
    src_dir,
    out_dir,
    *,
    keep: float | None = None,
    rank: int | str | None = None,
    method: str | None = None,
    steps=None,
    include=("mlp",),
    calibration_ids=None,
    distill_ids=None,
    block: int | None = None,
    dtype=jnp.float32,
    allow_dense: bool = True,
    allocation_solver: str = RECOMMENDED_ALLOCATION_SOLVER,
    mlp_form: str | None = None,
) -> CompressionReport:
    """Compress the HF checkpoint directory `src_dir` (see `load_hf`) into a new directory `out_dir`.

    keep / rank / method / steps / include / calibration_ids [B, T] / distill_ids / block / allow_dense /
    allocation_solver / mlp_form are `compress_model`'s (keep defaults to 0.8; give at most one of keep and rank).
    dtype: the parameter dtype the model is loaded, factored and saved in.
    Returns the per-layer `CompressionReport` (also written to out_dir/compression_report.json).

    Nothing the user has is replaced, and the output is checked before anything is compressed: see
    `check_output_dir` for the errors.
    """
    check_param_dtype("compress_checkpoint", dtype)
    src_dir, out_dir = os.fspath(src_dir), os.fspath(out_dir)
    if keep is not None and rank is not None:
        raise ValueError(f"keep, rank: got keep={keep!r} and rank={rank!r}, expected at most one")
    if keep is None and rank is None:
        keep = DEFAULT_KEEP
    copied = check_output_dir(src_dir, out_dir)
    # Read once: the copies are these bytes, and their checksums go into model.safetensors.
    contents = {}
    for name in copied:
        with open(os.path.join(src_dir, name), "rb") as f:
            contents[name] = f.read()

    # Shapes from config.json: a rank no projection can have fails before the weights are read.
    check_rank(abstract_model(src_dir, dtype), include, rank)
    dense = load_hf(src_dir, dtype=dtype)
    mlp_form = resolve_mlp_form(mlp_form, dense, method, calibration_ids, include, rank)
    method, steps = resolve_pipeline(method, steps, calibration_ids, rank)
    compressed = compress_model(
        dense,
        keep=keep,
        method=method,
        steps=steps,
        calibration_ids=calibration_ids,
        distill_ids=distill_ids,
        include=include,
        rank=rank,
        block=block,
        allow_dense=allow_dense,
        allocation_solver=allocation_solver,
        mlp_form=mlp_form,
    )
    report = _report(
        dense,
        compressed,
        (include,) if isinstance(include, str) else include,
        method="+".join((method, *steps)),
        keep=keep if rank is None else None,
        rank=rank if isinstance(rank, int) else None,
    )

    os.makedirs(out_dir, exist_ok=True)
    save_compressed(
        os.path.join(out_dir, CHECKPOINT_FILE),
        nnx.state(compressed),
        report=report,
        metadata={
            "source": os.path.abspath(src_dir),
            "include": ",".join((include,) if isinstance(include, str) else include),
            "block": str(block) if block is not None else f"{BLOCK} ({ALLOCATION_BLOCK} for allocated ranks)",
            "layout": "flax: kernel [in, out], u [in, r], v [r, out], y = x·u·v",
            FILES_SHA256: json.dumps({name: hashlib.sha256(data).hexdigest() for name, data in contents.items()}),
            **_pruned_neurons(compressed),
        },
    )
    write_atomically(
        os.path.join(out_dir, REPORT_FILE),
        lambda temporary: _write_json(temporary, report.to_dict()),
        overwrite=False,
    )
    for name, data in contents.items():
        write_atomically(
            os.path.join(out_dir, name), lambda temporary, data=data: _write_bytes(temporary, data), overwrite=False
        )
    return report


def _pruned_neurons(model: CausalLM) -> dict[str, str]:
    """{PRUNED_NEURONS: JSON of each layer's kept neurons} when `model`'s MLPs are pruned, else {}."""
    kernels = [getattr(layer.mlp, "gate_proj", None) for layer in model.layers]
    kernels = [getattr(linear, "kernel", None) for linear in kernels]
    if not all(isinstance(kernel, PrunedKernel) for kernel in kernels):
        return {}
    return {PRUNED_NEURONS: json.dumps([list(kernel.kept) for kernel in kernels])}


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)


def check_output_dir(src_dir, out_dir) -> list[str]:
    """Checks that `compress_checkpoint(src_dir, out_dir)` can write its output; returns the names it would copy.

    Raises FileNotFoundError / ValueError (read_config's) for a missing or malformed source config.json; ValueError
    for an empty out_dir; NotADirectoryError when out_dir, or a folder above it, is a file; FileExistsError naming
    the directory when out_dir is src_dir or already holds a file the output would write (model.safetensors,
    compression_report.json, the copied config / tokenizer files); PermissionError when out_dir (or, when it does
    not exist yet, the nearest folder above it) does not let this process create files. Writes nothing.
    """
    src_dir, out_dir = os.fspath(src_dir), os.fspath(out_dir)
    read_config(src_dir)  # a missing source fails before out_dir is looked at
    if not out_dir:
        raise ValueError("out_dir: got an empty path, expected a directory to write the compressed checkpoint into")
    copied = [name for name in COPIED_FILES if os.path.isfile(os.path.join(src_dir, name))]
    existing = os.path.abspath(out_dir)
    while not os.path.isdir(existing):
        if os.path.lexists(existing):
            raise NotADirectoryError(f"out_dir: {out_dir!r}: {existing!r} is a file, expected a directory")
        existing = os.path.dirname(existing)
    _check_output_files(src_dir, out_dir, [CHECKPOINT_FILE, REPORT_FILE, *copied])
    _check_writable(existing, out_dir)
    return copied


def _check_writable(directory: str, out_dir: str) -> None:
    """PermissionError unless a file can be created in `directory` (tried: permission bits do not tell for root,
    ACLs or read-only mounts)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise PermissionError(
            f"out_dir: {out_dir!r}: cannot create files in {directory!r} ({error.strerror or error}); "
            "choose a writable directory (nothing was written)"
        ) from error


def _check_output_files(src_dir: str, out_dir: str, outputs: list[str]) -> None:
    if os.path.isdir(out_dir) and os.path.samefile(src_dir, out_dir):
        raise FileExistsError(
            f"out_dir: {out_dir!r} is the source checkpoint directory; writing there would replace "
            "the original files. Choose a new directory (nothing was written)"
        )
    existing = [name for name in outputs if os.path.lexists(os.path.join(out_dir, name))]
    if existing:
        raise FileExistsError(
            f"out_dir: {out_dir!r} already holds {existing}, which the compressed checkpoint "
            "would replace. Choose a new or empty directory (nothing was written)"
        )


def _report(dense: CausalLM, compressed: CausalLM, include, *, method, keep, rank) -> CompressionReport:
    """Per projection `include` selects, in tree order: a factored one's shape, rank, parameter counts and
    ‖W − u·v‖_F / ‖W‖_F; one that rank allocation left dense, rank None and its parameters unchanged; a pruned MLP's
    projection, rank None, its kept parameters and ‖W − Ŵ‖_F / ‖W‖_F with Ŵ zero at the pruned neurons."""
    kernels = {keys[:-1]: variable for keys, variable in nnx.to_flat_state(nnx.state(dense)) if keys[-1] == "kernel"}
    selected = {
        ("layers", index, parent, name) for index, parent, name in layer_projections(len(dense.layers), include)
    }
    factors = dict(nnx.to_flat_state(nnx.state(compressed)))
    layers = []
    for keys, weight in factors.items():
        path = keys[:-1]
        if keys[-1] == "kernel" and path in selected:
            w = np.asarray(kernels[path][...], np.float64)
            if isinstance(weight, PrunedKernel):
                error = np.linalg.norm(w - pruning.embedded(weight, path[-1], dense.config.intermediate_size))
                layers.append(
                    LayerReport(tree.join(path), w.shape, None, w.size, weight.size, float(error / np.linalg.norm(w)))
                )
            else:
                layers.append(LayerReport(tree.join(path), w.shape, None, w.size, w.size, 0.0))
        if keys[-1] != "u":
            continue
        w = np.asarray(kernels[path][...], np.float64)
        approx = np.asarray(weight[...], np.float64) @ np.asarray(factors[path + ("v",)][...], np.float64)
        layers.append(
            LayerReport(
                path=tree.join(path),
                shape=w.shape,
                rank=int(weight.shape[-1]),
                params_before=w.size,
                params_after=int(weight.size + factors[path + ("v",)].size),
                relative_error=float(np.linalg.norm(w - approx) / np.linalg.norm(w)),
            )
        )
    return CompressionReport(method=method, keep=keep, rank=rank, layers=tuple(layers))


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
            f"path: {path!r} has no {CHECKPOINT_FILE}; expected a directory written by models.compress_checkpoint"
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
