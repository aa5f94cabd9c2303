"""Load a local Hugging Face checkpoint directory into a Llama, Gemma or Qwen3 NNX model.

The directory holds config.json, the weights as one `model.safetensors` or several shards listed by
`model.safetensors.index.json`, and optionally tokenizer.json. Our modules are named like the HF ones, so one
naming table (`flax_keys`) maps each HF tensor name to our parameter path; PyTorch linear weights [out, in] are
transposed into our [in, out] kernels.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jax_neuronmm.compress.checkpoint import CheckpointError, fit_problems
from jax_neuronmm.models.decoder import CausalLM, eos_token_ids_of
from jax_neuronmm.models.gemma import Gemma, GemmaConfig
from jax_neuronmm.models.llama import Llama, LlamaConfig
from jax_neuronmm.models.qwen3 import Qwen3, Qwen3Config
from jax_neuronmm.models.validation import check_param_dtype

SUPPORTED_MODEL_TYPES = ("llama", "gemma", "gemma3_text", "gemma3", "qwen3")
# Prefixes under which a checkpoint may store the decoder ("model." for *ForCausalLM; the others are the text
# part of a multimodal Gemma 3 checkpoint, older and newer layouts).
_DECODER_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
_LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some checkpoints carry; we recompute it


def flax_keys(hf_name: str, ndim: int) -> tuple[tuple, bool]:
    """The HF <-> Flax naming table: (our parameter's key path, whether the tensor is a PyTorch linear weight
    [out, in] that we store transposed as kernel [in, out]) of the HF tensor `hf_name` (decoder prefix removed).

    "embed_tokens.weight" -> ("embed_tokens", "embedding"); any other 2-D "X.weight" -> (*X, "kernel"), transposed;
    everything else keeps its name ("norm.weight" -> ("norm", "weight")). Numeric parts become list indices.
    """
    *modules, leaf = (int(part) if part.isdigit() else part for part in hf_name.split("."))
    if leaf == "weight" and modules == ["embed_tokens"]:
        return ("embed_tokens", "embedding"), False
    if leaf == "weight" and ndim == 2:
        return (*modules, "kernel"), True
    return (*modules, leaf), False


def read_config(path: str) -> dict[str, Any]:
    """The parsed config.json of the checkpoint directory `path`.

    Raises FileNotFoundError (no directory / no config.json) or ValueError naming the file when it is not a JSON
    object.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"path: {path!r} is not a directory (expected a local HF checkpoint directory)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"path: {path!r} has no config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_path}: not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: got a JSON {type(config).__name__}, expected an object")
    return config


def model_from_config(
    hf_config: dict[str, Any], *, dtype=jnp.float32, rngs: nnx.Rngs | None = None, tokenizer=None
) -> CausalLM:
    """A randomly initialized model for an HF config dict (model_type llama, gemma, gemma3_text, gemma3 or qwen3), with
    the config's end-of-sequence ids and `tokenizer` (see CausalLM)."""
    model_type = hf_config.get("model_type")
    eos_token_ids = eos_token_ids_of(hf_config)
    if model_type == "gemma3":
        hf_config = hf_config.get("text_config") or {}
        hf_config = {"model_type": "gemma3_text", **hf_config}
        model_type = "gemma3_text"
    extras = dict(dtype=dtype, rngs=rngs, tokenizer=tokenizer, eos_token_ids=eos_token_ids)
    if model_type == "llama":
        return Llama(LlamaConfig.from_hf(hf_config), **extras)
    if model_type in ("gemma", "gemma3_text"):
        return Gemma(GemmaConfig.from_hf(hf_config), **extras)
    if model_type == "qwen3":
        return Qwen3(Qwen3Config.from_hf(hf_config), **extras)
    raise ValueError(f"model_type: got {model_type!r} in config.json, expected one of {SUPPORTED_MODEL_TYPES}")


def abstract_model(path: str, dtype) -> CausalLM:
    """The model (abstract: shapes only, under nnx.eval_shape) that path/config.json describes, with the
    directory's tokenizer. Raises ValueError naming config.json when a field is missing or malformed."""
    hf_config = read_config(path)
    tokenizer = load_tokenizer(path)
    try:
        return nnx.eval_shape(lambda: model_from_config(hf_config, dtype=dtype, rngs=nnx.Rngs(0), tokenizer=tokenizer))
    except KeyError as error:
        raise ValueError(f"{os.path.join(path, 'config.json')}: lacks the required field {error}") from error
    except (TypeError, ValueError) as error:
        raise ValueError(f"{os.path.join(path, 'config.json')}: {error}") from error


def load_tokenizer(path: str):
    """The `tokenizers.Tokenizer` of path/tokenizer.json, or None when there is none; ValueError naming the file
    when it cannot be read."""
    tokenizer_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        return None
    import tokenizers

    try:
        return tokenizers.Tokenizer.from_file(tokenizer_path)
    except Exception as error:  # tokenizers raises its own exception type for malformed files
        raise ValueError(f"{tokenizer_path}: not a readable tokenizers file ({error})") from error


def _weight_files(path: str) -> list[str]:
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as error:
            raise ValueError(f"{index_path}: expected JSON with a weight_map object ({error!r})") from error
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"path: {path!r} lacks shards listed in model.safetensors.index.json: {missing}")
        return [os.path.join(path, s) for s in shards]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"path: {path!r} has no *.safetensors weights (and no model.safetensors.index.json)")
    return [os.path.join(path, f) for f in files]


def _read_tensors(path: str, files: list[str], *, with_lm_head: bool) -> dict[tuple, np.ndarray]:
    """The decoder's tensors of the checkpoint, {our key path: array in our layout}, via the naming table."""
    with contextlib.ExitStack() as open_files:
        location = {}
        for file in files:
            try:
                handle = open_files.enter_context(safe_open(file, framework="numpy"))
                names = list(handle.keys())
            except Exception as error:  # safetensors' own error types for damaged headers
                raise CheckpointError(f"{file}: corrupt or not a safetensors file ({error})") from error
            location.update((name, (file, handle)) for name in names)
        prefix = next((p for p in _DECODER_PREFIXES if p + "embed_tokens.weight" in location), None)
        if prefix is None:
            raise CheckpointError(
                f"path: {path!r}: no embedding tensor found (looked for "
                f"{[p + 'embed_tokens.weight' for p in _DECODER_PREFIXES]})"
            )
        lm_head = next((n for n in _LM_HEAD_NAMES if n in location), None) if with_lm_head else None
        found, source = {}, {}
        for name in location:
            if name == lm_head:
                keys, transposed = ("lm_head", "kernel"), True
            elif name.startswith(prefix) and not name.endswith(_IGNORED_SUFFIXES):
                file, handle = location[name]
                keys, transposed = flax_keys(name[len(prefix) :], len(handle.get_slice(name).get_shape()))
            else:
                continue
            if keys in found:
                raise CheckpointError(
                    f"path: {path!r}: tensors {source[keys]!r} and {name!r} both map to {'/'.join(map(str, keys))}"
                )
            file, handle = location[name]
            try:
                array = handle.get_tensor(name)
            except Exception as error:  # a truncated file fails here, not at open
                raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({error})") from error
            found[keys], source[keys] = (array.T if transposed else array), name
    return found


def load_hf(path: str, dtype=jnp.float32) -> CausalLM:
    """Load the HF checkpoint directory `path` as a Llama, Gemma or Qwen3 model with parameters in `dtype`.

    Returns the model (`model(token_ids [B, T]) -> logits [B, T, vocab]`); `model.tokenizer` is a
    `tokenizers.Tokenizer` when the directory has tokenizer.json (else None) and `model.eos_token_ids` the
    config's end-of-sequence ids (a tuple, maybe empty). Raises TypeError for a `dtype` that is not a float
    parameter dtype (fp8 included: `quantize_model` makes fp8 weights), FileNotFoundError for missing files, ValueError
    naming the file for an unsupported model_type or a malformed config.json / tokenizer.json, and
    `jax_neuronmm.compress.CheckpointError` (a ValueError) naming the file for corrupt weights or tensors that are
    missing, unexpected or of the wrong shape.
    """
    check_param_dtype("load_hf", dtype)
    path = os.fspath(path)
    read_config(path)  # missing directory or config.json first
    files = _weight_files(path)
    graphdef, abstract_state = nnx.split(abstract_model(path, dtype))
    expected = dict(nnx.to_flat_state(abstract_state))
    found = _read_tensors(path, files, with_lm_head=("lm_head", "kernel") in expected)
    problems = fit_problems(expected, found, check_dtype=False)
    if problems:
        raise CheckpointError(f"checkpoint {path!r} does not fit its config.json: " + "; ".join(problems))
    loaded = [(keys, variable.replace(jnp.asarray(found[keys], dtype=dtype))) for keys, variable in expected.items()]
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))
