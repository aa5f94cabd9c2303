"""Checks of user-supplied token ids, shared by generation, model calls and calibration."""

import numpy as np


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
