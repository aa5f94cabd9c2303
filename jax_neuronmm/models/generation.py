"""Autoregressive generation with a static-shape KV cache: one jitted prefill, one jitted decode step.

Prefill runs the model's own forward; each decode step after it is one `decode_step` primitive over all layers
(`models.decode`: the weights are stacked once per generate call), so on the emulator and Trainium backends a
decode step is one kernel launch. Models the decode-step kernels do not cover (biases, see
`decode.unsupported_reason`) decode through their own forward.

Tensor parallel: with parameters split over a mesh axis in the Megatron layout (`decode.tensor_parallel_layout`),
each decode step is `decode_step` on every rank's shard (`jax.shard_map` over that axis, collectives after o and down
and for the logits; the mesh's other axes split the rows when they divide the batch; on the emulator backend every
rank's looped kernel in one emulated launch), the stacked weights and the cache's KV heads placed as the ranks hold
them (KV heads that do not split repeated on the ranks sharing them); parameters split any other way decode through
the model's own forward (`decode.tensor_parallel_fallback_reason`), so every layout gives one device's tokens.

The cache has T + max_new_tokens slots from the start, so every decode step sees the same shapes and the step is
compiled once per (model structure, batch, prompt length, max_new_tokens, sampling mode), never per token.
`TRACE_COUNTS` counts how often each jitted function was traced (tests use it to prove that), and each decode-step
trace by route: "decode_step", "decode_step_tensor_parallel" or "decode_model_forward".
"""

from __future__ import annotations

import collections
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_neuronmm.models import decode
from jax_neuronmm.models.decoder import CausalLM, KVCache
from jax_neuronmm.models.validation import check_token_ids

TRACE_COUNTS: collections.Counter = collections.Counter()


def _sample(
    logits: jax.Array, key: jax.Array, temperature, top_p, *, greedy: bool, top_k: int | None, use_top_p: bool
) -> jax.Array:
    """Next tokens [B] int32 from logits [B, vocab]."""
    logits = logits.astype(jnp.float32)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth_largest = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if use_top_p:
        # Keep the smallest set of most likely tokens whose probability reaches top_p (always at least one).
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = mass_before < top_p
        threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy", "top_k", "use_top_p"))
def _prefill(
    graphdef, state, token_ids, positions, token_mask, cache, key, temperature, top_p, *, greedy, top_k, use_top_p
):
    TRACE_COUNTS["prefill"] += 1
    model = nnx.merge(graphdef, state)
    tokens = token_ids.shape[1]
    last_real = jnp.argmax(jnp.where(token_mask, jnp.arange(tokens), -1), axis=1)
    logits, cache = model(token_ids, positions=positions, token_mask=token_mask, cache=cache, logits_at=last_real)
    next_tokens = _sample(logits[:, 0], key, temperature, top_p, greedy=greedy, top_k=top_k, use_top_p=use_top_p)
    return next_tokens, cache


@functools.partial(
    jax.jit, static_argnames=("graphdef", "plan", "greedy", "top_k", "use_top_p"), donate_argnames=("cache",)
)
def _decode_step(
    graphdef, state, weights, tokens, positions, cache, key, temperature, top_p, *, plan, greedy, top_k, use_top_p
):
    TRACE_COUNTS["decode"] += 1
    model = nnx.merge(graphdef, state)
    if plan is None:  # a model the decode-step kernels do not cover (decode.unsupported_reason)
        TRACE_COUNTS["decode_model_forward"] += 1
        logits, cache = model(tokens[:, None], positions=positions[:, None], cache=cache)
    else:
        TRACE_COUNTS["decode_step" if plan.tensor_parallel is None else "decode_step_tensor_parallel"] += 1
        logits, cache = decode.decode(model, plan, weights, tokens[:, None], positions[:, None], cache)
    next_tokens = _sample(logits[:, 0], key, temperature, top_p, greedy=greedy, top_k=top_k, use_top_p=use_top_p)
    return next_tokens, cache


def _prompt_mask(token_ids: np.ndarray, pad_mask, lengths) -> np.ndarray:
    batch, tokens = token_ids.shape
    if pad_mask is not None and lengths is not None:
        raise ValueError("pad_mask and lengths: got both, expected at most one")
    if lengths is not None:
        lengths = np.asarray(lengths)
        if lengths.shape != (batch,) or np.any(lengths < 1) or np.any(lengths > tokens):
            raise ValueError(f"lengths: got {lengths.tolist()}, expected {batch} integers in [1, {tokens}]")
        return np.arange(tokens)[None, :] < lengths[:, None]
    if pad_mask is None:
        return np.ones((batch, tokens), bool)
    mask = np.asarray(pad_mask).astype(bool)
    if mask.shape != (batch, tokens):
        raise ValueError(f"pad_mask: got shape {mask.shape}, expected {(batch, tokens)} like token_ids")
    if not mask.any(axis=1).all():
        raise ValueError("pad_mask: every row needs at least one real (True) token")
    return mask


def generate(
    model: CausalLM,
    token_ids,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id=None,
    seed: int = 0,
    pad_mask=None,
    lengths=None,
) -> jax.Array:
    """Continue each prompt of token_ids [B, T] by up to max_new_tokens tokens; returns [B, T + n] int32.

    The result is the prompt as given followed by n new tokens (n == max_new_tokens unless every row produced an
    end token earlier; rows that finished first are filled with the first end token). eos_id: an end-of-sequence
    id or a sequence of them (Llama 3 instruct ends turns with several), or None. temperature 0 is greedy
    decoding; otherwise
    tokens are sampled from softmax(logits / temperature), restricted to the top_k most likely and/or to the
    smallest set whose probability reaches top_p, with a PRNG seeded by `seed`.

    Padding: give pad_mask [B, T] (True = real token) for any layout, or lengths [B] for right padding (the first
    lengths[b] tokens are real). Left padding (pads first) and right padding both work: pads are never attended
    to and positions count real tokens only, so each row decodes as it would alone. New tokens always start at
    column T, so with right padding a row's pads stay between its prompt and its continuation.

    Raises ValueError for token ids outside [0, vocab_size), a batch of 0 prompts or rows of different lengths,
    T + max_new_tokens beyond the model's context (`config.max_position_embeddings`, when known), a NaN, infinite
    or negative temperature, a seed outside 64 bits, and other bad values; TypeError for a count (max_new_tokens,
    top_k, seed) that is not an integer or a temperature / top_p that is not a number. Each message names the
    argument.
    """
    if not isinstance(model, CausalLM):
        raise TypeError(f"model: got {type(model).__name__}, expected a jax_neuronmm.models CausalLM")
    max_new_tokens = _integer("max_new_tokens", max_new_tokens, "an integer >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: got {max_new_tokens!r}, expected an integer >= 1")
    temperature = _number("temperature", temperature, "a finite number >= 0")
    if not math.isfinite(temperature) or temperature < 0:  # NaN would sample from NaN logits: all zeros
        raise ValueError(f"temperature: got {temperature}, expected a finite number >= 0")
    vocab = model.config.vocab_size
    if top_k is not None:
        top_k = _integer("top_k", top_k, f"None or an integer in 1..{vocab}")
        if not 1 <= top_k <= vocab:
            raise ValueError(f"top_k: got {top_k}, expected None or an integer in 1..{vocab}")
    if top_p is not None:
        top_p = _number("top_p", top_p, "None or a number with 0 < top_p <= 1")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p: got {top_p}, expected None or 0 < top_p <= 1")
    seed = _integer("seed", seed, f"an integer in [{-(2**63)}, {2**63 - 1}]")
    if not -(2**63) <= seed < 2**63:  # what jax.random.key takes
        raise ValueError(f"seed: got {seed}, expected an integer in [{-(2**63)}, {2**63 - 1}] (a 64-bit seed)")
    try:
        prompt = np.asarray(token_ids)
    except ValueError as error:  # numpy's "inhomogeneous shape": rows of different lengths
        raise ValueError(
            "token_ids: rows have different lengths, expected int [B, T]; pad the shorter prompts to T and pass "
            "pad_mask or lengths"
        ) from error
    if prompt.dtype == object and prompt.ndim == 1 and prompt.size and all(np.ndim(row) == 1 for row in prompt):
        raise ValueError(
            f"token_ids: rows have different lengths {[len(row) for row in prompt]}, expected int [B, T]; pad the "
            "shorter prompts to T and pass pad_mask or lengths"
        )
    if prompt.ndim != 2 or prompt.shape[1] < 1 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"token_ids: got shape {prompt.shape} dtype {prompt.dtype}, expected int [B, T] with T >= 1")
    if prompt.shape[0] < 1:
        raise ValueError(f"token_ids: got shape {prompt.shape}, a batch of 0 prompts; expected int [B, T] with B >= 1")
    check_token_ids(prompt, model.config.vocab_size, name="token_ids")
    mask = _prompt_mask(prompt, pad_mask, lengths)
    batch, tokens = prompt.shape
    context = model.config.max_position_embeddings
    if context is not None and tokens + max_new_tokens > context:
        raise ValueError(
            f"token_ids, max_new_tokens: {tokens} prompt tokens + {max_new_tokens} new tokens exceed the "
            f"model's context of {context} positions (max_position_embeddings)"
        )
    eos_ids = _end_tokens(eos_id, model.config.vocab_size)

    graphdef, state = nnx.split(model)
    plan = decode.decode_plan(model)
    if plan is not None:  # pads among a row's tokens sit inside its sliding windows' slot span
        plan = decode.widen_windows(plan, decode.pad_slots(mask))
    weights = None if plan is None else decode.stack_weights(model, plan)
    sampling = dict(greedy=temperature == 0, top_k=top_k, use_top_p=top_p is not None)
    temperature_arr = jnp.float32(max(temperature, 1e-6))
    top_p_arr = jnp.float32(1.0 if top_p is None else top_p)
    base_key = jax.random.key(seed)

    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    next_positions = mask.sum(axis=1).astype(np.int32)
    cache: KVCache = model.init_cache(batch, tokens + int(max_new_tokens))
    next_tokens, cache = _prefill(
        graphdef,
        state,
        jnp.asarray(prompt, jnp.int32),
        jnp.asarray(positions),
        jnp.asarray(mask),
        cache,
        jax.random.fold_in(base_key, 0),
        temperature_arr,
        top_p_arr,
        **sampling,
    )
    if plan is not None:  # tensor parallel: the KV heads split as the decode steps' ranks hold them
        cache = decode.place_cache(plan, cache)
    done = jnp.zeros((batch,), bool)
    new_tokens = []
    for step in range(int(max_new_tokens)):
        if eos_ids is not None:
            next_tokens = jnp.where(done, eos_ids[0], next_tokens)
            done = done | jnp.isin(next_tokens, eos_ids)
        new_tokens.append(next_tokens)
        if step + 1 == max_new_tokens or (eos_ids is not None and bool(done.all())):
            break
        next_tokens, cache = _decode_step(
            graphdef,
            state,
            weights,
            next_tokens,
            jnp.asarray(next_positions + step),
            cache,
            jax.random.fold_in(base_key, step + 1),
            temperature_arr,
            top_p_arr,
            plan=plan,
            **sampling,
        )
    return jnp.concatenate([jnp.asarray(prompt, jnp.int32), jnp.stack(new_tokens, axis=1)], axis=1)


def _scalar_kind(value) -> str:
    """numpy's dtype kind of a 0-d number (Python, numpy or JAX scalar), else "" (strings, None, arrays, ...)."""
    if isinstance(value, bool):
        return "b"
    if isinstance(value, int):  # any size: a seed beyond 64 bits is a range error, not a type error
        return "i"
    if isinstance(value, (str, bytes)) or value is None or np.ndim(value) != 0:
        return ""
    try:
        return np.asarray(value).dtype.kind
    except (TypeError, ValueError):
        return ""


def _integer(name: str, value, expected: str) -> int:
    """`value` as a Python int; TypeError naming `name` for a bool, a float, a string or None."""
    if _scalar_kind(value) not in ("i", "u"):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}), expected {expected}")
    return int(value)


def _number(name: str, value, expected: str) -> float:
    """`value` as a Python float; TypeError naming `name` for a bool, a string, None or an array."""
    if _scalar_kind(value) not in ("i", "u", "f"):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}), expected {expected}")
    return float(value)


def _end_tokens(eos_id, vocab_size):
    """eos_id (None, an int or a sequence of ints) as an int32 array of ids, or None."""
    if eos_id is None:
        return None
    ids = [eos_id] if np.ndim(eos_id) == 0 else list(eos_id)
    if not ids or any(int(i) != i or not 0 <= i < vocab_size for i in ids):
        raise ValueError(
            f"eos_id: got {eos_id!r}, expected None, a token id or a non-empty sequence of ids in [0, {vocab_size})"
        )
    return jnp.asarray(ids, jnp.int32)
