"""Argument checks and result types shared by the primitives.

Every public entry point validates here, before binding, so bad input fails with
a message that names the argument, what it got and what was expected.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from nki_kernels.decode import contract as decode_contract

COMPUTE_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)

# fp8 weights: Trainium's float8_e4m3 (±240) stored as float8_e4m3fn, whose bits agree within ±240
# (compress/quantize.py), with float32 scales.
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 240.0
SCALE_DTYPE = np.dtype(np.float32)


def is_fp8(dtype) -> bool:
    """Whether `dtype` is the fp8 weight storage dtype (float8_e4m3fn holding values within ±240)."""
    return np.dtype(dtype) == FP8_DTYPE


def _dtype_names():
    return ", ".join(np.dtype(d).name for d in COMPUTE_DTYPES)


def check_float_dtypes(op, named):
    """All arrays in `named` (name -> array) share one supported float dtype."""
    for name, arr in named.items():
        if np.dtype(arr.dtype) not in [np.dtype(d) for d in COMPUTE_DTYPES]:
            raise TypeError(
                f"{op}: {name} has dtype {np.dtype(arr.dtype).name}; expected a float dtype ({_dtype_names()})"
            )
    dtypes = {name: np.dtype(arr.dtype) for name, arr in named.items()}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}={d.name}" for n, d in dtypes.items())
        raise TypeError(f"{op}: arguments must share one dtype, got {listing}; cast them first")


def check_scaled_factors(op, factors):
    """Dtypes and shapes of fp8 factor pairs and their scales, before binding.

    factors: [(u_name, u, v_name, v, u_scale, v_scale)] for each low-rank pair (u [K, r], v [r, N], already
    checked as matrices). A pair is either float (x's dtype, scales None) or fp8: both factors float8_e4m3fn
    with float32 scales u_scale [r] and v_scale [N]. Returns True when the pairs are fp8, False when float;
    mixing the two across pairs is an error.
    """
    kinds = []
    for u_name, u, v_name, v, u_scale, v_scale in factors:
        fp8 = {u_name: is_fp8(u.dtype), v_name: is_fp8(v.dtype)}
        given = {f"{u_name}_scale": u_scale is not None, f"{v_name}_scale": v_scale is not None}
        if not any(fp8.values()) and not any(given.values()):
            kinds.append(False)
            continue
        if not all(fp8.values()):
            names = ", ".join(f"{n}={np.dtype(a.dtype).name}" for n, a in ((u_name, u), (v_name, v)))
            if any(fp8.values()):
                raise TypeError(f"{op}: {names}; fp8 factors come in pairs: both {FP8_DTYPE.name}, or neither")
            scales = " and ".join(n for n, g in given.items() if g)
            raise TypeError(f"{op}: {scales} given with {names}; scales go with {FP8_DTYPE.name} factors only")
        missing = [n for n, g in given.items() if not g]
        if missing:
            raise TypeError(
                f"{op}: {u_name} and {v_name} are {FP8_DTYPE.name}; {' and '.join(missing)} "
                f"(float32 per-column scales) must be given"
            )
        for name, scale, length, of in (
            (f"{u_name}_scale", u_scale, u.shape[1], f"{u_name}.shape[1] (rank r)"),
            (f"{v_name}_scale", v_scale, v.shape[1], f"{v_name}.shape[1]"),
        ):
            if np.dtype(scale.dtype) != SCALE_DTYPE:
                raise TypeError(f"{op}: {name} has dtype {np.dtype(scale.dtype).name}; expected float32")
            if tuple(scale.shape) != (length,):
                raise ValueError(f"{op}: {name} has shape {tuple(scale.shape)}; expected ({length},) = [{of}]")
        kinds.append(True)
    if len(set(kinds)) > 1:
        raise TypeError(f"{op}: either every factor pair is {FP8_DTYPE.name} with scales, or none is")
    return kinds[0]


def check_matrix(op, name, arr, rows=None, rows_from=None):
    """`arr` is 2-D; when `rows` is given its first dim must equal it."""
    if arr.ndim != 2:
        raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(arr.shape)}")
    if rows is not None and arr.shape[0] != rows:
        raise ValueError(f"{op}: {name} has shape {tuple(arr.shape)}; its first dim must equal {rows_from} = {rows}")


def check_activations(op, name, x):
    if x.ndim < 1:
        raise ValueError(f"{op}: {name} must have at least 1 dim [..., features], got a scalar")


def result_dtype(op, input_dtype, preferred_element_type):
    if preferred_element_type is None:
        return np.dtype(input_dtype)
    dtype = np.dtype(preferred_element_type)
    if dtype not in [np.dtype(d) for d in COMPUTE_DTYPES]:
        raise TypeError(f"{op}: preferred_element_type={dtype.name} is not supported; expected one of {_dtype_names()}")
    if dtype == np.float64 and not jax.config.jax_enable_x64:
        raise TypeError(f"{op}: preferred_element_type=float64 needs 64-bit mode (jax_enable_x64); it is off")
    return dtype


def canonical_precision(op, precision):
    """None, a lax.Precision, its name, or a pair of them -> a hashable value."""
    if precision is None or isinstance(precision, lax.Precision):
        return precision
    if isinstance(precision, str):
        try:
            return lax.Precision(precision)
        except ValueError as err:
            raise ValueError(f"{op}: precision={precision!r} is not a lax.Precision name") from err
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
        return tuple(canonical_precision(op, p) for p in precision)
    raise ValueError(f"{op}: precision must be None, a lax.Precision, its name or a pair; got {precision!r}")


def accumulation_dtype(input_dtype):
    """float32 accumulation (what PSUM does) except for float64 inputs."""
    return np.dtype(np.float64) if np.dtype(input_dtype) == np.float64 else np.dtype(np.float32)


def check_decode_operands(op, spec, operands):
    """`operands` (nki_kernels.decode.DecodeOperands of arrays or abstract values) once they follow the decode
    step's contract for `spec` (fp8 weight values in FP8_DTYPE): a ValueError / TypeError naming the operand
    otherwise. A concrete write_index is also checked against the cache (`decode_contract.check_write_index`), as
    are a paged step's concrete lengths and block table (`decode_contract.check_lengths`); traced ones are checked
    when the step runs."""
    ops = decode_contract.check(spec, operands, op, fp8_dtype=FP8_DTYPE)
    index = concrete_value(ops.write_index)
    if index is not None:
        decode_contract.check_write_index(op, index, slots=ops.k_cache.shape[2], tokens=ops.x.shape[1])
    lengths, table = concrete_value(ops.lengths), concrete_value(ops.block_table)
    if lengths is not None and table is not None:
        blocks = dict(block_size=spec.block_size, num_blocks=ops.k_cache.shape[1])
        decode_contract.check_lengths(op, lengths, table, **blocks)
    return ops


def concrete_value(x):
    """`x` as a numpy array when its value is known at trace time (a numpy or concrete JAX array), else None (a
    tracer or an abstract value)."""
    if not isinstance(x, (np.ndarray, jax.Array)):
        return None
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None
