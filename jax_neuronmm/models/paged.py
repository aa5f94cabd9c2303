"""A paged KV cache and the per-row model step over it (XLA), for continuous batching.

K and V live in pools [L, num_blocks, block_size, kv_heads, head_dim] shared by all rows; row b's i-th block of
tokens is `block_table[b, i]`, `lengths[b]` tokens of it are cached before a call (-1: an inactive row, nothing
written, its output ignored) and the call's `counts[b]` real tokens go to positions lengths[b] .. lengths[b] +
counts[b] - 1 (their RoPE positions too). One call serves both prefill (T tokens, a prompt chunk per row) and
decode (T = 1), each row at its own position; there is no per-row loop: the writes are one scatter per pool and
pool after the last layer (every layer reads the pools as they were, its own new tokens merged into its view), the
reads one gather per layer through the table. The layers are the model's own modules (`decoder_math.PagedKV` is
the only new path in the attention), so fp8, factored and pruned projections and sliding windows work unchanged.

`paged_prefill` is the jitted step the serving engine runs for a prefill chunk: forward and write, no logits.
`paged_step` is its decode step for a model `models.decode` does not cover (and on XLA): forward, then each row's next
token under its own sampling (greedy rows take the argmax, as `generate` does). `paged_decode_step` is the decode step
(T = 1 for every row) of a covered model as one `decode_step` over the same pools (`paged_plan`: the model's DecodePlan
with the pools' block_size), so on the emulator and Trainium it is one looped kernel launch, each row at its own
position reading K/V through its block table.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_neuronmm.decode_step import decode_step
from jax_neuronmm.decoder_math import PagedKV
from jax_neuronmm.models import decode
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.layers import attention_mask
from nki_kernels.decode.contract import PROJECTIONS

TRACE_COUNTS: collections.Counter = collections.Counter()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """k_pool, v_pool [L, num_blocks, block_size, kv_heads, head_dim] in the cache dtype; no block is reserved."""

    k_pool: jax.Array
    v_pool: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.k_pool.shape[1]

    @property
    def block_size(self) -> int:
        return self.k_pool.shape[2]

    @classmethod
    def create(cls, model: CausalLM, num_blocks: int, block_size: int, dtype=None) -> PagedKVCache:
        """Zeroed pools for `model` (every layer needs the same kv heads and head_dim), in `dtype` (default the
        model's)."""
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: got {value!r}, expected an integer >= 1")
        specs = model.attention_specs()
        if len({(spec.num_kv_heads, spec.head_dim) for spec in specs}) != 1:
            raise ValueError("model: every layer needs the same kv heads and head_dim for one paged KV pool")
        shape = (len(specs), num_blocks, block_size, specs[0].num_kv_heads, specs[0].head_dim)
        dtype = model.dtype if dtype is None else jnp.dtype(dtype)
        return cls(k_pool=jnp.zeros(shape, dtype), v_pool=jnp.zeros(shape, dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedBatch:
    """Where each row's tokens are: block_table [B, max_blocks] int32, lengths [B] int32 (tokens cached before
    this call, -1 inactive), counts [B] int32 (this call's real tokens: the first counts[b] columns)."""

    block_table: jax.Array
    lengths: jax.Array
    counts: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSampling:
    """Each row's sampling: temperature [B] float32 (0: greedy), top_k [B] int32 (0: off), top_p [B] float32
    (1: off), seeds [B, 2] uint32 (a request's 64-bit seed) and steps [B] int32 (the index of the token drawn,
    so a request's draws depend on its seed and position only, never on what shares the batch)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    steps: jax.Array


def _check_shapes(token_ids, cache: PagedKVCache, batch: PagedBatch) -> None:
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids: got shape {token_ids.shape}, expected [B, T]")
    rows = token_ids.shape[0]
    expected = {"block_table": 2, "lengths": 1, "counts": 1}
    for name, ndim in expected.items():
        array = getattr(batch, name)
        if array.ndim != ndim or array.shape[0] != rows or not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name}: got {array.dtype} {array.shape}, expected int with {ndim} dims and B={rows}")
    if cache.k_pool.shape != cache.v_pool.shape or cache.k_pool.ndim != 5:
        raise ValueError(f"k_pool, v_pool: got {cache.k_pool.shape} and {cache.v_pool.shape}, expected one 5-d shape")


def paged_forward(model: CausalLM, token_ids, cache: PagedKVCache, batch: PagedBatch):
    """Runs token_ids [B, T] through `model` over the paged cache; returns (logits [B, vocab] at each row's last
    real token, the updated cache). Token t of row b sits at position lengths[b] + t; it attends to the row's
    positions 0 .. its own (a sliding-window layer to the last `window` of them)."""
    logits, written = paged_read(model, token_ids, cache, batch)
    return logits, write_pools(cache, written)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NewKV:
    """A call's new keys and values [L, B·T, kv_heads, head_dim] and their (block, offset) [B·T] in the pools
    (block num_blocks: not written)."""

    keys: jax.Array
    values: jax.Array
    blocks: jax.Array
    offsets: jax.Array


def write_pools(cache: PagedKVCache, new: NewKV) -> PagedKVCache:
    """The cache with `new` written: one scatter per pool (in place when the cache is donated and nothing else
    reads it in the same computation, which is why it is a step of its own)."""
    pools = [
        pool.at[:, new.blocks, new.offsets].set(values, mode="drop")
        for pool, values in ((cache.k_pool, new.keys), (cache.v_pool, new.values))
    ]
    return PagedKVCache(k_pool=pools[0], v_pool=pools[1])


def paged_read(model: CausalLM, token_ids, cache: PagedKVCache, batch: PagedBatch):
    """`paged_forward` without the write: (logits [B, vocab], NewKV); the pools are only read."""
    _check_shapes(token_ids, cache, batch)
    rows, tokens = token_ids.shape
    block_size, num_blocks = cache.block_size, cache.num_blocks
    table = batch.block_table.astype(jnp.int32)
    max_blocks = table.shape[1]
    active = batch.lengths >= 0
    start = jnp.maximum(batch.lengths, 0).astype(jnp.int32)
    counts = jnp.where(active, batch.counts, 0).astype(jnp.int32)
    columns = jnp.arange(tokens, dtype=jnp.int32)
    positions = start[:, None] + columns
    real = columns[None, :] < counts[:, None]
    block_of = jnp.take_along_axis(table, jnp.clip(positions // block_size, 0, max_blocks - 1), axis=1)
    write_slots = jnp.where(real, block_of * block_size + positions % block_size, num_blocks * block_size)
    write_columns = jnp.where(real, positions, max_blocks * block_size)
    key_positions = jnp.broadcast_to(
        jnp.arange(max_blocks * block_size, dtype=jnp.int32), (rows, max_blocks * block_size)
    )
    read_slots = table[:, key_positions[0] // block_size] * block_size + key_positions % block_size
    key_valid = key_positions < (start + counts)[:, None]

    masks = {}
    x = model.embed(token_ids)
    new = []
    for i, layer in enumerate(model.layers):
        window = layer.self_attn.spec.sliding_window
        if window not in masks:
            masks[window] = attention_mask(positions, key_positions, key_valid, window)
        kv = PagedKV(cache.k_pool, cache.v_pool, i, read_slots, write_columns)
        x, layer_kv = layer(x, positions, masks[window], kv, None)
        new.append(layer_kv)
    last = jnp.maximum(counts - 1, 0)
    x = jnp.take_along_axis(x, last[:, None, None], axis=1)
    logits = model.unembed(model.norm(x))[:, 0]
    keys, values = (jnp.stack(kv).reshape(len(new), rows * tokens, *kv[0].shape[2:]) for kv in zip(*new))
    blocks, offsets = (write_slots // block_size).reshape(-1), (write_slots % block_size).reshape(-1)
    return logits, NewKV(keys, values, blocks, offsets)


def sample_rows(logits, sampling: RowSampling):
    """Next tokens [B] int32 from logits [B, vocab], each row under its own sampling: temperature 0 is the argmax;
    otherwise a draw from softmax(logits / temperature) restricted to the top_k most likely and to the smallest
    set whose probability (after top_k) reaches top_p. When no row samples, the sort is skipped at run time."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.lax.cond(jnp.any(sampling.temperature > 0), _draw, lambda *_: greedy, logits, sampling, greedy)


def _draw(logits, sampling: RowSampling, greedy):
    vocab = logits.shape[-1]
    temperature = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)
    scaled = logits / temperature[:, None]
    ranked = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, vocab), vocab)
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)
    kept = in_top_k & ((jnp.cumsum(probs, axis=-1) - probs) < sampling.top_p[:, None])
    kept = kept.at[:, 0].set(True)  # always at least the most likely token
    threshold = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)
    masked = jnp.where(scaled < threshold, -jnp.inf, scaled)

    def draw(seed, step, row_logits):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed[0]), seed[1]), step)
        return jax.random.categorical(key, row_logits)

    drawn = jax.vmap(draw)(sampling.seeds, sampling.steps, masked).astype(jnp.int32)
    return jnp.where(sampling.temperature > 0, drawn, greedy)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _read_and_sample(graphdef, state, token_ids, cache: PagedKVCache, batch: PagedBatch, sampling: RowSampling):
    TRACE_COUNTS["paged_step"] += 1
    model = nnx.merge(graphdef, state)
    logits, new = paged_read(model, token_ids, cache, batch)
    return sample_rows(logits, sampling), new


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _read(graphdef, state, token_ids, cache: PagedKVCache, batch: PagedBatch):
    TRACE_COUNTS["paged_prefill"] += 1
    model = nnx.merge(graphdef, state)
    return paged_read(model, token_ids, cache, batch)[1]  # the logits are unused, so XLA drops the head


_write = jax.jit(write_pools, donate_argnames=("cache",))


def paged_step(graphdef, state, token_ids, cache: PagedKVCache, batch: PagedBatch, sampling: RowSampling):
    """One step for the whole batch: `paged_read` and `sample_rows` in one jitted call, then the write into the
    donated pools in a second (XLA copies a pool it both reads and updates in one computation; alone, the
    scatter updates it in place). Returns (next tokens [B], cache). Compiled once per (model, B, T, max_blocks)."""
    next_tokens, new = _read_and_sample(graphdef, state, token_ids, cache, batch, sampling)
    return next_tokens, _write(cache, new)


def paged_prefill(graphdef, state, token_ids, cache: PagedKVCache, batch: PagedBatch) -> PagedKVCache:
    """`paged_step` without logits or sampling: writes each row's chunk into the (donated) pools and returns them.
    A chunk that samples nothing need not read the LM head (most of a small model's weight bytes when its
    vocabulary is large); the engine feeds a prompt's last token to the row's first decode step instead."""
    return _write(cache, _read(graphdef, state, token_ids, cache, batch))


def paged_plan(model: CausalLM, block_size: int) -> decode.DecodePlan | None:
    """`model`'s DecodePlan for decode steps over pools of `block_size`-slot blocks (its spec paged), or None when
    `models.decode` does not cover the model (`decode.unsupported_reason`) or its parameters are split over a mesh
    (the pools are one device's)."""
    plan = decode.decode_plan(model)
    if plan is None or plan.tensor_parallel is not None:
        return None
    return dataclasses.replace(plan, spec=plan.spec.replace(block_size=block_size))


def paged_decode(
    model: CausalLM,
    plan: decode.DecodePlan,
    weights: decode.DecodeWeights,
    token_ids,
    cache: PagedKVCache,
    block_table,
    lengths,
):
    """`paged_forward` of one token per row (token_ids [B, 1]) as one `decode_step` over the pools (plan from
    `paged_plan` with the pools' block_size, weights `decode.stack_weights(model, plan)`): (logits [B, vocab]
    float32, the updated cache). Row b's token sits at position p = lengths[b] (-1: an inactive row, which writes
    nothing): RoPE at p, and the mask shows the row's positions <= p (a sliding-window layer's last `window` of
    them) and hides the rest, so the table's entries past the row's blocks are never read into its output."""
    if token_ids.ndim != 2 or token_ids.shape[1] != 1:
        raise ValueError(f"token_ids: got shape {token_ids.shape}, expected [B, 1] (one decode token per row)")
    if plan.spec.block_size != cache.block_size:
        raise ValueError(f"plan: got block_size {plan.spec.block_size}, expected the pools' {cache.block_size}")
    rows, slots = token_ids.shape[0], block_table.shape[1] * cache.block_size
    positions = jnp.maximum(lengths, 0).astype(jnp.int32)[:, None]
    key_positions = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (rows, slots))
    cos, sin, bias = decode.step_tables(plan, positions, key_positions, jnp.ones((rows, slots), bool))
    logits, k_pool, v_pool = decode_step(
        x=model.embed(token_ids),
        norms=weights.norms,
        qk_norms=weights.qk_norms,
        **dict(zip(PROJECTIONS, weights.projections)),
        k_cache=cache.k_pool,
        v_cache=cache.v_pool,
        write_index=None,
        cos=cos,
        sin=sin,
        mask_bias=bias,
        final_norm=weights.final_norm,
        head=weights.head,
        packed=weights.packed,
        block_table=block_table.astype(jnp.int32),
        lengths=lengths.astype(jnp.int32),
        spec=plan.spec,
    )
    return logits[:, 0], PagedKVCache(k_pool=k_pool, v_pool=v_pool)


@functools.partial(jax.jit, static_argnames=("graphdef", "plan"), donate_argnames=("cache",))
def paged_decode_step(
    graphdef, state, weights, token_ids, cache: PagedKVCache, block_table, lengths, sampling, *, plan
):
    """One decode step for the whole batch through `paged_decode` (one `decode_step`), then `sample_rows`: (next
    tokens [B], cache), the pools donated (the primitive returns them updated). Compiled once per (model, B,
    block-table width)."""
    TRACE_COUNTS["paged_decode_step"] += 1
    model = nnx.merge(graphdef, state)
    logits, cache = paged_decode(model, plan, weights, token_ids, cache, block_table, lengths)
    return sample_rows(logits, sampling), cache
