"""NKI data types as numpy dtypes (low-precision floats via ml_dtypes).

Storage arrays hold the real dtype, so every store and cast rounds exactly as numpy/ml_dtypes
round-to-nearest-even does. tfloat32 has no numpy type; it is stored as float32 (documented gap).
"""

import ml_dtypes
import numpy as np

bool_ = np.dtype(np.bool_)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
tfloat32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)  # MX scale exponents
# Four packed elements in 32 bits, for nc_matmul_mx on NeuronCore-v4 (trn3) only: named 4-byte records, so they
# compare unequal to every other dtype; tensors of them cannot be created on trn1/trn2.
float8_e5m2_x4 = np.dtype([("float8_e5m2_x4", np.uint32)])
float8_e4m3fn_x4 = np.dtype([("float8_e4m3fn_x4", np.uint32)])
float4_e2m1fn_x4 = np.dtype([("float4_e2m1fn_x4", np.uint32)])
TRN3_ONLY = {
    float8_e5m2_x4: "float8_e5m2_x4",
    float8_e4m3fn_x4: "float8_e4m3fn_x4",
    float4_e2m1fn_x4: "float4_e2m1fn_x4",
}

_BY_NAME = {
    "bool": bool_,
    "bool_": bool_,
    "int8": int8,
    "int16": int16,
    "int32": int32,
    "uint8": uint8,
    "uint16": uint16,
    "uint32": uint32,
    "float16": float16,
    "float32": float32,
    "tfloat32": tfloat32,
    "bfloat16": bfloat16,
    "float8_e4m3": float8_e4m3,
    "float8_e4m3fn": float8_e4m3fn,
    "float8_e5m2": float8_e5m2,
    "float8_e8m0fnu": float8_e8m0fnu,
}
SUPPORTED = frozenset(_BY_NAME.values())
NAME = {dtype: dtype.name for dtype in SUPPORTED}  # dtype.name is slow; records need it per instruction

# Operand types the TensorE accepts (nc_matmul docs): fp8 (e4m3, e5m2), bf16, fp16, tf32, fp32.
MATMUL_INPUT = frozenset((float8_e4m3, float8_e5m2, bfloat16, float16, float32))


def as_dtype(dtype, argument="dtype"):
    """Normalize a dtype given as np.dtype, numpy type, or NKI name ('bfloat16') to an np.dtype."""
    if isinstance(dtype, np.dtype) and dtype in TRN3_ONLY:
        raise TypeError(
            f"{argument}: {TRN3_ONLY[dtype]} is a NeuronCore-v4 (trn3) packed type; the emulator targets trn1 and trn2"
        )
    if isinstance(dtype, np.dtype) and dtype in SUPPORTED:
        return dtype
    if isinstance(dtype, str):
        found = _BY_NAME.get(dtype)
        if found is None:
            raise TypeError(f"{argument}: unknown NKI dtype {dtype!r}; expected one of {sorted(_BY_NAME)}")
        return found
    try:
        found = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{argument}: expected an NKI dtype, got {dtype!r}") from None
    if found not in SUPPORTED:
        raise TypeError(f"{argument}: dtype {found} is not an NKI dtype; expected one of {sorted(_BY_NAME)}")
    return found


def fill_value(dtype):
    """What fresh (uninitialized) memory holds: NaN for floats, the type's maximum for integers."""
    if dtype.kind == "f" or dtype in (bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu):
        return np.nan
    if dtype == bool_:
        return True
    return np.iinfo(dtype).max


def is_float(dtype):
    return dtype.kind == "f" or dtype in (bfloat16, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu)
