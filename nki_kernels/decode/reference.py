"""Float64 numpy reference of the decode step over all layers (nki_kernels.decode.contract's layer math).

`decode_step_f64` takes the kernels' operands (any float dtype, fp8 weights counted as their values times their
scales) and returns exact float64 logits and caches; tests compare every composition of the step against it.
"""

from __future__ import annotations

import numpy as np

from nki_kernels.activations import ACTIVATIONS
from nki_kernels.decode.contract import DecodeOperands, Factored, Quantized
from nki_kernels.decode.packing import unpack_weights, unpacked_spec


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _rms_norm_f64(x, weight, eps, unit_offset) -> np.ndarray:
    """RMSNorm over the last axis: x·rsqrt(mean(x²)+eps) times w (or 1 + w)."""
    w = _f64(weight)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * ((1.0 + w) if unit_offset else w)


def _projection_f64(h, weight, layer, rank) -> np.ndarray:
    """h [..., K] @ layer `layer` of a dense [L, K, N] weight or of factors [u [L, K, Rmax], v [L, Rmax, N]]
    (the first `rank` columns of u / rows of v; rank None in a factored stack: the layer's whole factors, which
    hold its dense W exactly, contract.dense_in_stack)."""
    if not isinstance(weight, Factored):
        return h @ _f64(weight[layer])
    u, v = weight
    return (h @ _f64(u[layer][:, :rank])) @ _f64(v[layer][:rank])


def dequantized_f64(weight):
    """A decode-step weight in float64: a dense array as it is, a Quantized as w·diag(scale), a Factored as the
    Factored of its float64 factors (fp8 ones times their scales); stacked weights keep their layer axis."""
    if isinstance(weight, Quantized):
        return _f64(weight.w) * _f64(weight.scale)[..., None, :]
    if isinstance(weight, Factored):
        if weight.u_scale is None:
            return Factored(_f64(weight.u), _f64(weight.v))
        return Factored(
            _f64(weight.u) * _f64(weight.u_scale)[..., None, :], _f64(weight.v) * _f64(weight.v_scale)[..., None, :]
        )
    return _f64(weight)


def _rotate_half(x) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def decode_step_f64(operands, spec):
    """One decode step over all layers (the layer math of nki_kernels.decode.contract) in float64.

    operands: nki_kernels.decode.contract.DecodeOperands (or a sequence in its field order, stored weights as the
    lists of their parts; packed weights are unpacked, nki_kernels.decode.packing); fp8 weights count as their
    values times their scales (`dequantized_f64`).
    Returns (logits [B, T, V] float64 with the final softcap applied, k_cache, v_cache): the caches are new float64
    arrays with this step's k (after RoPE) and v written at slots [write_index, write_index + T). A paged spec
    (spec.block_size): each row attends over its blocks of the pools read through block_table, its new k and v at
    position lengths[b]; the pools come back with those slots written (an inactive row's logits are computed at
    position 0 and nothing of it is written).
    """
    ops = unpack_weights(DecodeOperands.of(operands, spec), spec)
    spec = unpacked_spec(spec)
    x, norms, qk_norms, k_cache, v_cache = ops.x, ops.norms, ops.qk_norms, ops.k_cache, ops.v_cache
    write_index, cos, sin, mask_bias, final_norm, head = (
        ops.write_index,
        ops.cos,
        ops.sin,
        ops.mask_bias,
        ops.final_norm,
        dequantized_f64(ops.head),
    )
    weights = {name: dequantized_f64(weight) for name, weight in ops.weights.items()}
    eps, unit = spec.norm_eps, spec.norm_unit_offset
    x = _f64(x)
    b, t, _ = x.shape
    heads, kv_heads, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    group = heads // kv_heads
    if spec.paged:
        pools = _f64(k_cache).copy(), _f64(v_cache).copy()
        blocks, lengths = np.asarray(ops.block_table), np.asarray(ops.lengths)
        k_cache, v_cache = (_paged_rows(pool, blocks) for pool in pools)
        start = np.maximum(lengths, 0)
    else:
        k_cache, v_cache = _f64(k_cache).copy(), _f64(v_cache).copy()
        start = int(np.asarray(write_index).reshape(-1)[0])
    act = ACTIVATIONS[spec.activation].reference

    def project(h, name, layer):
        return _projection_f64(h, weights[name], layer, spec.rank(name, layer))

    for layer in range(spec.num_layers):
        h = _rms_norm_f64(x, norms[layer, 0], eps, unit)
        q = project(h, "q", layer).reshape(b, t, heads, d)
        k = project(h, "k", layer).reshape(b, t, kv_heads, d)
        v = project(h, "v", layer).reshape(b, t, kv_heads, d)
        if spec.qk_norm:
            q = _rms_norm_f64(q, qk_norms[layer, 0], eps, unit)
            k = _rms_norm_f64(k, qk_norms[layer, 1], eps, unit)
        table = spec.layer_rope[layer]
        c, s = _f64(cos[table])[:, :, None, :], _f64(sin[table])[:, :, None, :]
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        if spec.paged:  # T = 1: row b's token at its own position
            k_cache[layer, np.arange(b), start] = k[:, 0]
            v_cache[layer, np.arange(b), start] = v[:, 0]
        else:
            k_cache[layer, :, start : start + t] = k
            v_cache[layer, :, start : start + t] = v
        scores = np.einsum("btkgd,bskd->bkgts", q.reshape(b, t, kv_heads, group, d), k_cache[layer])
        scores = scores * spec.query_scaling
        if spec.attn_logit_softcap is not None:
            scores = np.tanh(scores / spec.attn_logit_softcap) * spec.attn_logit_softcap
        scores = scores + _f64(mask_bias[spec.layer_mask[layer]])[:, None, None, :, :]
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        attn = np.einsum("bkgts,bskd->btkgd", probs, v_cache[layer]).reshape(b, t, heads * d)
        y = project(attn, "o", layer)
        if spec.sandwich:
            x = x + _rms_norm_f64(y, norms[layer, 1], eps, unit)
            h = _rms_norm_f64(x, norms[layer, 2], eps, unit)
        else:
            x = x + y
            h = _rms_norm_f64(x, norms[layer, 1], eps, unit)
        mlp = project(act(project(h, "gate", layer)) * project(h, "up", layer), "down", layer)
        x = x + (_rms_norm_f64(mlp, norms[layer, 3], eps, unit) if spec.sandwich else mlp)
    h = _rms_norm_f64(x, final_norm, eps, unit)
    logits = h @ _f64(head) if spec.head_rank is None else (h @ _f64(head.u)) @ _f64(head.v)
    if spec.final_logit_softcap is not None:
        logits = np.tanh(logits / spec.final_logit_softcap) * spec.final_logit_softcap
    if spec.paged:
        for pool, rows in zip(pools, (k_cache, v_cache)):
            for row in np.flatnonzero(lengths >= 0):
                p = start[row]
                pool[:, blocks[row, p // spec.block_size], p % spec.block_size] = rows[:, row, p]
        return (logits, *pools)
    return logits, k_cache, v_cache


def _paged_rows(pool, block_table) -> np.ndarray:
    """[L, B, MB·BS, kv_heads, D]: each row's logical cache, its blocks of pool [L, NB, BS, kv_heads, D] in
    block_table [B, MB] order."""
    layers, _, bs, kv, d = pool.shape
    b, mb = block_table.shape
    return pool[:, block_table].reshape(layers, b, mb * bs, kv, d)
