"""Checks of user-supplied token ids and parameter dtypes, shared by generation, model calls, calibration and the
loaders."""

import numpy as np

PARAM_DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_param_dtype(op: str, dtype) -> np.dtype:
    """`dtype` as a numpy dtype when it is a float parameter dtype (PARAM_DTYPES); a TypeError naming `dtype`
    otherwise. fp8 is a weight format with per-channel scales, not a dtype to cast a model's parameters to (the
    cast alone loses the scales: NaN or far-off logits), so the error points at `quantize_model`."""
    try:
        resolved = None if dtype is None else np.dtype(dtype)  # np.dtype(None) would be float64
    except TypeError:
        resolved = None
    if resolved is not None and resolved.name in PARAM_DTYPES:
        return resolved
    if resolved is not None and resolved.name.startswith("float8"):
        raise TypeError(
            f"{op}: dtype={resolved.name}: fp8 is a weight format with per-channel scales, not a parameter dtype; "
            "load the model in bfloat16 or float32 and quantize it with pipeline.quantize_model(model)"
        )
    got = resolved.name if resolved is not None else repr(dtype)
    raise TypeError(f"{op}: dtype={got}: expected a float parameter dtype, one of {', '.join(PARAM_DTYPES)}")


def check_token_ids(ids, vocab_size: int, *, name: str) -> np.ndarray:
    """Returns `ids` as an int32 numpy array after checking every id lies in [0, vocab_size).

    Out-of-range ids would otherwise index the embedding silently (JAX clamps or wraps gathers), giving garbage
    logits instead of an error.

    Raises:
      ValueError: naming `name` when an id is not an integer or lies outside [0, vocab_size).
    """
    arr = np.asarray(ids)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name}: token ids must be integers, got dtype {arr.dtype}")
    if arr.size:
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary range [0, {vocab_size})")
    return arr.astype(np.int32)


def check_token_windows(ids, vocab_size: int, *, name: str) -> np.ndarray:
    """`ids` as int32 windows [B, T] (B, T >= 1) of ids in [0, vocab_size): the text calibration and training
    read. ValueError naming `name` (e.g. "quantize_model: calibration_ids") with the shape and dtype otherwise."""
    arr = np.asarray(ids)
    if arr.ndim != 2 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} has shape {arr.shape} ({arr.dtype}); expected int token ids [B, T]")
    return check_token_ids(arr, vocab_size, name=name)
