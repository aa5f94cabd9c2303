"""generate(): KV-cached decoding equals recomputing the full forward, padding, sampling, eos, no retracing."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_neuronmm.models import Gemma, GemmaConfig, Llama, LlamaConfig, generate
from jax_neuronmm.models.generation import TRACE_COUNTS

VOCAB = 97
_forward = nnx.jit(lambda model, ids: model(ids))


def _randomize(model, seed):
    """Scale every parameter up from the init (std 0.02 keeps the residual stream equal to the embedding, and
    greedy decoding would just repeat a token); norm weights get noise around their identity value."""
    rng = np.random.default_rng(seed)
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        noise = rng.standard_normal(param.shape).astype(np.float32)
        if "norm" in "/".join(map(str, path)):
            param.set_value(param[...] + 0.3 * noise)
        else:
            param.set_value(jnp.asarray((0.08 if "embed" in str(path) else 0.15) * noise))
    return model


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig.preset("tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=136, num_layers=2)
    return _randomize(Llama(config, rngs=nnx.Rngs(0)), seed=0)


@pytest.fixture(scope="module")
def gemma3():
    # Window 4 < the sequence lengths below, so the sliding layers must drop old keys from the cache.
    config = GemmaConfig.preset(
        "gemma3-tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=136, sliding_window=4
    )
    return _randomize(Gemma(config, rngs=nnx.Rngs(3)), seed=3)


def _full_forward_argmax(model, ids: np.ndarray) -> np.ndarray:
    """argmax of the cache-free forward at every position [B, T] (what greedy decoding must have chosen next)."""
    return np.asarray(_forward(model, jnp.asarray(ids))).argmax(-1)


def _prompts(batch, length, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, length))


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_cached_greedy_equals_full_recompute(name, request):
    model = request.getfixturevalue(name)
    prompt = _prompts(2, 6, seed=2)
    got = np.asarray(generate(model, prompt, 12))
    np.testing.assert_array_equal(got[:, :6], prompt)
    # Each new token is the argmax of a cache-free forward over everything before it (teacher forcing).
    np.testing.assert_array_equal(got[:, 6:], _full_forward_argmax(model, got)[:, 5:-1])
    assert len(set(got[:, 6:].ravel().tolist())) > 4, "degenerate continuation proves little"


def test_decode_step_compiles_once(llama):
    prompt = _prompts(1, 5, seed=3)
    before = dict(TRACE_COUNTS)
    generate(llama, prompt, 13)
    traced = {k: TRACE_COUNTS[k] - before.get(k, 0) for k in ("prefill", "decode")}
    assert traced == {"prefill": 1, "decode": 1}
    # Same shapes, other tokens: nothing is traced again.
    before = dict(TRACE_COUNTS)
    generate(llama, _prompts(1, 5, seed=4), 13)
    assert TRACE_COUNTS["prefill"] == before["prefill"] and TRACE_COUNTS["decode"] == before["decode"]


def test_left_and_right_padding_match_unpadded_rows(gemma3):
    # Gemma 3: its sliding-window layers make positions and key validity matter most (the code is shared).
    model = gemma3
    short, long = _prompts(1, 4, seed=5)[0], _prompts(1, 7, seed=6)[0]
    steps = 8
    alone = [np.asarray(generate(model, p[None], steps))[0, -steps:] for p in (short, long)]
    pad = VOCAB - 1

    left = np.stack([np.r_[[pad] * 3, short], long])
    left_mask = np.stack([np.r_[[False] * 3, [True] * 4], [True] * 7])
    got_left = np.asarray(generate(model, left, steps, pad_mask=left_mask))
    right = np.stack([np.r_[short, [pad] * 3], long])
    got_right = np.asarray(generate(model, right, steps, lengths=[4, 7]))
    for got in (got_left, got_right):
        np.testing.assert_array_equal(got[:, :7], left if got is got_left else right)
        np.testing.assert_array_equal(got[0, -steps:], alone[0])
        np.testing.assert_array_equal(got[1, -steps:], alone[1])


def test_sampling(llama):
    prompt = _prompts(2, 5, seed=7)
    greedy = np.asarray(generate(llama, prompt, 8))
    sampled = np.asarray(generate(llama, prompt, 8, temperature=1.5, seed=1))
    assert (sampled == np.asarray(generate(llama, prompt, 8, temperature=1.5, seed=1))).all()
    assert (sampled != np.asarray(generate(llama, prompt, 8, temperature=1.5, seed=2))).any()
    assert (sampled != greedy).any()
    # Restricting to the single most likely token is greedy decoding, whatever the temperature.
    np.testing.assert_array_equal(generate(llama, prompt, 8, temperature=2.0, top_k=1, seed=3), greedy)
    np.testing.assert_array_equal(generate(llama, prompt, 8, temperature=2.0, top_p=1e-6, seed=3), greedy)


def test_eos_stops_and_fills(llama):
    prompt = _prompts(2, 5, seed=8)
    greedy = np.asarray(generate(llama, prompt, 10))
    eos = int(greedy[0, 7])  # row 0 emits it at its third new token
    got = np.asarray(generate(llama, prompt, 10, eos_id=eos))
    row0_first = 5 + list(greedy[0, 5:]).index(eos)
    assert (got[0, row0_first:] == eos).all()
    np.testing.assert_array_equal(got[0, :row0_first], greedy[0, :row0_first])
    # Both rows finish immediately when eos is each row's first token.
    both = np.asarray(generate(llama, prompt[:1].repeat(2, 0), 10, eos_id=int(greedy[0, 5])))
    assert both.shape == (2, 6)
    # Several end tokens: each row stops at whichever of them it emits first; finished rows get the first id.
    other = next(t for t in range(llama.config.vocab_size) if t not in greedy[:, 5:])
    multi = np.asarray(generate(llama, prompt, 10, eos_id=[other, eos]))
    assert (multi[0, row0_first + 1 :] == other).all() and multi[0, row0_first] == eos
    np.testing.assert_array_equal(multi[0, :row0_first], greedy[0, :row0_first])
    with pytest.raises(ValueError, match="eos_id"):
        generate(llama, prompt, 3, eos_id=[])


def test_bad_arguments(llama):
    prompt = _prompts(1, 4, seed=9)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(llama, prompt, 0)
    with pytest.raises(ValueError, match="token_ids"):
        generate(llama, prompt[0], 3)
    with pytest.raises(ValueError, match="pad_mask"):
        generate(llama, prompt, 3, pad_mask=np.ones((1, 3), bool))
    with pytest.raises(ValueError, match="lengths"):
        generate(llama, prompt, 3, lengths=[5])
    with pytest.raises(ValueError, match="top_p"):
        generate(llama, prompt, 3, temperature=1.0, top_p=0.0)
    with pytest.raises(TypeError, match="model"):
        generate(object(), prompt, 3)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(token_ids=np.zeros((0, 4), np.int32)), ValueError, r"token_ids: got shape \(0, 4\), a batch of 0"),
        (dict(token_ids=[[1, 2, 3], [4, 5]]), ValueError, r"token_ids: rows have different lengths"),
        (
            dict(token_ids=np.array([np.array([1, 2]), np.array([3])], dtype=object)),
            ValueError,
            r"token_ids: rows have different lengths \[2, 1\]",
        ),
        (dict(top_k=2.5), TypeError, r"top_k: got 2\.5 \(float\), expected None or an integer in 1\.\.97"),
        (dict(top_k=True), TypeError, r"top_k: got True \(bool\)"),
        (dict(temperature="0.5"), TypeError, r"temperature: got '0\.5' \(str\), expected a finite number >= 0"),
        (dict(top_p="0.9"), TypeError, r"top_p: got '0\.9' \(str\)"),
        (dict(max_new_tokens=None), TypeError, r"max_new_tokens: got None \(NoneType\), expected an integer >= 1"),
        (dict(max_new_tokens=2.5), TypeError, r"max_new_tokens: got 2\.5 \(float\)"),
        (
            dict(seed=2**70),
            ValueError,
            r"seed: got 1180591620717411303424, expected an integer in \[-9223372036854775808",
        ),
        (dict(seed="1"), TypeError, r"seed: got '1' \(str\)"),
    ],
)
def test_bad_argument_types_and_shapes_name_the_argument(llama, kwargs, error, match):
    args = dict(token_ids=_prompts(2, 4, seed=9), max_new_tokens=3, temperature=0.7)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        generate(llama, args.pop("token_ids"), args.pop("max_new_tokens"), **args)


def test_scalar_arrays_are_accepted_as_numbers(llama):
    prompt = _prompts(2, 4, seed=9)
    want = np.asarray(generate(llama, prompt, 3, temperature=0.7, top_k=5, seed=3))
    got = generate(llama, prompt, np.int64(3), temperature=jnp.float32(0.7), top_k=np.int32(5), seed=jnp.int32(3))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_logits_at_picks_one_column_per_row(llama):
    prompt = _prompts(3, 6, seed=11)
    full = np.asarray(llama(jnp.asarray(prompt)))
    columns = np.array([5, 0, 3])
    picked = np.asarray(llama(jnp.asarray(prompt), logits_at=columns))
    assert picked.shape == (3, 1, full.shape[-1])
    np.testing.assert_allclose(picked[:, 0], full[np.arange(3), columns], rtol=1e-5, atol=1e-5)


def test_out_of_range_token_ids_are_rejected(llama):
    vocab = llama.config.vocab_size
    prompt = _prompts(1, 3, seed=12)
    # Used to return the prompt followed by zeros (vocab) or to embed the last row (-1).
    for bad in (vocab, -1, vocab + 1000):
        ids = prompt.copy()
        ids[0, 1] = bad
        with pytest.raises(
            ValueError,
            match=rf"token_ids: token id {bad} is outside the vocabulary range "
            rf"\[0, {vocab}\)",
        ):
            generate(llama, ids, 3)
        with pytest.raises(ValueError, match=rf"token_ids: token id {bad} is outside"):
            llama(jnp.asarray(ids))  # the public model call, eager
    assert np.asarray(generate(llama, prompt, 2)).shape == (1, 5)


def test_context_length_and_temperature_are_checked(llama):
    context = llama.config.max_position_embeddings
    assert context == 512
    prompt = _prompts(1, 10, seed=13)
    with pytest.raises(ValueError, match=r"10 prompt tokens \+ 503 new tokens exceed the model's context of 512"):
        generate(llama, prompt, context - 9)
    for temperature in (float("nan"), float("inf"), -0.5):
        with pytest.raises(ValueError, match="temperature: got .*, expected a finite number >= 0"):
            generate(llama, prompt, 3, temperature=temperature)
    with pytest.raises(ValueError, match="top_p"):
        generate(llama, prompt, 3, temperature=1.0, top_p=float("nan"))
