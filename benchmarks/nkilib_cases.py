"""AWS nki-library ("nkilib") kernels run unmodified on the emulator, each against a float64 numpy reference.

Used by `benchmarks/aws_examples.py --nki_library=<checkout of aws-neuron/nki-library>`. The kernels are imported
from the checkout at run time (inside `nki_kernels.emulator.as_nki()`); nothing of theirs is copied here. Each
case is a small driver kernel (allocating the buffers a subkernel expects), the call, and the reference.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import traceback
from collections.abc import Callable

import ml_dtypes
import numpy as np

from nki_kernels import emulator

BF16 = ml_dtypes.bfloat16


def _f64(x):
    return np.asarray(x, dtype=np.float64)


@dataclasses.dataclass
class LibraryCase:
    name: str
    run: Callable  # (import_fn, rng) -> (got, expected, rtol, atol)


def _rms_ref(x, gamma, eps):
    x = _f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(gamma).reshape(-1)


def _rmsnorm(load, rng):
    module = load("nkilib.core.subkernels.rmsnorm_tkg")
    nl, nisa = emulator.language, emulator.isa
    b, s, h, eps = 2, 3, 512, 1e-6
    x = rng.standard_normal((b, s, h)).astype(BF16)
    gamma = rng.standard_normal((1, h)).astype(BF16)

    @emulator.jit
    def driver(x, gamma):
        out_sb = nl.ndarray((128, b * s, h // 128), dtype=x.dtype, buffer=nl.sbuf)
        module.rmsnorm_tkg(x, gamma, out_sb, eps=eps)
        out = nl.ndarray((128, b * s, h // 128), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, out_sb)
        return out

    expected = _rms_ref(x, gamma, eps).reshape(b * s, 128, h // 128).transpose(1, 0, 2)
    return driver(x, gamma), expected, 2e-2, 2e-2


def _rope_ref(x, cos, sin):
    """x [d, B, n, S]; cos/sin [d/2, B, S]; contiguous halves: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    x, cos, sin = _f64(x), _f64(cos)[:, :, None, :], _f64(sin)[:, :, None, :]
    half = x.shape[0] // 2
    x1, x2 = x[:half], x[half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=0)


def _rope(load, rng):
    module = load("nkilib.core.embeddings.rope")
    d, b, n, s = 128, 2, 4, 5
    x = rng.standard_normal((d, b, n, s)).astype(BF16)
    angle = rng.uniform(0, 2 * np.pi, (d // 2, b, s))
    cos, sin = np.cos(angle).astype(BF16), np.sin(angle).astype(BF16)
    return module.RoPE(x, cos, sin), _rope_ref(x, cos, sin), 2e-2, 3e-2


def _cumsum(load, rng):
    module = load("nkilib.core.cumsum.cumsum")
    x = rng.standard_normal((130, 700)).astype(np.float32)
    return module.cumsum(x), np.cumsum(_f64(x), axis=-1), 1e-4, 1e-3


def _max(load, rng):
    module = load("nkilib.core.max.cascaded_max")
    x = rng.standard_normal((1, 1, 5000)).astype(np.float32)
    values, indices = module.cascaded_max(x)
    expected = (np.max(_f64(x), axis=-1, keepdims=True), np.argmax(x, axis=-1)[..., None].astype(np.float64))
    return (values, _f64(indices)), expected, 0, 0


def _attention_ref(q, k_active, v_active, k_prior, v_prior, mask, s_prior):
    """Decode attention over the cache window [0, s_prior) whose last s_active slots hold the active K/V.

    q [B, d, H, s_a], k_active [B, d, s_a], v_active [B, 1, s_a, d], k_prior [B, 1, d, S], v_prior [B, 1, S, d],
    mask [s_prior, B, H, s_a] (1 = attend). Returns [B, H, d, s_a].
    """
    s_active = q.shape[-1]
    keys = _f64(k_prior)[:, 0, :, :s_prior].copy()  # [B, d, s_prior]
    values = _f64(v_prior)[:, 0, :s_prior].copy()  # [B, s_prior, d]
    keys[:, :, s_prior - s_active :] = _f64(k_active)
    values[:, s_prior - s_active :] = _f64(v_active)[:, 0]
    scores = np.einsum("bdk,bdhs->bhks", keys, _f64(q))  # [B, H, s_prior, s_a]
    scores = np.where(np.transpose(mask, (1, 2, 0, 3)) != 0, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=2, keepdims=True))
    weights /= weights.sum(axis=2, keepdims=True)
    return np.einsum("bhks,bkd->bhds", weights, values)


def _attention_tkg(load, rng):
    module = load("nkilib.core.attention.attention_tkg")
    utils = load("nkilib.core.attention.attention_tkg_utils")
    allocator = load("nkilib.core.utils.allocator")
    nl = emulator.language
    b, h, s_active, s_prior, full, d = 2, 2, 1, 128, 256, 64
    # Without fused RoPE the kernel takes Q and K already in SBUF (qk_in_sb).
    cfg = utils.AttnTKGConfig(
        bs=b, q_head=h, s_active=s_active, curr_sprior=s_prior, full_sprior=full, d_head=d, block_len=0, qk_in_sb=True
    )
    q = (rng.standard_normal((b, d, h, s_active)) / np.sqrt(d)).astype(BF16)
    k_active = rng.standard_normal((b, d, s_active)).astype(BF16)
    v_active = rng.standard_normal((b, 1, s_active, d)).astype(BF16)
    k_prior = rng.standard_normal((b, 1, d, full)).astype(BF16)
    v_prior = rng.standard_normal((b, 1, full, d)).astype(BF16)
    lengths = rng.integers(s_active + 1, s_prior, size=b)  # valid cache length per sequence
    mask = np.zeros((s_prior, b, h, s_active), dtype=np.uint8)
    for i, n in enumerate(lengths):
        mask[:n, i] = 1
        mask[s_prior - s_active :, i] = 1  # the active tokens

    @emulator.jit
    def driver(q_flat, k_flat, v_active, k_prior, v_prior, mask):
        sbm = allocator.SbufManager(0, nl.tile_size.total_available_sbuf_size - 16 * 1024, allocator.Logger("SBM"))
        sbm.open_scope()
        q_sb = nl.ndarray(q_flat.shape, dtype=q_flat.dtype, buffer=nl.sbuf)
        k_sb = nl.ndarray(k_flat.shape, dtype=k_flat.dtype, buffer=nl.sbuf)
        q_sb[...] = q_flat
        k_sb[...] = k_flat
        out = nl.ndarray((b, h, d, s_active), dtype=q_flat.dtype, buffer=nl.shared_hbm)
        result, _ = module.attention_tkg(q_sb, k_sb, v_active, k_prior, v_prior, mask, out, cfg, sbm)
        sbm.close_scope()
        return result

    q_flat = np.ascontiguousarray(q.transpose(1, 0, 2, 3).reshape(d, b * h * s_active))  # [d, (b, h, s)]
    k_flat = np.ascontiguousarray(k_active.transpose(1, 0, 2).reshape(d, b * s_active))  # [d, (b, s)]
    expected = _attention_ref(q, k_active, v_active, k_prior, v_prior, mask, s_prior)
    return driver(q_flat, k_flat, v_active, k_prior, v_prior, mask), expected, 3e-2, 3e-2


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _mlp_case(module_name, function, b, s, h, i):
    """A dense SiLU-gated MLP kernel of nkilib on x [b, s, h], weights gate/up [h, i], down [i, h]."""

    def run(load, rng):
        kernel = getattr(load(module_name), function)
        parameters = load("nkilib.core.mlp.mlp_parameters")
        allocator = load("nkilib.core.utils.allocator")
        nl = emulator.language
        x = rng.standard_normal((b, s, h)).astype(BF16)
        gate = (rng.standard_normal((h, i)) / np.sqrt(h)).astype(BF16)
        up = (rng.standard_normal((h, i)) / np.sqrt(h)).astype(BF16)
        down = (rng.standard_normal((i, h)) / np.sqrt(i)).astype(BF16)

        @emulator.jit
        def driver(x, gate, up, down):
            out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
            if function == "mlp":
                return kernel(x, gate, up, down)[0]
            params = parameters.MLPParameters(
                hidden_tensor=x, gate_proj_weights_tensor=gate, up_proj_weights_tensor=up, down_proj_weights_tensor=down
            )
            if function == "mlp_cte":
                kernel(params, out, None)  # writes `out`, returns nothing
                return out
            sbm = allocator.SbufManager(0, 200 * 1024, allocator.Logger(function))  # as the `mlp` entry point does
            return kernel(params, out, None, sbm)[0]

        xf = _f64(x)
        expected = (_silu(xf @ _f64(gate)) * (xf @ _f64(up))) @ _f64(down)
        return driver(x, gate, up, down), expected, 3e-2, 3e-2

    return run


def _rope_halves(x, cos, sin):
    """RoPE on the first axis (d) of x [d, ...] with cos/sin [d/2, ...] broadcast against x's halves."""
    half = x.shape[0] // 2
    x1, x2 = x[:half], x[half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=0)


def _nonzero_indices(load, rng):
    """find_nonzero_indices on an LNC2 grid (two programs, columns split between them): per column the row
    indices of its nonzero entries, -1 padded, and their counts (GpSimd nonzero_with_count)."""
    module = load("nkilib.core.subkernels.find_nonzero_indices")
    x = (rng.random((256, 8)) < 0.3).astype(np.float32) * rng.standard_normal((256, 8)).astype(np.float32)
    indices, counts = module.find_nonzero_indices[2](x)
    expected = np.full((8, 256), -1.0)
    for c in range(8):
        found = np.flatnonzero(x[:, c])
        expected[c, : found.size] = found
    return (_f64(indices), _f64(counts).reshape(-1)), (expected, _f64((x != 0).sum(axis=0))), 0, 0


def _rotational_topk(load, rng):
    """nkilib's top-k (rotational method, LNC2 grid) over a 1000-entry vocabulary for B x S = 2 rows."""
    module = load("nkilib.core.topk.rotational_topk")
    x = rng.standard_normal((1, 2, 1000)).astype(np.float32)
    values, indices = module.topk[2](x, 8)
    order = np.argsort(-x, axis=-1, kind="stable")[..., :8]
    return (_f64(values), _f64(indices)), (np.take_along_axis(_f64(x), order, -1), _f64(order)), 0, 0


def _rms_rows(x, gamma, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(gamma).reshape(-1)


def _attention_block_ref(x, gamma, w_qkv, cos, sin, k_cache, v_cache, mask, w_out, eps):
    """x [B, S, H]; w_qkv [H, d (heads + 2)] (Q heads, then K, then V); k_cache / v_cache [B, 1, S_max, d];
    mask [S_ctx, B, heads, S]. Returns the projected attention output [B * S, H]."""
    b, s, h = x.shape
    s_ctx, heads, d = mask.shape[0], mask.shape[2], w_qkv.shape[1] // (mask.shape[2] + 2)
    normed = _rms_rows(_f64(x).reshape(b * s, h), gamma, eps)
    qkv = (normed @ _f64(w_qkv)).reshape(b, s, heads + 2, d).transpose(3, 0, 2, 1)  # [d, B, heads + 2, S]
    c, sn = _f64(cos)[:, :, None, :], _f64(sin)[:, :, None, :]
    q = _rope_halves(qkv[:, :, :heads], c, sn).transpose(1, 0, 2, 3) / np.sqrt(d)  # [B, d, heads, S]
    k_new = _rope_halves(qkv[:, :, heads : heads + 1], c, sn)[:, :, 0].transpose(1, 0, 2)  # [B, d, S]
    v_new = qkv[:, :, heads + 1].transpose(1, 2, 0)[:, None]  # [B, 1, S, d]
    attn = _attention_ref(q, k_new, v_new, _f64(k_cache).transpose(0, 1, 3, 2), v_cache, mask, s_ctx)
    return attn.transpose(0, 3, 1, 2).reshape(b * s, heads * d) @ _f64(w_out)


def _attention_block(load, rng):
    """nkilib's fused decode attention block (experimental/transformer): RMSNorm, QKV projection, RoPE, attention
    over the KV cache (its window's last S_tkg slots replaced by the new tokens), output projection."""
    module = load("nkilib.experimental.transformer.attention_block_tkg")
    types = load("nkilib.core.utils.common_types")
    b, s, h, d, heads, s_ctx, s_max, eps = 2, 1, 256, 64, 2, 128, 256, 1e-6
    x = rng.standard_normal((b, s, h)).astype(BF16)
    gamma = (1 + 0.1 * rng.standard_normal((1, h))).astype(BF16)
    w_qkv = (rng.standard_normal((h, d * (heads + 2))) / np.sqrt(h)).astype(BF16)
    w_out = (rng.standard_normal((heads * d, h)) / np.sqrt(heads * d)).astype(BF16)
    angle = rng.uniform(0, 2 * np.pi, (d // 2, b, s))
    cos, sin = np.cos(angle).astype(BF16), np.sin(angle).astype(BF16)
    k_cache = rng.standard_normal((b, 1, s_max, d)).astype(BF16)
    v_cache = rng.standard_normal((b, 1, s_max, d)).astype(BF16)
    lengths = rng.integers(s + 1, s_ctx, size=b)
    mask = np.zeros((s_ctx, b, heads, s), dtype=np.uint8)
    for i, n in enumerate(lengths):
        mask[:n, i] = 1
        mask[s_ctx - s :, i] = 1

    @emulator.jit
    def driver(x, gamma, w_qkv, cos, sin, k_cache, v_cache, mask, w_out):
        none = types.QuantizationType.NONE
        out = module.attention_block_tkg(
            X=x,
            X_hidden_dim_actual=None,
            rmsnorm_X_enabled=True,
            rmsnorm_X_eps=eps,
            rmsnorm_X_gamma=gamma,
            W_qkv=w_qkv,
            bias_qkv=None,
            quantization_type_qkv=none,
            weight_dequant_scale_qkv=None,
            input_dequant_scale_qkv=None,
            rmsnorm_QK_pre_rope_enabled=False,
            rmsnorm_QK_pre_rope_eps=eps,
            rmsnorm_QK_pre_rope_W_Q=None,
            rmsnorm_QK_pre_rope_W_K=None,
            cos=cos,
            sin=sin,
            rope_contiguous_layout=True,
            rmsnorm_QK_post_rope_enabled=False,
            rmsnorm_QK_post_rope_eps=eps,
            rmsnorm_QK_post_rope_W_Q=None,
            rmsnorm_QK_post_rope_W_K=None,
            K_cache_transposed=False,
            active_blocks_table=None,
            K_cache=k_cache,
            V_cache=v_cache,
            attention_mask=mask,
            sink=None,
            update_cache=False,
            kv_cache_update_idx=None,
            W_out=w_out,
            bias_out=None,
            quantization_type_out=none,
            weight_dequant_scale_out=None,
            input_dequant_scale_out=None,
            transposed_out=False,
            out_in_sb=False,
        )
        return out[0]

    expected = _attention_block_ref(x, gamma, w_qkv, cos, sin, k_cache, v_cache, mask, w_out, eps)
    got = driver(x, gamma, w_qkv, cos, sin, k_cache, v_cache, mask, w_out)
    return got, expected, 4e-2, 4e-2


def _transformer_tkg(load, rng):
    """nkilib's decode megakernel (experimental/transformer/transformer_tkg.py): num_layers of attention block +
    residual + RMSNorm SiLU MLP + residual, collectives over replica groups of one (this core), no cache update."""
    module = load("nkilib.experimental.transformer.transformer_tkg")
    layers, b, s, h, d, heads, i, s_ctx, s_max, eps = 2, 2, 1, 256, 64, 2, 384, 128, 256, 1e-6
    x = rng.standard_normal((b, s, h)).astype(BF16)

    def weights(shape, fan_in):
        return [(rng.standard_normal(shape) / np.sqrt(fan_in)).astype(BF16) for _ in range(layers)]

    w_qkv, w_out = weights((h, d * (heads + 2)), h), weights((heads * d, h), heads * d)
    w_gate, w_up, w_down = weights((h, i), h), weights((h, i), h), weights((i, h), i)
    g_qkv = [(1 + 0.1 * rng.standard_normal((1, h))).astype(BF16) for _ in range(layers)]
    g_mlp = [(1 + 0.1 * rng.standard_normal((1, h))).astype(BF16) for _ in range(layers)]
    k_caches = [rng.standard_normal((b, 1, d, s_max)).astype(BF16) for _ in range(layers)]  # transposed K cache
    v_caches = [rng.standard_normal((b, 1, s_max, d)).astype(BF16) for _ in range(layers)]
    angle = rng.uniform(0, 2 * np.pi, (d // 2, b, s))
    cos, sin = np.cos(angle).astype(BF16), np.sin(angle).astype(BF16)
    mask = np.zeros((s_ctx, b, heads, s), dtype=np.uint8)
    for j, n in enumerate(rng.integers(s + 1, s_ctx, size=b)):
        mask[:n, j] = 1
        mask[s_ctx - s :, j] = 1
    mask_active = np.ones((s, b, heads, s), dtype=np.uint8)
    kernel = emulator.jit(module.transformer_tkg)
    got = kernel(
        x,
        w_qkv,
        w_out,
        w_gate,
        w_up,
        w_down,
        g_qkv,
        g_mlp,
        k_caches,
        v_caches,
        cos,
        sin,
        mask,
        mask_active,
        None,
        num_layers=layers,
        eps=eps,
        replica_groups=[[0]],
    )
    current = _f64(x).reshape(b * s, h)
    for layer in range(layers):
        k_cache = _f64(k_caches[layer]).transpose(0, 1, 3, 2)
        current = current + _attention_block_ref(
            current.reshape(b, s, h),
            g_qkv[layer],
            w_qkv[layer],
            cos,
            sin,
            k_cache,
            v_caches[layer],
            mask,
            w_out[layer],
            eps,
        )
        normed = _rms_rows(current, g_mlp[layer], eps)
        current = current + (_silu(normed @ _f64(w_gate[layer])) * (normed @ _f64(w_up[layer]))) @ _f64(w_down[layer])
    return got, current.reshape(b, s, h), 5e-2, 5e-2


CASES = [
    LibraryCase("RMSNorm (rmsnorm_tkg)", _rmsnorm),
    LibraryCase("RoPE", _rope),
    LibraryCase("cumsum", _cumsum),
    LibraryCase("max (cascaded_max)", _max),
    LibraryCase("nonzero indices (find_nonzero_indices, LNC2)", _nonzero_indices),
    LibraryCase("top-k (rotational_topk, LNC2)", _rotational_topk),
    LibraryCase("decode attention (attention_tkg)", _attention_tkg),
    LibraryCase("decode attention block (attention_block_tkg)", _attention_block),
    LibraryCase("dense MLP, entry point (mlp)", _mlp_case("nkilib.core.mlp.mlp", "mlp", 1, 3, 512, 640)),
    LibraryCase("dense MLP, decode (mlp_tkg)", _mlp_case("nkilib.core.mlp.mlp_tkg.mlp_tkg", "mlp_tkg", 1, 3, 512, 640)),
    LibraryCase("decode megakernel (transformer_tkg)", _transformer_tkg),
    LibraryCase(
        "dense MLP, prefill (mlp_cte)", _mlp_case("nkilib.core.mlp.mlp_cte.mlp_cte", "mlp_cte", 1, 130, 512, 640)
    ),
]


def compare_outputs(got, expected, rtol, atol):
    """'' when every output of `got` matches its float64 `expected` within rtol / atol, else the first mismatch."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    if len(got) != len(expected):
        return f"{len(got)} outputs, expected {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        g = _f64(g)
        if g.shape != e.shape:
            return f"output {i} shape {g.shape}, expected {e.shape}"
        if not np.allclose(g, e, rtol=rtol, atol=atol):
            return f"output {i} differs: max |error| {np.nanmax(np.abs(g - e)):.3g}"
    return ""


def run_cases(checkout, cases=None, seed=0):
    """[(name, reason)] for each case: reason '' when it passes."""
    source = os.path.join(checkout, "src", "nkilib_src")
    if not os.path.isdir(os.path.join(source, "nkilib")):
        raise ValueError(f"--nki_library: {checkout!r} has no src/nkilib_src/nkilib folder")
    rng = np.random.default_rng(seed)
    results = []
    saved_path = list(sys.path)
    saved_modules = set(sys.modules)
    try:
        with emulator.as_nki():
            sys.path.insert(0, source)
            for case in cases or CASES:
                try:
                    got, expected, rtol, atol = case.run(importlib.import_module, rng)
                    results.append((case.name, compare_outputs(got, expected, rtol, atol)))
                except Exception as error:  # noqa: BLE001 - every failure is reported with its place
                    frames = traceback.extract_tb(error.__traceback__)
                    frame = frames[-1]
                    results.append(
                        (
                            case.name,
                            f"{type(error).__name__}: {error} (at {os.path.basename(frame.filename)}:{frame.lineno})",
                        )
                    )
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if name == "nkilib" or name.startswith(("nkilib.", "nkilib_src")):
                del sys.modules[name]
    return results
