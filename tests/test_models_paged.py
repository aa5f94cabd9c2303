"""models.paged: the per-row step over a paged KV cache against float64 cache-free forwards on ragged rows
(different lengths, scattered blocks, a block shared by two rows' common prefix, a row that just crossed a block
boundary, block sizes 3 and 5), sliding windows, fp8 / factored / pruned projections, and per-row sampling; the
decode step as one decode_step (paged_decode) against it on XLA and on the emulator's looped kernel; the prefill
chunk without logits (paged_prefill)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_neuronmm
from jax_neuronmm.models import Gemma, GemmaConfig, Llama, LlamaConfig
from jax_neuronmm.models.decode import stack_weights
from jax_neuronmm.models.paged import (
    PagedBatch,
    PagedKVCache,
    RowSampling,
    paged_decode,
    paged_forward,
    paged_plan,
    paged_prefill,
)
from jax_neuronmm.models.paged import sample_rows as _sample_rows
from jax_neuronmm.pipeline import Recipe, compress_model, quantize_model

VOCAB = 97
_forward = nnx.jit(lambda model, ids: model(ids))
_paged = nnx.jit(paged_forward)
_paged_decode = nnx.jit(paged_decode, static_argnums=(1,))
sample_rows = jax.jit(_sample_rows)


def _randomize(model, seed):
    """Every parameter away from its init (norm weights too), so a misplaced key or position shows."""
    rng = np.random.default_rng(seed)
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        noise = rng.standard_normal(param.shape)
        scale = 0.3 if "norm" in "/".join(map(str, path)) else (0.08 if "embed" in str(path) else 0.15)
        base = param[...] if "norm" in "/".join(map(str, path)) else 0
        param.set_value(jnp.asarray(base + scale * noise, param.dtype))
    return model


def _model(name, dtype):
    if name == "llama":
        config = LlamaConfig.preset("tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=136, num_layers=2)
        return _randomize(Llama(config, dtype=dtype, rngs=nnx.Rngs(0)), seed=0)
    # Window 4: shorter than every row, so the sliding layers must drop keys the row still holds.
    config = GemmaConfig.preset(
        "gemma3-tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=136, sliding_window=4
    )
    return _randomize(Gemma(config, dtype=dtype, rngs=nnx.Rngs(3)), seed=3)


def _plan(rng, block_size, num_blocks):
    """Four rows' sequences and block tables: row 1 shares row 0's first block (same first block_size tokens),
    row 2 ends exactly on a block boundary before its decode token, row 3 is inactive; blocks scattered."""
    lengths = [11, 9, block_size * (10 // block_size), 0]
    seqs = [rng.integers(0, VOCAB, size=n + 1) for n in lengths]  # + the decode token
    seqs[1][:block_size] = seqs[0][:block_size]
    max_blocks = -(-(max(lengths) + 1) // block_size)
    ids = rng.permutation(num_blocks)
    table = np.zeros((4, max_blocks), np.int32)
    table[0] = ids[:max_blocks]
    table[1] = ids[max_blocks : 2 * max_blocks]
    table[1, 0] = table[0, 0]
    table[2] = ids[2 * max_blocks : 3 * max_blocks]
    table[3] = ids[:max_blocks]  # an inactive row may point anywhere: it must write nothing
    return seqs, table


def _calls(seqs, table, block_size):
    """_run's three calls as (token_ids [4, T], PagedBatch): prefill in two ragged chunks (row 1 starts after the
    shared block), then one decode step (one token per active row)."""
    n = [len(s) - 1 for s in seqs]
    calls = [  # (lengths before, counts) per row; -1 inactive
        ([0, -1, 0, -1], [8, 0, 7, 0], 8),
        ([8, block_size, 7, -1], [n[0] - 8, n[1] - block_size, n[2] - 7, 0], 8),
        ([n[0], n[1], n[2], -1], [1, 1, 1, 0], 1),
    ]
    for lengths, counts, width in calls:
        tokens = np.zeros((4, width), np.int32)
        for row, (start, count) in enumerate(zip(lengths, counts)):
            if start >= 0:
                tokens[row, :count] = seqs[row][start : start + count]
        yield jnp.asarray(tokens), PagedBatch(*(jnp.asarray(a, jnp.int32) for a in (table, lengths, counts)))


def _run(model, seqs, table, block_size, num_blocks, reference):
    """The three `_calls`; every call's logits against the cache-free forward of each active row's tokens so far.
    Returns the final cache."""
    cache = PagedKVCache.create(model, num_blocks, block_size)
    # Attention's softmax runs in float32 for every model dtype (decoder_math.attend), hence 1e-5 in float64.
    tolerance = dict(rtol=1e-5, atol=1e-6) if model.dtype == jnp.float64 else dict(rtol=2e-4, atol=2e-5)
    for tokens, batch in _calls(seqs, table, block_size):
        logits, cache = _paged(model, tokens, cache, batch)
        for row, (start, count) in enumerate(zip(batch.lengths.tolist(), batch.counts.tolist())):
            if start >= 0:
                want = reference(seqs[row][: start + count])
                np.testing.assert_allclose(np.asarray(logits[row]), want, **tolerance)
    return cache


@pytest.mark.parametrize("block_size", [3, 5])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_ragged_rows_match_the_float64_forward(name, block_size, rng, x64):
    model = _model(name, jnp.float64)
    num_blocks = 17
    seqs, table = _plan(rng, block_size, num_blocks)
    cache = _run(model, seqs, table, block_size, num_blocks, lambda s: np.asarray(_forward(model, s[None]))[0, -1])
    # No stray writes: blocks no active row owns are still zero (padding and the inactive row wrote nothing).
    used = set(table[:3].ravel().tolist())
    for block in set(range(num_blocks)) - used:
        assert not np.any(np.asarray(cache.k_pool[:, block])) and not np.any(np.asarray(cache.v_pool[:, block]))
    assert np.any(np.asarray(cache.k_pool[:, table[2, 2]]))  # the boundary-crossing token's new block


@pytest.mark.parametrize("form", ["fp8", "factored", "pruned"])
def test_compressed_and_fp8_models_match_their_own_forward(form, rng):
    dense = _model("gemma3", jnp.float32)
    if form == "fp8":
        model = quantize_model(dense, targets=("mlp", "attention"), progress=False)
    elif form == "factored":
        model = compress_model(
            dense, Recipe(keep=0.5, include=("mlp", "attention"), method="svd", block=8), progress=False
        )
    else:
        calibration = rng.integers(0, VOCAB, size=(2, 16))
        model = compress_model(dense, Recipe(keep=0.5, mlp_form="pruned"), calibration_ids=calibration, progress=False)
    seqs, table = _plan(rng, 5, 17)
    # The reference is the compressed model's own cache-free forward (same weights, same float32 math).
    _run(model, seqs, table, 5, 17, lambda s: np.asarray(_forward(model, s[None]))[0, -1])


@pytest.mark.parametrize("name", ["llama", "gemma3", "factored gemma3"])
def test_paged_decode_is_paged_forwards_decode_step_on_both_backends(name, rng):
    """The decode call of `_calls` (a shared prefix block, a row opening a new block, an inactive row; Gemma 3's
    4-token window; factors of per-layer ranks) as one decode_step: paged_forward's logits and pools on XLA and on
    the emulator's looped kernel, and bad shapes raise naming the argument."""
    model = _model("llama" if name == "llama" else "gemma3", jnp.float32)
    if name.startswith("factored"):
        model = compress_model(
            model, Recipe(keep=0.5, include=("mlp", "attention"), method="svd", block=8), progress=False
        )
    block_size, num_blocks = 5, 17
    seqs, table = _plan(rng, block_size, num_blocks)
    *prefill, (tokens, batch) = _calls(seqs, table, block_size)
    cache = PagedKVCache.create(model, num_blocks, block_size)
    for chunk, chunk_batch in prefill:
        cache = _paged(model, chunk, cache, chunk_batch)[1]
    want_logits, want = _paged(model, tokens, cache, batch)
    plan = paged_plan(model, block_size)
    weights = stack_weights(model, plan)
    for backend in ("xla", "emulator"):
        with jax_neuronmm.use_backend(backend):
            logits, got = _paged_decode(model, plan, weights, tokens, cache, batch.block_table, batch.lengths)
        np.testing.assert_allclose(np.asarray(logits)[:3], np.asarray(want_logits)[:3], rtol=2e-4, atol=2e-5)
        for pool, want_pool in ((got.k_pool, want.k_pool), (got.v_pool, want.v_pool)):
            np.testing.assert_allclose(np.asarray(pool), np.asarray(want_pool), rtol=2e-4, atol=2e-5)
    with pytest.raises(ValueError, match=r"token_ids: got shape \(4, 2\), expected \[B, 1\]"):
        paged_decode(model, plan, weights, jnp.zeros((4, 2), jnp.int32), cache, batch.block_table, batch.lengths)
    other = dataclasses.replace(plan, spec=plan.spec.replace(block_size=3))
    with pytest.raises(ValueError, match="plan: got block_size 3, expected the pools' 5"):
        paged_decode(model, other, weights, tokens, cache, batch.block_table, batch.lengths)


def test_paged_prefill_writes_what_paged_forward_writes_without_the_head(rng):
    """The prefill chunks of `_calls` through paged_prefill leave the pools paged_forward leaves, and its compiled
    step has no array of the vocabulary's width: the LM head (the logits nobody samples) is not computed."""
    model = _model("gemma3", jnp.float32)
    seqs, table = _plan(rng, 5, 17)
    graphdef, state = nnx.split(model)
    want = got = PagedKVCache.create(model, 17, 5)
    logits = f"f32[4,{VOCAB}]"  # [rows, vocab]: what the head computes
    for tokens, batch in list(_calls(seqs, table, 5))[:2]:
        assert logits in _paged.lower(model, tokens, want, batch).compile().as_text()
        want = _paged(model, tokens, want, batch)[1]
        hlo = jax.jit(paged_prefill, static_argnums=0).lower(graphdef, state, tokens, got, batch).compile().as_text()
        assert logits not in hlo
        got = paged_prefill(graphdef, state, tokens, got, batch)
    for pool, want_pool in ((got.k_pool, want.k_pool), (got.v_pool, want.v_pool)):
        np.testing.assert_allclose(np.asarray(pool), np.asarray(want_pool), rtol=1e-6, atol=1e-7)
    assert np.any(np.asarray(got.k_pool))


def _sampling(rows, temperature, top_k=0, top_p=1.0, seed=0, step=0):
    return RowSampling(
        temperature=jnp.full((rows,), temperature, jnp.float32),
        top_k=jnp.full((rows,), top_k, jnp.int32),
        top_p=jnp.full((rows,), top_p, jnp.float32),
        seeds=jnp.tile(jnp.asarray([[seed, 0]], jnp.uint32), (rows, 1)),
        steps=jnp.full((rows,), step, jnp.int32),
    )


def test_sample_rows_per_row_rules(rng):
    logits = jnp.asarray(rng.standard_normal((6, 50)) * 2, jnp.float32)
    greedy = np.asarray(logits).argmax(-1)
    np.testing.assert_array_equal(sample_rows(logits, _sampling(6, 0.0)), greedy)
    np.testing.assert_array_equal(sample_rows(logits, _sampling(6, 0.0)), greedy)
    np.testing.assert_array_equal(sample_rows(logits, _sampling(6, 1.0, top_k=1)), greedy)
    np.testing.assert_array_equal(sample_rows(logits, _sampling(6, 1.0, top_p=1e-6)), greedy)
    top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    for step in range(20):
        drawn = np.asarray(sample_rows(logits, _sampling(6, 5.0, top_k=3, step=step)))
        assert all(drawn[r] in top3[r] for r in range(6))
    # A row's draw depends on its seed, step and logits only: not on its companions or its row index.
    one = _sampling(6, 2.0, seed=7, step=3)
    a = np.asarray(sample_rows(logits, one))
    mixed = RowSampling(
        temperature=one.temperature.at[0].set(0.0), top_k=one.top_k, top_p=one.top_p, seeds=one.seeds, steps=one.steps
    )
    b = np.asarray(sample_rows(logits[::-1], mixed))
    np.testing.assert_array_equal(a[::-1][1:], b[1:])
    assert b[0] == greedy[::-1][0]
    draws = {int(sample_rows(logits, _sampling(6, 2.0, seed=s))[0]) for s in range(30)}
    assert len(draws) > 3, "different seeds should draw different tokens"
