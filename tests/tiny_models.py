"""Small random models shared by the compression and quantization tests (a helper module, not a test file): a
2-layer Llama and a Gemma 3 with non-zero norm weights, both with a 211-token vocabulary, and jitted logits."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_neuronmm.models import Gemma, GemmaConfig, Llama, LlamaConfig

logits = nnx.jit(lambda model, ids: model(ids))

VOCAB = 211


def llama(seed=0):
    config = LlamaConfig.preset("tiny", vocab_size=VOCAB, hidden_size=96, intermediate_size=200, num_layers=2)
    return Llama(config, rngs=nnx.Rngs(seed))


def gemma3(seed=0):
    config = GemmaConfig.preset("gemma3-tiny", vocab_size=VOCAB, hidden_size=96, intermediate_size=200)
    model = Gemma(config, rngs=nnx.Rngs(seed))
    # Non-zero norm weights so a (1 + w) slip would show.
    rng = np.random.default_rng(seed)
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "norm" in "/".join(map(str, path)):
            param.set_value(jnp.asarray(0.3 * rng.standard_normal(param.shape), jnp.float32))
    return model


def token_ids(batch, tokens, seed):
    """Random token ids [batch, tokens] in the models' vocabulary, the same for the same seed."""
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, size=(batch, tokens)))
