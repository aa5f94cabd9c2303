"""DMA on the CPU: `dma_copy` and `dma_transpose` between HBM and SBUF (casts, out-of-bounds modes, DGE modes,
queue priorities), with the per-transfer facts the cost model prices (trace.DmaInfo)."""

from __future__ import annotations

import numpy as np

from . import context
from .isa_constants import dge_mode, engine, oob_mode
from .isa_core import (
    _fail,
    _free,
    _on_chip,
    _record,
    _tensor,
    _write,
)
from .trace import DmaInfo

_Engine = engine  # instructions take a parameter named `engine`
_OobMode = oob_mode  # ... `oob_mode`
_DgeMode = dge_mode  # ... `dge_mode`


def _dma_info(dst, src, transpose=False):
    hbm_side = [t for t in (src, dst) if t.storage.kind == "hbm"] or [dst]
    return DmaInfo(
        nbytes=dst.size * dst.dtype.itemsize,
        src_buffer=src.storage.kind,
        dst_buffer=dst.storage.kind,
        contiguous_bytes=min(t.contiguous_bytes() for t in hbm_side),
        transpose=transpose,
        src_nbytes=src.size * src.dtype.itemsize,
    )


def _dma_partitions(dst, src):
    on_chip = dst if dst.storage.kind != "hbm" else src if src.storage.kind != "hbm" else None
    return (on_chip.shape[0], _free(on_chip)) if on_chip is not None else (1, dst.size)


def _dma_options(opcode, line, ctx, priority, mode, allowed_modes):
    """priority exists from NeuronCore-v4 (trn3) on; hardware DGE from NeuronCore-v3 (trn2) on."""
    if priority is not None:
        _fail(opcode, line, f"priority={priority!r}: DMA priority is NeuronCore-v4+ only, not {ctx.target}")
    if isinstance(mode, int) and not isinstance(mode, bool) and mode in {m.value for m in _DgeMode}:
        mode = _DgeMode(mode)  # kernels may pass the enum's value (nki-library writes dge_mode=3 for none)
    if not isinstance(mode, _DgeMode) or mode not in allowed_modes:
        _fail(opcode, line, f"dge_mode {mode!r} is not valid here; expected one of {[m.name for m in allowed_modes]}")
    if mode is _DgeMode.hwdge and ctx.target == "trn1":
        _fail(opcode, line, "dge_mode=hwdge (hardware DGE) needs NeuronCore-v3 or newer, not trn1")
    return mode


def dma_copy(
    dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, engine=engine.unknown, name=None
):
    """dst = src by DMA (HBM/SBUF either side); dtypes convert through float32; element counts must match.

    `engine` (sync or scalar) picks the engine that generates hardware-DGE descriptors, so it is valid only
    with dge_mode=hwdge.
    """
    opcode = "dma_copy"
    ctx = context.current(opcode)
    line = context.caller_line()
    _tensor(opcode, line, "dst", dst)
    _tensor(opcode, line, "src", src)
    dge_mode = _dma_options(opcode, line, ctx, priority, dge_mode, tuple(_DgeMode))
    if engine is not None and engine is not _Engine.unknown:
        if dge_mode is not _DgeMode.hwdge:
            _fail(opcode, line, f"engine={engine!r} is only valid with dge_mode=hwdge")
        if engine not in (_Engine.sync, _Engine.scalar):
            _fail(opcode, line, f"engine={engine!r}: hardware DGE descriptors come from engine.sync or engine.scalar")
    for label, t in (("dst", dst), ("src", src)):
        if t.storage.kind == "psum":
            _fail(opcode, line, f"{label} {t.describe()}: DMA cannot access PSUM (use nisa.tensor_copy)")
        if t.storage.kind == "sbuf" and t.shape[0] > context.PMAX:
            _fail(opcode, line, f"{label} {t.describe()} spans {t.shape[0]} partitions, over {context.PMAX}")
    if dst.size != src.size:
        _fail(
            opcode,
            line,
            f"element counts differ: dst {dst.describe()} has {dst.size}, src {src.describe()} has {src.size}",
        )
    if dge_mode is _DgeMode.hwdge and dst.dtype != src.dtype:
        _fail(
            opcode,
            line,
            f"dge_mode=hwdge moves raw bytes: src {src.dtype.name} and dst {dst.dtype.name} must "
            f"have the same dtype (reinterpret with .view(), or use swdge / none to cast)",
        )
    if not isinstance(oob_mode, _OobMode):
        _fail(opcode, line, f"oob_mode {oob_mode!r} must be a nisa.oob_mode")
    if ctx.numerics:
        if (src.oob is not None or dst.oob is not None) and oob_mode is _OobMode.skip:
            # Out-of-bounds indirect elements are skipped: their dst elements keep their values.
            keep = np.ones(dst.size, dtype=bool)
            for t in (src, dst):
                if t.oob is not None:
                    keep &= ~t.oob.reshape(-1)
            values = src.gathered() if src.gather is not None else src.array()
            current = dst.gathered() if dst.gather is not None else dst.array()
            values = (
                np.where(keep, values.reshape(-1).astype(np.float32), current.reshape(-1).astype(np.float32))
                if values.dtype != dst.dtype
                else np.where(keep, values.reshape(-1), current.reshape(-1))
            )
            _write(dst, values)
        else:
            values = src.array()
            if values.dtype != dst.dtype:
                values = values.astype(np.float32)
            _write(dst, values)
    partitions, free = _dma_partitions(dst, src)
    _record(ctx, opcode, "dma", line, dst, (src,), dma=_dma_info(dst, src), partitions=partitions, free=free)


_DMA_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def _hwdge_transpose_limits(opcode, line, src):
    first, last = src.shape[0], src.shape[-1]
    if src.ndim == 2 and first != 16:
        _fail(opcode, line, f"hardware-DGE transpose of a 2-D src needs src.shape[0] == 16, got {first}")
    if src.ndim > 2 and (first not in (1, 2, 4, 8, 16) or (first * src.shape[-2]) % 16):
        _fail(
            opcode,
            line,
            f"hardware-DGE transpose of a {src.ndim}-D src needs src.shape[0] in {{1, 2, 4, 8, 16}} "
            f"and src.shape[0] * src.shape[-2] a multiple of 16, got {list(src.shape)}",
        )
    if last > 128:
        _fail(opcode, line, f"hardware-DGE transpose needs src.shape[-1] <= 128, got {last}")
    if src.dtype.itemsize != 2:
        _fail(opcode, line, f"hardware-DGE transpose needs a 2-byte dtype, got {src.dtype.name}")


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None):
    """dst = src permuted ((1,0), (2,1,0) or (3,1,2,0)) by DMA; dst in SBUF, src in HBM or SBUF, same dtype."""
    opcode = "dma_transpose"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "dst", dst, kinds=("sbuf",), compute_engine=False)
    _tensor(opcode, line, "src", src)
    # Direct transposes lower to unknown or hardware DGE, indirect ones (a vector_offset src) to software DGE.
    indirect = src.gather is not None
    allowed = (_DgeMode.unknown, _DgeMode.swdge) if indirect else (_DgeMode.unknown, _DgeMode.hwdge)
    dge_mode = _dma_options(opcode, line, ctx, priority, dge_mode, allowed)
    if src.storage.kind == "psum":
        _fail(opcode, line, f"src {src.describe()} must be in HBM or SBUF")
    default = _DMA_TRANSPOSE_AXES.get(src.ndim)
    if default is None:
        _fail(opcode, line, f"src {src.describe()} must be 2-D, 3-D or 4-D")
    axes = default if axes is None else tuple(axes)
    if axes != default:
        _fail(opcode, line, f"axes {axes} unsupported for a {src.ndim}-D src; expected {default}")
    if dst.dtype != src.dtype:
        _fail(opcode, line, f"dst dtype {dst.dtype.name} must equal src dtype {src.dtype.name}")
    expected = tuple(src.shape[a] for a in axes)
    if dst.shape != expected:
        _fail(
            opcode,
            line,
            f"dst {dst.describe()} must have shape {list(expected)} (src {list(src.shape)} permuted by {axes})",
        )
    if dge_mode is _DgeMode.hwdge:
        _hwdge_transpose_limits(opcode, line, src)
    if indirect:
        _indirect_transpose_limits(opcode, line, ctx, src)
    if ctx.numerics:
        _write(dst, np.transpose(src.array(), axes))
    _record(ctx, opcode, "dma", line, dst, (src,), dma=_dma_info(dst, src, transpose=True))


def _indirect_transpose_limits(opcode, line, ctx, src):
    """The documented limits of a gathering transpose (dma_gather_transpose, software DGE): NeuronCore-v3+, a
    2-byte src in HBM of a multiple of 16 rows, gathered by a uint32 index tile in SBUF of 16..128 rows (a
    multiple of 16); src.shape[-1] <= 128 holds already, as the transposed dst's partition count."""
    if ctx.target == "trn1":
        _fail(opcode, line, "an indirect (gathering) transpose needs NeuronCore-v3 or newer, not trn1")
    index = src.index
    checks = (
        (src.storage.kind == "hbm", f"src {src.describe()} must be in HBM"),
        (src.dtype.itemsize == 2, f"src dtype must be 2 bytes, got {src.dtype.name}"),
        (src.shape[0] % 16 == 0, f"src.shape[0] must be a multiple of 16, got {src.shape[0]}"),
        (src.ndim != 4 or 1 in src.shape[1:3], f"a 4-D src needs shape[1] or shape[2] == 1, got {list(src.shape)}"),
        (index.dtype == np.uint32, f"index tile {index.describe()} must be uint32"),
        (index.storage.kind == "sbuf", f"index tile {index.describe()} must be in SBUF"),
        (
            index.ndim == 2 and 16 <= index.shape[0] <= 128 and index.shape[0] % 16 == 0,
            f"index tile {index.describe()} must be 2-D with 16..128 rows, a multiple of 16",
        ),
    )
    for ok, message in checks:
        if not ok:
            _fail(opcode, line, f"indirect transpose: {message}")
