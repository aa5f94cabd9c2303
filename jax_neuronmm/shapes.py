"""Argument checks and result types shared by the primitives.

Every public entry point validates here, before binding, so bad input fails with
a message that names the argument, what it got and what was expected.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jax_neuronmm._compat import is_tracer
from nki_kernels.decode import contract as decode_contract

COMPUTE_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)

# fp8 weights: Trainium's float8_e4m3 (±240) stored as float8_e4m3fn, whose bits agree within ±240
# (compress/quantize.py), with float32 scales. Arrays in float8_e4m3 (the format's own name in NKI and
# ml_dtypes) are taken too and reinterpreted bit for bit as the storage dtype (`fp8_storage`).
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
TRAINIUM_FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3)
FP8_MAX = 240.0
SCALE_DTYPE = np.dtype(np.float32)
FP8_RECIPE = "quantize with compress.quantize_fp8 (scale = max|w| / 240), not the OCP recipe max|w| / 448"


def is_fp8(dtype) -> bool:
    """Whether `dtype` is the fp8 weight storage dtype (float8_e4m3fn holding values within ±240)."""
    return np.dtype(dtype) == FP8_DTYPE


def fp8_storage(a):
    """`a` in the fp8 storage dtype when it is float8_e4m3 (Trainium's name of the format): the same bits
    reinterpreted as float8_e4m3fn, equal values within ±240 (float8_e4m3's inf and NaN become float8_e4m3fn
    values beyond ±240, which read as NaN: `fp8_read`). Any other array is returned as it is."""
    if np.dtype(a.dtype) != TRAINIUM_FP8_DTYPE:
        return a
    if isinstance(a, np.ndarray):
        return a.view(FP8_DTYPE)
    return lax.bitcast_convert_type(a, FP8_DTYPE)


def fp8_read(values):
    """fp8 storage values (numpy or JAX) as Trainium reads their bits: unchanged within ±240, NaN beyond (its
    float8_e4m3 reserves the top exponent for inf and NaN, and its kernels turn them into NaN outputs). The XLA
    lowerings and the emulator's operands both go through this, so a value beyond ±240 that only a traced call
    could not refuse (`check_fp8_contents`) gives NaN on every backend, as on the device. Arrays of any other
    dtype are returned as they are."""
    if not is_fp8(values.dtype):
        return values
    xp = np if isinstance(values, np.ndarray) else jnp
    inside = xp.abs(values.astype(np.float32)) <= FP8_MAX
    return xp.where(inside, values, xp.asarray(np.nan, FP8_DTYPE))


def check_fp8_contents(op, named):
    """A ValueError naming the first array of `named` (name -> array) whose values are known at trace time and
    bad: an fp8 (storage) array with values beyond ±240 or NaN, which Trainium's float8_e4m3 cannot hold (the
    device reads them as NaN), or a scale (any other float array) that is NaN or ±inf. Traced arrays are left to
    `fp8_read`. The counts are computed where the arrays live (one small jitted reduction), not on the host."""
    concrete = {name: a for name, a in named.items() if a is not None and not is_tracer(a)}
    if not concrete:
        return
    fp8 = {name: a for name, a in concrete.items() if is_fp8(a.dtype)}
    with jax.ensure_compile_time_eval():  # values, also while an enclosing function is traced
        counts = _fault_counts(fp8, {name: a for name, a in concrete.items() if name not in fp8})
    for name in concrete:
        count = counts[name]
        if int(count) == 0:
            continue
        values = np.asarray(concrete[name]).astype(np.float64).reshape(-1)
        if name in fp8:
            bad = values[~(np.abs(values) <= FP8_MAX)]
            raise ValueError(
                f"{op}: {name} holds {int(count)} fp8 value(s) beyond ±{FP8_MAX:g} or NaN (e.g. {bad[0]:g}), which "
                f"Trainium's float8_e4m3 cannot hold (the device reads them as NaN); {FP8_RECIPE}"
            )
        bad = values[~np.isfinite(values)]
        raise ValueError(
            f"{op}: {name} holds {int(count)} non-finite value(s) (e.g. {bad[0]:g}); expected finite scales"
        )


@jax.jit
def _fault_counts(fp8, scales):
    """{name: count of bad values} over fp8 storage arrays (beyond ±240 or NaN) and scales (NaN or ±inf)."""
    counts = {name: jnp.sum(~(jnp.abs(a.astype(jnp.float32)) <= FP8_MAX), dtype=jnp.int32) for name, a in fp8.items()}
    counts.update({name: jnp.sum(~jnp.isfinite(a), dtype=jnp.int32) for name, a in scales.items()})
    return counts


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
            raise TypeError(
                f"{op}: {scales} given with {names}; scales go with fp8 factors only ({FP8_DTYPE.name}, or "
                f"{TRAINIUM_FP8_DTYPE.name} with the same bits)"
            )
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


def checked_decode_operands(op, spec, operands):
    """`operands` (DecodeOperands of arrays) as JAX arrays, fp8 weight values in the storage dtype (`fp8_storage`),
    checked by `check_decode_operands` and, where known at call time, their fp8 values and scales by
    `check_fp8_contents` (named by their place, e.g. "gate.u" or "head.scale")."""
    ops = check_decode_operands(op, spec, jax.tree_util.tree_map(lambda a: fp8_storage(jnp.asarray(a)), operands))
    named = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(ops)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        if is_fp8(leaf.dtype) or name.endswith("scale"):
            named[name] = leaf
    check_fp8_contents(op, named)
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
