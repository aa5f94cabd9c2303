"""The operators NKI names (nl.add, nl.exp, ...) and their float32 numpy meaning.

Each nl operator is a callable (the high-level tile function) that also serves as the `op` argument of
ISA instructions; `lookup` maps it back to numpy. Engines compute in float32, so these run on float32.
"""

import numpy as np

_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))


def _erf(x):
    # Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, below float32 resolution of erf near 1).
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return (sign * (1.0 - poly * np.exp(-a * a))).astype(x.dtype, copy=False)


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def _gelu(x):
    return 0.5 * x * (1.0 + _erf(x / np.float32(np.sqrt(2.0))))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + np.float32(0.044715) * x * x * x)))


def _gelu_dx(x):
    return 0.5 * (1.0 + _erf(x / np.float32(np.sqrt(2.0)))) + x * np.exp(-0.5 * x * x) / np.float32(np.sqrt(2 * np.pi))


def _softplus(x):
    return np.logaddexp(np.float32(0), x)


UNARY = {
    "copy": lambda x: x,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "reciprocal": lambda x: 1.0 / x,
    "tanh": np.tanh,
    "sigmoid": _sigmoid,
    "relu": lambda x: np.maximum(x, np.float32(0)),
    "gelu": _gelu,
    "gelu_apprx_tanh": _gelu_tanh,
    "gelu_apprx_sigmoid": lambda x: x * _sigmoid(np.float32(1.702) * x),
    "gelu_dx": _gelu_dx,
    # d/dx of x * sigmoid(1.702 x)
    "gelu_apprx_sigmoid_dx": lambda x: (
        _sigmoid(np.float32(1.702) * x) * (1.0 + np.float32(1.702) * x * (1.0 - _sigmoid(np.float32(1.702) * x)))
    ),
    "silu": lambda x: x * _sigmoid(x),
    "silu_dx": lambda x: _sigmoid(x) * (1.0 + x * (1.0 - _sigmoid(x))),
    "softplus": _softplus,
    "mish": lambda x: x * np.tanh(_softplus(x)),
    "erf": _erf,
    "erf_dx": lambda x: np.float32(2 / np.sqrt(np.pi)) * np.exp(-x * x),
    "square": np.square,
    "abs": np.abs,
    "negative": np.negative,
    "sign": np.sign,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "arctan": np.arctan,
    "ceil": np.ceil,
    "floor": np.floor,
    "trunc": np.trunc,
    "logical_not": lambda x: (x == 0).astype(x.dtype),
    "invert": np.invert,
}

BINARY = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "power": np.power,
    "abs_max": lambda a, b: np.maximum(np.abs(a), np.abs(b)),
    "abs_min": lambda a, b: np.minimum(np.abs(a), np.abs(b)),
    "fmod": np.fmod,
    "mod": np.mod,
    "equal": lambda a, b: (a == b).astype(np.float32),
    "not_equal": lambda a, b: (a != b).astype(np.float32),
    "less": lambda a, b: (a < b).astype(np.float32),
    "less_equal": lambda a, b: (a <= b).astype(np.float32),
    "greater": lambda a, b: (a > b).astype(np.float32),
    "greater_equal": lambda a, b: (a >= b).astype(np.float32),
    "logical_and": lambda a, b: ((a != 0) & (b != 0)).astype(np.float32),
    "logical_or": lambda a, b: ((a != 0) | (b != 0)).astype(np.float32),
    "logical_xor": lambda a, b: ((a != 0) ^ (b != 0)).astype(np.float32),
    "bitwise_and": np.bitwise_and,
    "bitwise_or": np.bitwise_or,
    "bitwise_xor": np.bitwise_xor,
    "left_shift": np.left_shift,
    "right_shift": np.right_shift,
}
BITVEC = frozenset(("bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift", "invert"))

# Reductions along free axes: ALU op name -> numpy reduction.
REDUCE = {
    "add": np.sum,
    "maximum": np.max,
    "minimum": np.min,
    "multiply": np.prod,
    "bitwise_and": np.bitwise_and.reduce,
    "bitwise_or": np.bitwise_or.reduce,
    "bitwise_xor": np.bitwise_xor.reduce,
}


def op_name(op, what="op"):
    """The NKI name of an operator given as an nl function (nl.add) or a string ('add')."""
    name = getattr(op, "nki_op", None)
    if name is None and isinstance(op, str):
        name = op
    if name is None:
        raise TypeError(f"{what}: expected an NKI operator such as nl.add or nl.exp, got {op!r}")
    return name


def unary(op, what="op"):
    name = op_name(op, what)
    fn = UNARY.get(name)
    if fn is None:
        raise ValueError(f"{what}: {name!r} is not an activation / unary operator; expected one of {sorted(UNARY)}")
    return fn


def binary(op, what="op"):
    name = op_name(op, what)
    fn = BINARY.get(name)
    if fn is None:
        raise ValueError(f"{what}: {name!r} is not a binary ALU operator; expected one of {sorted(BINARY)}")
    return fn


def reduction(op, what="op"):
    name = op_name(op, what)
    fn = REDUCE.get(name)
    if fn is None:
        raise ValueError(f"{what}: {name!r} cannot reduce; expected one of {sorted(REDUCE)}")
    return fn
