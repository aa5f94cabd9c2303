"""Randomly initialized models of published shapes, for demos and benchmarks without a checkpoint."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.gemma import Gemma, GemmaConfig
from jax_neuronmm.models.llama import Llama, LlamaConfig

FAMILIES = ("llama", "gemma", "gemma3")
PRESETS = ("tiny", "1b")


def from_preset(family: str, preset: str, *, dtype=jnp.float32, seed: int = 0, **overrides) -> CausalLM:
    """A random-init model: family "llama" | "gemma" | "gemma3", preset "tiny" | "1b" (Llama-3.2-1B, Gemma-2B,
    Gemma-3-1B shapes). `overrides` replace config fields (e.g. num_layers=2, vocab_size=4096)."""
    if family not in FAMILIES:
        raise ValueError(f"family: got {family!r}, expected one of {FAMILIES}")
    if preset not in PRESETS:
        raise ValueError(f"preset: got {preset!r}, expected one of {PRESETS}")
    rngs = nnx.Rngs(seed)
    if family == "llama":
        return Llama(LlamaConfig.preset(preset, **overrides), dtype=dtype, rngs=rngs)
    return Gemma(GemmaConfig.preset(f"{family}-{preset}", **overrides), dtype=dtype, rngs=rngs)
