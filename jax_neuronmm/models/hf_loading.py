"""Load a local Hugging Face checkpoint directory into a Llama or Gemma NNX model.

The directory holds config.json, the weights as one `model.safetensors` or several shards listed by
`model.safetensors.index.json`, and optionally tokenizer.json. Our modules are named like the HF ones, so the HF
tensor name of each parameter follows from its path; PyTorch linear weights [out, in] are transposed into our
[in, out] kernels.
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

from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.gemma import Gemma, GemmaConfig
from jax_neuronmm.models.llama import Llama, LlamaConfig

SUPPORTED_MODEL_TYPES = ("llama", "gemma", "gemma3_text", "gemma3")
# Prefixes under which a checkpoint may store the decoder ("model." for *ForCausalLM; the others are the text
# part of a multimodal Gemma 3 checkpoint, older and newer layouts).
_DECODER_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
_LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(path: str) -> dict[str, Any]:
    """The parsed config.json of the checkpoint directory `path`."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"path: {path!r} is not a directory (expected a local HF checkpoint directory)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"path: {path!r} has no config.json")
    with open(config_path, encoding="utf-8") as f:
        return json.load(f)


def model_from_config(hf_config: dict[str, Any], *, dtype=jnp.float32, rngs: nnx.Rngs | None = None) -> CausalLM:
    """A randomly initialized model for an HF config dict (model_type llama, gemma, gemma3_text or gemma3)."""
    model_type = hf_config.get("model_type")
    if model_type == "gemma3":
        hf_config = hf_config.get("text_config") or {}
        hf_config = {"model_type": "gemma3_text", **hf_config}
        model_type = "gemma3_text"
    if model_type == "llama":
        return Llama(LlamaConfig.from_hf(hf_config), dtype=dtype, rngs=rngs)
    if model_type in ("gemma", "gemma3_text"):
        return Gemma(GemmaConfig.from_hf(hf_config), dtype=dtype, rngs=rngs)
    raise ValueError(f"model_type: got {model_type!r} in config.json, expected one of {SUPPORTED_MODEL_TYPES}")


def _weight_files(path: str) -> list[str]:
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"path: {path!r} lacks shards listed in model.safetensors.index.json: {missing}")
        return [os.path.join(path, s) for s in shards]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"path: {path!r} has no *.safetensors weights (and no model.safetensors.index.json)")
    return [os.path.join(path, f) for f in files]


def _hf_name(param_path: tuple) -> tuple[str, bool]:
    """(HF tensor name without the decoder prefix, whether it is a transposed linear kernel) of our parameter."""
    *modules, leaf = (str(p) for p in param_path)
    if modules == ["embed_tokens"] and leaf == "embedding":
        return "embed_tokens.weight", False
    if modules == ["lm_head"]:
        return "lm_head.weight", True
    if leaf == "kernel":
        return ".".join(modules) + ".weight", True
    return ".".join(modules) + "." + leaf, False


def load_hf(path: str, dtype=jnp.float32) -> CausalLM:
    """Load the HF checkpoint directory `path` as a Llama or Gemma model with parameters in `dtype`.

    Returns the model (`model(token_ids [B, T]) -> logits [B, T, vocab]`); `model.tokenizer` is a
    `tokenizers.Tokenizer` when the directory has tokenizer.json (else None) and `model.eos_token_ids` the
    config's end-of-sequence ids (a tuple, maybe empty). Raises FileNotFoundError for missing files, ValueError for
    an unsupported model_type, missing tensors or tensors of the wrong shape.
    """
    hf_config = read_config(path)
    files = _weight_files(path)
    abstract = nnx.eval_shape(lambda: model_from_config(hf_config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)

    with contextlib.ExitStack() as open_files:
        handles = [open_files.enter_context(safe_open(f, framework="numpy")) for f in files]
        location = {name: handle for handle in handles for name in handle.keys()}
        prefix = next((p for p in _DECODER_PREFIXES if p + "embed_tokens.weight" in location), None)
        if prefix is None:
            raise ValueError(
                f"path: {path!r}: no embedding tensor found (looked for "
                f"{[p + 'embed_tokens.weight' for p in _DECODER_PREFIXES]})"
            )

        used, missing, loaded = set(), [], []
        for param_path, variable in nnx.to_flat_state(abstract_state):
            name, transposed = _hf_name(param_path)
            candidates = _LM_HEAD_NAMES if name == "lm_head.weight" else (prefix + name,)
            full_name = next((c for c in candidates if c in location), None)
            if full_name is None:
                missing.append(candidates[0])
                continue
            array = location[full_name].get_tensor(full_name)
            if transposed:
                array = array.T
            if array.shape != variable.shape:
                raise ValueError(
                    f"tensor {full_name!r}: got shape {array.shape} (after transpose: {transposed}), "
                    f"expected {variable.shape} from config.json"
                )
            used.add(full_name)
            loaded.append((param_path, variable.replace(jnp.asarray(np.asarray(array), dtype=dtype))))
        if missing:
            raise ValueError(f"path: {path!r}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
        unexpected = [
            n for n in location
            if n.startswith(prefix) and n not in used and not n.endswith(_IGNORED_SUFFIXES)
        ]
        if unexpected:
            raise ValueError(f"path: {path!r}: checkpoint has tensors the model does not use, e.g. {unexpected[:5]}")

    model = nnx.merge(graphdef, nnx.from_flat_state(loaded))
    attach_tokenizer_and_eos(model, path, hf_config)
    return model


def attach_tokenizer_and_eos(model: CausalLM, path: str, hf_config: dict[str, Any]) -> None:
    """Sets model.tokenizer (from path/tokenizer.json, else None) and model.eos_token_ids (a tuple, maybe empty)."""
    model.tokenizer = _load_tokenizer(path)
    eos = hf_config.get("eos_token_id", hf_config.get("text_config", {}).get("eos_token_id"))
    model.eos_token_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def _load_tokenizer(path: str):
    tokenizer_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        return None
    import tokenizers

    return tokenizers.Tokenizer.from_file(tokenizer_path)
