"""compress_checkpoint: compresses a Hugging Face checkpoint directory into a new directory that
`jax_neuronmm.models.load_compressed_checkpoint` loads (the format: models/compressed_loading.py).

The output is checked before anything is compressed (`check_output_dir`), every file is written atomically, and no
file the user has is replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_neuronmm.compress import tree
from jax_neuronmm.compress.checkpoint import save_compressed, write_atomically
from jax_neuronmm.compress.params import CompressionReport, LayerReport
from jax_neuronmm.compress.projections import layer_projections
from jax_neuronmm.compress.prune import PrunedKernel
from jax_neuronmm.models.compressed_loading import (
    CHECKPOINT_FILE,
    COPIED_FILES,
    FILES_SHA256,
    PRUNED_NEURONS,
    REPORT_FILE,
)
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.hf_loading import abstract_model, load_hf, read_config
from jax_neuronmm.models.validation import check_param_dtype
from jax_neuronmm.pipeline import pruning
from jax_neuronmm.pipeline.compression import check_rank, compress_model, resolve
from jax_neuronmm.pipeline.recipe import ALLOCATION_BLOCK, BLOCK, Recipe


def compress_checkpoint(
    src_dir, out_dir, recipe: Recipe = Recipe(), *, calibration_ids=None, distill_ids=None, dtype=jnp.float32
) -> CompressionReport:
    """Compress the HF checkpoint directory `src_dir` (see `load_hf`) into a new directory `out_dir`.

    recipe / calibration_ids [B, T] / distill_ids are `compress_model`'s; the choices the recipe leaves open are
    made once, before compressing, and the report names them. The weights are saved in float (recipe.weight_dtype
    must be None: quantize a loaded model with `quantize_model`). dtype: the parameter dtype the model is loaded,
    compressed and saved in. Returns the per-layer `CompressionReport` (also written to
    out_dir/compression_report.json).

    Nothing the user has is replaced, and the output is checked before anything is compressed: see
    `check_output_dir` for the errors.
    """
    check_param_dtype("compress_checkpoint", dtype)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe: got {type(recipe).__name__}, expected a jax_neuronmm.pipeline.Recipe")
    if recipe.weight_dtype is not None:
        raise ValueError(
            f"recipe.weight_dtype: got {recipe.weight_dtype!r}, expected None: compressed checkpoints hold float "
            "weights (quantize the loaded model with pipeline.quantize_model)"
        )
    src_dir, out_dir = os.fspath(src_dir), os.fspath(out_dir)
    copied = check_output_dir(src_dir, out_dir)
    # Read once: the copies are these bytes, and their checksums go into model.safetensors.
    contents = {}
    for name in copied:
        with open(os.path.join(src_dir, name), "rb") as f:
            contents[name] = f.read()

    # Shapes from config.json: a rank no projection can have fails before the weights are read.
    check_rank(abstract_model(src_dir, dtype), recipe.include, recipe.rank)
    dense = load_hf(src_dir, dtype=dtype)
    plan = resolve(recipe, dense, calibration_ids)
    compressed = compress_model(dense, plan, calibration_ids=calibration_ids, distill_ids=distill_ids)
    report = _report(
        dense,
        compressed,
        plan.include,
        method="+".join((plan.method, *plan.steps)),
        keep=plan.target_keep,
        rank=plan.rank if isinstance(plan.rank, int) else None,
    )

    os.makedirs(out_dir, exist_ok=True)
    save_compressed(
        os.path.join(out_dir, CHECKPOINT_FILE),
        nnx.state(compressed),
        report=report,
        metadata={
            "source": os.path.abspath(src_dir),
            "include": ",".join(plan.include),
            "block": str(plan.block) if plan.block is not None else f"{BLOCK} ({ALLOCATION_BLOCK} for allocated ranks)",
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
