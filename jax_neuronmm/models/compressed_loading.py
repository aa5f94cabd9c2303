"""Load a compressed checkpoint directory (written by examples/compress_checkpoint.py) back into an NNX model.

The directory holds the HF config.json (and tokenizer files) next to `model.safetensors`, written by
`jax_neuronmm.compress.save_compressed` in Flax layout: dense kernels [in, out] under ".../kernel", each compressed
projection as u [in, r] and v [r, out] under its module path (e.g. layers/0/mlp/gate_proj/u). The ranks are read
from the u/v shapes, so no SVD runs: the model is built abstractly from config.json, each factored projection is
swapped for an `SVDLinear` at its saved rank (a gated MLP whose three projections are all factored becomes one
fused `SVDMLP`, as `compress_model` does), and the parameters are filled from the file.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx

from jax_neuronmm.compress import tree
from jax_neuronmm.compress.checkpoint import CheckpointError, fit_problems, load_compressed
from jax_neuronmm.models.compression import MLP_PROJECTIONS, fused_mlp_activation
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.hf_loading import attach_tokenizer_and_eos, model_from_config, read_config
from jax_neuronmm.models.layers import GatedMLP
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear

CHECKPOINT_FILE = "model.safetensors"
# Buffers some HF checkpoints carry that our models recompute (compress_checkpoint copies them through).
_IGNORED_SUFFIX = ("rotary_emb", "inv_freq")


def load_compressed_checkpoint(path, dtype=jnp.float32) -> CausalLM:
    """Load the output directory of examples/compress_checkpoint.py as a Llama or Gemma model in `dtype`.

    Returns the model (`model(token_ids [B, T]) -> logits [B, T, vocab]`) with the same module structure
    `compress_model` gives at the saved ranks; `model.tokenizer` and `model.eos_token_ids` are set as `load_hf`
    sets them. Raises FileNotFoundError when `path` is not a directory or lacks config.json / model.safetensors,
    `jax_neuronmm.compress.CheckpointError` (a ValueError) when model.safetensors was not written by
    save_compressed, is corrupt, or does not fit the model config.json describes.
    """
    path = os.fspath(path)
    hf_config = read_config(path)
    weights_path = os.path.join(path, CHECKPOINT_FILE)
    if not os.path.isfile(weights_path):
        raise FileNotFoundError(
            f"path: {path!r} has no {CHECKPOINT_FILE}; expected the output_dir of examples/compress_checkpoint.py"
        )
    params, _ = load_compressed(weights_path)
    tensors = {keys: array for keys, array in tree.iter_leaves(params) if keys[-2:] != _IGNORED_SUFFIX}
    ranks = {keys[:-1]: int(u.shape[-1]) for keys, u in tensors.items()
             if keys[-1] == "u" and keys[:-1] + ("v",) in tensors}

    def build():
        model = model_from_config(hf_config, dtype=dtype, rngs=nnx.Rngs(0))
        _factor_projections(model, ranks, weights_path)
        return model

    graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
    expected = dict(nnx.to_flat_state(abstract_state))
    problems = fit_problems(expected, tensors, check_dtype=False)
    if problems:
        raise CheckpointError(f"checkpoint {weights_path!r} does not fit {path}/config.json: " + "; ".join(problems))

    loaded = [(keys, variable.replace(jnp.asarray(tensors[keys], dtype=dtype))) for keys, variable in expected.items()]
    model = nnx.merge(graphdef, nnx.from_flat_state(loaded))
    attach_tokenizer_and_eos(model, path, hf_config)
    return model


def _factor_projections(model: CausalLM, ranks: dict[tuple, int], weights_path: str) -> None:
    """Swap each nnx.Linear named by a key of `ranks` for an SVDLinear of that rank; fuse fully factored MLPs."""
    rngs = nnx.Rngs(0)
    for keys, rank in ranks.items():
        parent = model
        for key in keys[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key, None)
        name = keys[-1]
        linear = getattr(parent, name, None) if isinstance(name, str) else None
        if not isinstance(linear, nnx.Linear):
            raise CheckpointError(
                f"checkpoint {weights_path!r} has factors u, v at {tree.join(keys)}, but the model built from "
                f"config.json has {type(linear).__name__} there, expected a dense projection (nnx.Linear)"
            )
        try:
            factored = SVDLinear(
                linear.in_features, linear.out_features, rank, use_bias=linear.bias is not None,
                dtype=linear.dtype, param_dtype=linear.param_dtype, precision=linear.precision,
                preferred_element_type=linear.preferred_element_type, rngs=rngs)
        except ValueError as error:
            raise CheckpointError(f"checkpoint {weights_path!r}: {tree.join(keys)}: {error}") from error
        setattr(parent, name, factored)

    for layer in model.layers:
        mlp = layer.mlp
        if not isinstance(mlp, GatedMLP):
            continue
        projections = [getattr(mlp, name) for name in MLP_PROJECTIONS]
        fused_activation = fused_mlp_activation(mlp)
        if fused_activation is None or not all(isinstance(p, SVDLinear) for p in projections):
            continue
        gate, up, down = projections
        fused = SVDMLP(
            gate.in_features, gate.out_features, (gate.rank, up.rank, down.rank), out_features=down.out_features,
            activation=fused_activation, dtype=gate.dtype, param_dtype=gate.param_dtype, precision=gate.precision,
            rngs=rngs)
        fused.gate_proj, fused.up_proj, fused.down_proj = projections
        layer.mlp = fused
