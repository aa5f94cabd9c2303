"""TensorE on the CPU: `nc_matmul` (PE-array tiling, PSUM accumulation rules, fp8 and transposing modes) and
`nc_transpose`, with the checks and trace records every instruction shares (isa_core)."""

from __future__ import annotations

import numpy as np

from . import context, dtypes
from .isa_constants import engine, matmul_perf_mode
from .isa_core import (
    _engine_name,
    _fail,
    _free,
    _mark_psum,
    _on_chip,
    _record,
    _write,
)
from .tensor import PSUM_BY_MATMUL, PSUM_BY_OTHER
from .trace import MatmulInfo


def _psum_bank_check(opcode, line, dst):
    access = dst.access()
    if access.b_start // context.PSUM_BANK_BYTES != (access.b_stop - 1) // context.PSUM_BANK_BYTES:
        _fail(
            opcode,
            line,
            f"dst {dst.describe()} covers PSUM bytes {access.b_start}..{access.b_stop} of each "
            f"partition, crossing a 2 KiB bank boundary (one output tile must fit one bank)",
        )


# PE-array tile sizes for row/column tiling mode: halves from NeuronCore-v2, quarters from NeuronCore-v3.
_PE_TILE_SIZES = {"trn1": (128, 64), "trn2": (128, 64, 32)}
_FP8 = (dtypes.float8_e4m3, dtypes.float8_e5m2)


def _matmul_tiling(opcode, line, ctx, tile_position, tile_size, double_row):
    """(row limit, column limit) of the PE array this matmul may use."""
    if bool(tile_position) != bool(tile_size):
        _fail(
            opcode,
            line,
            f"tile_position={tile_position!r} and tile_size={tile_size!r}: both must be set to "
            f"enable tiling mode (or neither)",
        )
    if not tile_size:
        return context.PMAX, context.PMAX
    if len(tile_size) != 2 or len(tile_position) != 2:
        _fail(
            opcode, line, f"tile_position {tile_position!r} and tile_size {tile_size!r} must be 2-tuples (row, column)"
        )
    allowed = _PE_TILE_SIZES[ctx.target]
    for what, size, start in (("row", tile_size[0], tile_position[0]), ("column", tile_size[1], tile_position[1])):
        if size not in allowed:
            _fail(opcode, line, f"{what} tile size {size} unsupported on {ctx.target}; expected one of {allowed}")
        if start % size or not 0 <= start < context.PMAX:
            _fail(
                opcode,
                line,
                f"start {what} {start} must be a multiple of the {what} tile size {size} below {context.PMAX}",
            )
    if double_row and tile_size[1] != context.PMAX:
        _fail(opcode, line, "perf_mode=double_row cannot be combined with column tiling")
    return int(tile_size[0]), int(tile_size[1])


def _accumulate_mask(opcode, line, dst, state, accumulate):
    """None: overwrite everywhere; True: add everywhere; else a boolean array of the locations that add."""
    if accumulate is None:
        if np.count_nonzero(state == PSUM_BY_OTHER):
            _fail(
                opcode,
                line,
                f"dst {dst.describe()}: PSUM holding a nonzero value written by a non-matmul "
                f"instruction (memset, tensor_copy, ...) cannot be accumulated onto (undefined on "
                f"trn1/trn2); pass accumulate=False to overwrite",
            )
        written = state == PSUM_BY_MATMUL
        n_written = np.count_nonzero(written)
        return None if n_written == 0 else (True if n_written == written.size else written)
    if accumulate:
        if np.count_nonzero(state == PSUM_BY_MATMUL) != state.size:
            _fail(
                opcode,
                line,
                f"accumulate=True onto dst {dst.describe()} whose PSUM locations were not first "
                f"written by nc_matmul (undefined on trn1/trn2)",
            )
        return True
    return None


def _transpose_exact(stationary, moving):
    """stationary.T @ moving when moving only routes values (0/1 with at most one 1 per column), exactly:
    bit-accurate transpose mode, where NaN/Inf are moved rather than multiplied by zero. None otherwise."""
    ones = moving == 1
    if not np.all(ones | (moving == 0)) or np.any(np.count_nonzero(ones, axis=0) > 1):
        return None
    picked = stationary[np.argmax(ones, axis=0)].T
    return np.where(ones.any(axis=0), picked, np.float32(0))


def nc_matmul(
    dst,
    stationary,
    moving,
    is_stationary_onezero=False,
    is_moving_onezero=False,
    is_transpose=False,
    accumulate=None,
    tile_position=(),
    tile_size=(),
    perf_mode=matmul_perf_mode.none,
    name=None,
):
    """dst[M, N] (PSUM, fp32) = stationary[K, M].T @ moving[K, N]; K <= 128, M <= 128, N <= 512.

    accumulate=False overwrites, True adds onto a location written by an earlier matmul, None decides per
    location (first matmul write overwrites, later ones add; PSUM zeroed by nl.zeros / memset(0) counts as not
    yet written, as in AWS's PSUM-accumulation pattern). Adding onto PSUM never written by a matmul, or holding
    a value another instruction wrote (memset, tensor_copy, ...), is undefined on trn1/trn2 and raises.
    tile_position/tile_size select a sub-array of the 128x128 PEs (row/column tiling mode).
    perf_mode=double_row (trn2, fp8 inputs): operands are [K, 2, M] and [K, 2, N]; the contraction runs over
    both K and the pair dimension. is_transpose=True on trn2 moves values bit-accurately (NaN/Inf survive).
    """
    opcode = "nc_matmul"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "stationary", stationary, kinds=("sbuf",))
    _on_chip(opcode, line, "moving", moving, kinds=("sbuf",))
    _on_chip(opcode, line, "dst", dst, kinds=("psum",))
    if not isinstance(perf_mode, matmul_perf_mode):
        _fail(opcode, line, f"perf_mode {perf_mode!r} must be a nisa.matmul_perf_mode")
    double_row = perf_mode is matmul_perf_mode.double_row
    row_limit, column_limit = _matmul_tiling(opcode, line, ctx, tile_position, tile_size, double_row)
    contraction = stationary.shape[0]
    if moving.shape[0] != contraction:
        _fail(
            opcode,
            line,
            f"stationary {stationary.describe()} and moving {moving.describe()} must have the same "
            f"partition (contraction) size",
        )
    if double_row:
        stationary_free, moving_free = _double_row_free(opcode, line, ctx, stationary, moving)
    else:
        stationary_free, moving_free = _free(stationary), _free(moving)
    if contraction > row_limit:
        _fail(opcode, line, f"contraction (partition) size {contraction} exceeds {row_limit}")
    if stationary_free > column_limit:
        _fail(
            opcode,
            line,
            f"stationary free size {stationary_free} exceeds {column_limit} (nl.tile_size.gemm_stationary_fmax)",
        )
    if moving_free > 512:
        _fail(opcode, line, f"moving free size {moving_free} exceeds 512 (nl.tile_size.gemm_moving_fmax)")
    if dst.shape[0] != stationary_free or _free(dst) != moving_free:
        _fail(
            opcode,
            line,
            f"dst {dst.describe()} must be [{stationary_free}, {moving_free}] (stationary free x moving free)",
        )
    _check_matmul_dtypes(opcode, line, dst, stationary, moving, is_transpose)
    _psum_bank_check(opcode, line, dst)
    state = dst.psum_state()
    accumulate_mask = _accumulate_mask(opcode, line, dst, state, accumulate)
    if ctx.numerics:
        lhs = stationary.array().reshape(-1, stationary_free).astype(np.float32)
        rhs = moving.array().reshape(-1, moving_free).astype(np.float32)
        product = _transpose_exact(lhs, rhs) if is_transpose and ctx.target != "trn1" else None
        if product is None:
            product = lhs.T @ rhs
        if accumulate_mask is not None:
            current = dst.array().reshape(product.shape).astype(np.float32)
            product = (
                current + product
                if accumulate_mask is True
                else np.where(accumulate_mask.reshape(product.shape), current + product, product)
            )
        _write(dst, product)
    state[...] = PSUM_BY_MATMUL
    info = MatmulInfo(contraction, stationary_free, moving_free, dtypes.NAME[moving.dtype], bool(is_transpose))
    _record(
        ctx, opcode, "tensor", line, dst, (stationary, moving), matmul=info, partitions=contraction, free=moving_free
    )


def _double_row_free(opcode, line, ctx, stationary, moving) -> tuple[int, int]:
    """(stationary free, moving free) of a double_row matmul (trn2, fp8 operands [K, 2, ...]): half the free size,
    the pair dimension being the second half of the contraction."""
    if ctx.target == "trn1":
        _fail(opcode, line, "perf_mode=double_row is not supported on NeuronCore-v2 (trn1)")
    for label, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in _FP8:
            _fail(
                opcode,
                line,
                f"perf_mode=double_row: {label} dtype {t.dtype.name} must be float8_e4m3 or float8_e5m2",
            )
        if t.ndim < 3 or t.shape[1] != 2:
            _fail(
                opcode,
                line,
                f"perf_mode=double_row: {label} {t.describe()} must be [K, 2, ...] (the "
                f"first free dimension holds the second half of the contraction)",
            )
    return _free(stationary) // 2, _free(moving) // 2


def _check_matmul_dtypes(opcode, line, dst, stationary, moving, is_transpose) -> None:
    """TensorE input types, fp32 on both sides or neither, and an fp32 dst (a transpose may keep its input's)."""
    for label, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in dtypes.MATMUL_INPUT and not is_transpose:
            _fail(
                opcode,
                line,
                f"{label} dtype {t.dtype.name} is not a TensorE input type "
                f"(float8_e4m3, float8_e5m2, bfloat16, float16, tfloat32, float32)",
            )
    if (stationary.dtype == dtypes.float32) != (moving.dtype == dtypes.float32) and not is_transpose:
        _fail(
            opcode,
            line,
            f"stationary {stationary.dtype.name} and moving {moving.dtype.name}: if one operand is "
            f"float32 the other must be too",
        )
    if dst.dtype != dtypes.float32 and not (is_transpose and dst.dtype == stationary.dtype):
        _fail(opcode, line, f"dst dtype {dst.dtype.name} must be float32 on trn1/trn2")


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """dst[F, P] = data[P, F] (free dims flattened); TensorE: SBUF -> PSUM, <= 128x128; VectorE: <= 32x32."""
    opcode = "nc_transpose"
    ctx = context.current(opcode)
    line = context.caller_line()
    _on_chip(opcode, line, "data", data)
    _on_chip(opcode, line, "dst", dst)
    if engine is engine.unknown or engine is None:
        engine_name = "tensor" if (dst.storage.kind == "psum" and data.storage.kind == "sbuf") else "vector"
    else:
        engine_name = _engine_name(engine, "tensor", opcode, line, ("tensor", "vector"))
    rows, cols = data.shape[0], _free(data)
    limit = 128 if engine_name == "tensor" else 32
    if rows > limit or cols > limit:
        _fail(
            opcode,
            line,
            f"data {data.describe()} is {rows}x{cols}, over the {limit}x{limit} that {engine_name} engine transposes",
        )
    if engine_name == "tensor" and (data.storage.kind != "sbuf" or dst.storage.kind != "psum"):
        _fail(opcode, line, "Tensor Engine transpose reads SBUF and writes PSUM")
    if dst.shape[0] != cols or _free(dst) != rows:
        _fail(opcode, line, f"dst {dst.describe()} must be [{cols}, {rows}] for data {data.describe()}")
    if dst.dtype != data.dtype:
        _fail(opcode, line, f"dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name}")
    if engine_name == "tensor":
        _psum_bank_check(opcode, line, dst)
    if ctx.numerics:
        a = data.array()
        a = a.reshape(a.shape[0], -1)
        if (
            engine_name == "tensor"
            and ctx.target == "trn1"
            and dtypes.is_float(a.dtype)
            and not np.isfinite(a.astype(np.float32)).all()
        ):
            # NeuronCore-v2 transposes as a real matmul with an identity: NaN/Inf times 0 spoils whole rows.
            with np.errstate(invalid="ignore"):
                a = a.astype(np.float32).T @ np.eye(a.shape[0], dtype=np.float32)
        else:
            a = a.T
        _write(dst, a)
    _mark_psum(dst, PSUM_BY_MATMUL if engine_name == "tensor" else PSUM_BY_OTHER)
    # TensorE transposes as a matmul with `data` [rows, cols] as the stationary operand and a [rows, rows]
    # identity as the moving one (nc_transpose docstring; architecture guide, TensorE alternative use).
    info = MatmulInfo(rows, cols, rows, dtypes.NAME[data.dtype], True) if engine_name == "tensor" else None
    _record(ctx, opcode, engine_name, line, dst, (data,), matmul=info)
