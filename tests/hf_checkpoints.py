"""A small random Llama checkpoint in Hugging Face layout (PyTorch [out, in] weights, "model." prefix, a
WordLevel tokenizer whose words are w0 .. w96), for the loader and compressed-checkpoint tests."""

import json
import os

import numpy as np
import safetensors.numpy
from flax import nnx

from jax_neuronmm.models.hf_loading import model_from_config

HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 136,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": [5, 7],
    "max_position_embeddings": 64,
}


def write_hf_checkpoint(rng, directory, config=HF_CONFIG):
    """Writes config.json, model.safetensors and tokenizer.json of a random model of `config` into `directory`."""
    import tokenizers

    abstract = nnx.eval_shape(lambda: model_from_config(config, rngs=nnx.Rngs(0)))
    tensors = {}
    for path, variable in nnx.to_flat_state(nnx.state(abstract)):
        *modules, leaf = (str(key) for key in path)
        if leaf == "kernel":  # [in, out] in our layout
            weight = rng.standard_normal(variable.shape) / np.sqrt(variable.shape[0])
            name, array = ".".join(modules) + ".weight", weight.T
        elif leaf == "embedding":
            name, array = ".".join(modules) + ".weight", rng.standard_normal(variable.shape)
        else:  # norm weights: away from 1 so a misplaced norm shows
            name, array = ".".join(modules) + "." + leaf, 1 + 0.3 * rng.standard_normal(variable.shape)
        tensors[name if name.startswith("lm_head.") else "model." + name] = np.ascontiguousarray(array, np.float32)
    os.makedirs(directory)
    safetensors.numpy.save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    return tensors
