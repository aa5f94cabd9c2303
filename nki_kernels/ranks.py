"""The rank rule: which rank keeps a fraction of a layer's parameters (compression and the kernels' tuner).

`jax_neuronmm.compress.block_aligned_rank` is this function.
"""

from __future__ import annotations

import numbers

from nki_kernels.hardware import PMAX


def block_aligned_rank(k: int, n: int, keep: float, block: int = PMAX) -> int:
    """The rank r at which u [k, r] + v [r, n] hold about `keep`·k·n parameters, rounded to a multiple of `block`.

    r = round(k·n·keep / ((k+n)·block))·block, clamped to [1, min(k, n)]. Block-aligned ranks fill the 128-row
    tiles of the Trainium PE array. Small layers, where the aligned rank rounds to 0 (budget under half a block),
    fall back to the unaligned rank round(k·n·keep / (k+n)), still clamped to [1, min(k, n)].

    The factors never hold more parameters than the dense layer: a rank rounded past the break-even rank
    k·n / (k+n) is lowered to the largest block multiple under it (or, below one block, to the break-even rank
    itself). Only layers too thin for any rank to save parameters (k·n / (k+n) < 1) get rank 1 regardless.
    """
    for name, value in (("k", k), ("n", n), ("block", block)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    check_keep(keep)
    budget = k * n * keep / (k + n)
    break_even = (k * n) // (k + n)
    rank = round(budget / block) * block
    if rank > break_even:
        rank = (break_even // block) * block
    if rank < 1:
        rank = min(round(budget), break_even)
    return int(min(max(rank, 1), min(k, n)))


def check_keep(keep) -> None:
    if not isinstance(keep, numbers.Real) or isinstance(keep, bool) or not 0 < keep <= 1:
        raise ValueError(f"keep must be a fraction of parameters in (0, 1], got {keep!r}")
