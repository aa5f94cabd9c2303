"""A decode step over all layers run on the emulator as one of the compositions: `run_decode_step(composition, ...)`.

The kernels live in nki_kernels.decode.compositions, whose docstring describes them; the operands are
nki_kernels.decode.contract's. This runner is apart from them because kernel modules never import the emulator.

Each kernel launch is one emulated run (one row of `emulator.profile()`); activations cross HBM between launches
as numpy arrays. With numerics=False the launches are count-only traces and operands may be emulator `Spec`
placeholders (shape and dtype, no memory), so full-size models trace without their weights.
"""

from __future__ import annotations

import contextlib

import numpy as np

from nki_kernels.decode import attention
from nki_kernels.decode.compositions import (
    COMPOSITIONS,
    MLP_PROJECTIONS,
    add_kernel,
    check_spec,
    decode_step_kernel,
    decoder_layer_kernel,
    head_kernel,
    lm_head_kernel,
    norm_kernel,
    projection_kernel,
)
from nki_kernels.decode.contract import DecodeOperands, check_write_index, kernel_arg
from nki_kernels.emulator import count_only
from nki_kernels.emulator.kernel import Spec, run
from nki_kernels.gated_activation import gated_activation_kernel
from nki_kernels.svd_mlp import svd_mlp_down_kernel, svd_mlp_gate_up_kernel

__all__ = ["COMPOSITIONS", "run_decode_step"]


def _factor_slice(tensor, layer, rank, axis):
    """Layer `layer` of stacked factor `tensor`, cut to `rank` along axis (1: u's columns, 0: v's rows or a rank
    scale's entries; None: whole), as a standalone array (or a count-only Spec placeholder) for kernels that take
    exact factors."""
    if isinstance(tensor, Spec):
        shape = list(tensor.shape[1:])
        if axis is not None:
            shape[axis] = rank
        return Spec(shape, tensor.dtype)
    part = tensor[layer]
    return np.ascontiguousarray(part if axis is None else part[:, :rank] if axis == 1 else part[:rank])


def run_decode_step(composition, operands, spec, *, numerics=True, ring_block_bytes=None, ring_bytes=None):
    """Run one decode step as `composition` (one of COMPOSITIONS) on the emulator: (logits [B, T, V] float32,
    k_cache, v_cache). operands: numpy arrays as in the module docstring (lists for factors), or emulator
    `Spec` placeholders with numerics=False (a count-only trace: no weight memory, NaN-filled results)."""
    if composition not in COMPOSITIONS:
        raise ValueError(f"composition: got {composition!r}, expected one of {COMPOSITIONS}")
    check_spec(spec)
    ring = dict(ring_block_bytes=ring_block_bytes, ring_bytes=ring_bytes)
    ops = DecodeOperands.of(operands, spec)
    if isinstance(ops.write_index, np.ndarray):
        check_write_index("run_decode_step", ops.write_index, slots=ops.k_cache.shape[2], tokens=ops.x.shape[1])
    with contextlib.nullcontext() if numerics else count_only():
        if composition == "looped":
            return _launch(decode_step_kernel, ops.kernel_args(), spec=spec, **ring)
        if composition == "per_layer":
            x, k_cache, v_cache = ops.x, ops.k_cache, ops.v_cache
            for layer in range(spec.num_layers):
                layer_ops = ops.replace(x=x, k_cache=k_cache, v_cache=v_cache, final_norm=None, head=None)
                x, k_cache, v_cache = _launch(
                    decoder_layer_kernel, layer_ops.kernel_args(), spec=spec, layer=layer, **ring
                )
            head = kernel_arg(ops.head)
            return _launch(lm_head_kernel, x, ops.final_norm, head, spec=spec, **ring), k_cache, v_cache
        return _run_per_op(composition == "per_op_svd_mlp", ops, spec, ring)


def _run_per_op(svd_mlp, ops, spec, ring):
    b, t, h_features = ops.x.shape
    rows = b * t
    model = np.dtype(ops.x.dtype).name
    x = (
        np.asarray(ops.x).reshape(rows, h_features)
        if isinstance(ops.x, np.ndarray)
        else _spec_like(ops.x, (rows, h_features))
    )
    k_cache, v_cache = ops.k_cache, ops.v_cache
    weights = ops.weights

    def norm(src, layer, j, out_dtype):
        return _launch(norm_kernel, src, ops.norms, index=(layer, j), spec=spec, out_dtype=out_dtype)

    def projection_launch(src, name, layer, out_dtype):
        return _launch(
            projection_kernel,
            src,
            kernel_arg(weights[name]),
            layer=layer,
            rank=spec.rank(name, layer),
            out_dtype=out_dtype,
            **ring,
        )

    for layer in range(spec.num_layers):
        h = norm(x, layer, 0, model)
        q, k, v = (projection_launch(h, name, layer, model) for name in ("q", "k", "v"))
        q, k = _launch(
            attention.rope_kernel,
            q.reshape(b, t, -1),
            k.reshape(b, t, -1),
            ops.cos,
            ops.sin,
            ops.qk_norms,
            layer=layer,
            spec=spec,
        )
        k_cache, v_cache = _launch(
            attention.cache_write_kernel,
            k,
            v.reshape(b, t, -1),
            k_cache,
            v_cache,
            ops.write_index,
            layer=layer,
        )
        attn = _launch(
            attention.attention_kernel,
            q,
            k_cache,
            v_cache,
            ops.write_index,
            ops.mask_bias,
            layer=layer,
            spec=spec,
        )
        y = projection_launch(attn.reshape(rows, -1), "o", layer, "float32")
        if spec.sandwich:
            y = norm(y, layer, 1, "float32")
        x = _launch(add_kernel, x, y)
        h = norm(x, layer, 2 if spec.sandwich else 1, model)
        factored = all(spec.rank(name, layer) is not None for name in MLP_PROJECTIONS)
        if svd_mlp and factored:
            # Each factor of layer `layer` cut to its rank: u's columns, v's rows, u_scale's entries (fp8).
            cuts = {"u": 1, "v": 0, "u_scale": 0, "v_scale": None}
            parts = {
                name: {
                    part: _factor_slice(tensor, layer, spec.rank(name, layer), cuts[part])
                    for part, tensor in weights[name].parts().items()
                }
                for name in MLP_PROJECTIONS
            }
            gate, up, down = (parts[name] for name in MLP_PROJECTIONS)
            # The kernels' order: the four factors, then (fp8) their scales.
            gate_up = [gate["u"], gate["v"], up["u"], up["v"]]
            gate_up += [p[scale] for p in (gate, up) for scale in ("u_scale", "v_scale") if scale in p]
            hT = _launch(svd_mlp_gate_up_kernel, h, *gate_up, activation=spec.activation)
            m = _launch(svd_mlp_down_kernel, hT, *down.values())
        else:
            gate, up = projection_launch(h, "gate", layer, model), projection_launch(h, "up", layer, model)
            hidden = _launch(gated_activation_kernel, gate, up, activation=spec.activation)
            m = projection_launch(hidden, "down", layer, "float32")
        if spec.sandwich:
            m = norm(m, layer, 3, "float32")
        x = _launch(add_kernel, x, m)
    h = _launch(norm_kernel, x, ops.final_norm, index=(), spec=spec, out_dtype=model)
    logits = _launch(head_kernel, h, kernel_arg(ops.head), spec=spec, **ring)
    return logits.reshape(b, t, spec.vocab), k_cache, v_cache


def _launch(kernel, *args, **kwargs):
    """One emulated launch (numpy arrays or count-only Spec placeholders as tensor arguments)."""
    return run(kernel, args, kwargs)


def _spec_like(placeholder, shape):
    return Spec(shape, placeholder.dtype)
