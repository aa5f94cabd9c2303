"""Llama / Gemma / Gemma 3 against transformers' PyTorch models built from tiny random configs.

Every parameter of the reference model is randomized (Gemma's norm weights would otherwise start at zero, hiding
a missing "1 +"), the model is saved with save_pretrained and loaded with load_hf; fp32 prefill logits must agree
within 1e-4 and greedy decoding must pick the same tokens.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jax_neuronmm.models import Gemma, Llama, generate, load_hf

_logits = nnx.jit(lambda model, ids: model(ids))

SEQ_LEN = 11
DECODE_STEPS = 14
# The shape every reference config shares; each family adds its layer count, kv heads and own features.
SHAPE = dict(
    vocab_size=203,
    hidden_size=64,
    intermediate_size=136,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=64,
)


def _llama_config(tie: bool) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        **SHAPE,
        num_hidden_layers=3,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        attention_bias=not tie,
        mlp_bias=not tie,
        # A short original context makes the llama3 smoothing touch every frequency band at these lengths.
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    )


def _gemma_config() -> transformers.GemmaConfig:
    return transformers.GemmaConfig(
        **SHAPE,
        num_hidden_layers=2,
        num_key_value_heads=1,
        hidden_act="gelu_pytorch_tanh",
    )


def _gemma3_config() -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(
        **SHAPE,
        num_hidden_layers=3,
        num_key_value_heads=2,
        query_pre_attn_scalar=24,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=3.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )


CASES = {
    "llama_tied": (transformers.LlamaForCausalLM, lambda: _llama_config(tie=True), Llama),
    "llama_untied_bias": (transformers.LlamaForCausalLM, lambda: _llama_config(tie=False), Llama),
    "gemma": (transformers.GemmaForCausalLM, _gemma_config, Gemma),
    "gemma3_text": (transformers.Gemma3ForCausalLM, _gemma3_config, Gemma),
}


def _randomized_reference(model_cls, config, seed: int):
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                # Gemma norms multiply by (1 + w) and start at 0, Llama's multiply by w and start at 1.
                param.copy_(param + 0.3 * noise)
            else:
                # Layer weights large enough that the residual stream is not just the (scaled) embedding, which
                # would make greedy decoding repeat one token and prove little.
                param.copy_((0.08 if "embed" in name else 0.15) * noise)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    model_cls, make_config, our_cls = CASES[request.param]
    reference = _randomized_reference(model_cls, make_config(), seed=len(request.param))
    path = str(tmp_path_factory.mktemp(request.param))
    reference.save_pretrained(path, safe_serialization=True)
    return request.param, reference, path, load_hf(path, dtype=jnp.float32)


def _prompt(batch: int, length: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, length))


def test_prefill_logits_match_transformers(checkpoint):
    name, reference, _, model = checkpoint
    assert isinstance(model, CASES[name][2])
    ids = _prompt(2, SEQ_LEN, reference.config.vocab_size, seed=1)
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)).logits.double().numpy()
    got = np.asarray(_logits(model, jnp.asarray(ids)), np.float64)
    assert got.shape == expected.shape == (2, SEQ_LEN, reference.config.vocab_size)
    assert np.std(expected) > 0.05, "reference logits are degenerate; the comparison would prove little"
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0, err_msg=name)


def test_greedy_decode_matches_transformers(checkpoint):
    name, reference, _, model = checkpoint
    ids = _prompt(1, 7, reference.config.vocab_size, seed=2)
    with torch.no_grad():
        expected = reference.generate(
            torch.from_numpy(ids),
            max_new_tokens=DECODE_STEPS,
            min_new_tokens=DECODE_STEPS,
            do_sample=False,
            pad_token_id=0,
        ).numpy()
    got = np.asarray(generate(model, ids, DECODE_STEPS))
    assert expected.shape == (1, 7 + DECODE_STEPS)
    assert len(set(expected[0, 7:].tolist())) > 1, "reference continuation is constant; pick another seed"
    np.testing.assert_array_equal(got, expected, err_msg=name)


# bf16 loading is the same code for every family; checked on the richest one.
@pytest.mark.parametrize("checkpoint", ["gemma3_text"], indirect=True)
def test_bfloat16_load_is_close(checkpoint):
    name, reference, path, _ = checkpoint
    model = load_hf(path, dtype=jnp.bfloat16)
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    ids = _prompt(1, SEQ_LEN, reference.config.vocab_size, seed=3)
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)).logits.double().numpy()
    got = np.asarray(_logits(model, jnp.asarray(ids)).astype(jnp.float32), np.float64)
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() < 0.1 * scale, name


def test_sharded_checkpoint_with_tokenizer(tmp_path):
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    reference = _randomized_reference(transformers.LlamaForCausalLM, _llama_config(tie=False), seed=5)
    reference.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    with open(tmp_path / "model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) > 2

    sample = os.path.join(os.path.dirname(__file__), "..", "examples", "data", "sample.txt")
    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=reference.config.vocab_size, special_tokens=["[UNK]"])
    tokenizer.train([sample], trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    model = load_hf(str(tmp_path))
    assert model.tokenizer is not None
    ids = np.array([model.tokenizer.encode("We hold these truths to be self-evident").ids])
    assert ids.shape[1] > 5 and ids.max() < reference.config.vocab_size
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(_logits(model, jnp.asarray(ids))), expected, atol=1e-4, rtol=0)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_hf(str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf(str(tmp_path))

    reference = _randomized_reference(transformers.LlamaForCausalLM, _llama_config(tie=True), seed=6)
    reference.save_pretrained(str(tmp_path), safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(ValueError, match="model_type.*mamba"):
        load_hf(str(tmp_path))
    # One more layer in config.json than in the weights: the missing tensors are named.
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match=r"missing tensors \[.layers/3/"):
        load_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    with pytest.raises(ValueError, match="shape"):
        load_hf(str(tmp_path))
