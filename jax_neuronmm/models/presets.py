"""Randomly initialized models of published shapes, for demos and benchmarks without a checkpoint."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.gemma import Gemma, GemmaConfig
from jax_neuronmm.models.llama import Llama, LlamaConfig
from jax_neuronmm.models.qwen3 import Qwen3, Qwen3Config

# family -> its presets: "tiny" (tests, demos) and the published shapes (Llama-3.2-1B and 3.1-8B, Gemma 1 2B,
# Gemma 3 270M and 1B, Qwen3-0.6B).
FAMILY_PRESETS = {
    "llama": ("tiny", "1b", "8b"),
    "gemma": ("tiny", "2b"),
    "gemma3": ("tiny", "270m", "1b"),
    "qwen3": ("tiny", "0.6b"),
}
# Published models by name -> (family, preset, where the preset's shapes come from).
PUBLISHED = {
    "Gemma 3 270M": ("gemma3", "270m", "google/gemma-3-270m config.json"),
    "Gemma 3 1B": ("gemma3", "1b", "google/gemma-3-1b-pt config.json"),
    "Gemma 2B": ("gemma", "2b", "google/gemma-2b config.json"),
    "Llama-3.2-1B": ("llama", "1b", "meta-llama/Llama-3.2-1B config.json"),
    "Llama-3.1-8B": ("llama", "8b", "meta-llama/Llama-3.1-8B config.json"),
    "Qwen3-0.6B": ("qwen3", "0.6b", "Qwen/Qwen3-0.6B config.json"),
}
FAMILIES = tuple(FAMILY_PRESETS)
PRESETS = tuple(dict.fromkeys(name for names in FAMILY_PRESETS.values() for name in names))  # every preset name


def from_preset(family: str, preset: str, *, dtype=jnp.float32, seed: int = 0, **overrides) -> CausalLM:
    """A random-init model of `family` ("llama" | "gemma" | "gemma3" | "qwen3") with the shape `preset` names (see
    FAMILY_PRESETS). `overrides` replace config fields (e.g. num_layers=2, vocab_size=4096)."""
    if family not in FAMILIES:
        raise ValueError(f"family: got {family!r}, expected one of {FAMILIES}")
    if preset not in FAMILY_PRESETS[family]:
        raise ValueError(f"preset: got {preset!r}, expected one of {FAMILY_PRESETS[family]} for family {family!r}")
    rngs = nnx.Rngs(seed)
    if family == "llama":
        return Llama(LlamaConfig.preset(preset, **overrides), dtype=dtype, rngs=rngs)
    if family == "qwen3":
        return Qwen3(Qwen3Config.preset(preset, **overrides), dtype=dtype, rngs=rngs)
    return Gemma(GemmaConfig.preset(f"{family}-{preset}", **overrides), dtype=dtype, rngs=rngs)
