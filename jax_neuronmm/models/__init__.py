"""Llama, Gemma and Qwen3 causal LMs in Flax NNX: HF and GGUF checkpoint loading (compressed checkpoint directories
too: load_compressed_checkpoint), KV-cached generation, perplexity, and where the real GGUF checkpoints are installed
(real_model_path). How a model gets compressed is `jax_neuronmm.pipeline`, which imports this package."""

from jax_neuronmm.models.compressed_loading import is_compressed_checkpoint, load_checkpoint, load_compressed_checkpoint
from jax_neuronmm.models.decoder import CausalLM, KVCache
from jax_neuronmm.models.evaluation import perplexity
from jax_neuronmm.models.gemma import Gemma, GemmaConfig
from jax_neuronmm.models.generation import generate
from jax_neuronmm.models.gguf_loading import load_gguf
from jax_neuronmm.models.hf_loading import load_hf, load_tokenizer, model_from_config
from jax_neuronmm.models.layers import GatedMLP, RopeConfig
from jax_neuronmm.models.llama import Llama, LlamaConfig
from jax_neuronmm.models.presets import from_preset
from jax_neuronmm.models.qwen3 import Qwen3, Qwen3Config
from jax_neuronmm.models.real_models import real_model_path, real_model_paths

__all__ = [
    "CausalLM",
    "Gemma",
    "GemmaConfig",
    "GatedMLP",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "Qwen3",
    "Qwen3Config",
    "RopeConfig",
    "from_preset",
    "generate",
    "is_compressed_checkpoint",
    "load_checkpoint",
    "load_compressed_checkpoint",
    "load_gguf",
    "load_hf",
    "load_tokenizer",
    "model_from_config",
    "perplexity",
    "real_model_path",
    "real_model_paths",
]
