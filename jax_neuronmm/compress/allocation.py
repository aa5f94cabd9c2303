"""Rank allocation across projections under one global parameter budget, by whitened truncation error.

Each projection W [K, N] with calibration inputs X has whitened singular values σ (those of Sᵀ·W, XᵀX = S·Sᵀ):
truncating it to rank r costs (K + N)·r parameters and loses Σ_{i>r} σ_i² = ‖X·W − X·u·v‖_F² of output energy.
Errors are compared relative to each projection's own output energy ‖X·W‖_F² = Σ σ², so a layer with large
activations does not take the whole budget. Ranks move in steps of `block` (the PE array's tile rows).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from jax_neuronmm.compress import svd


def allocate_ranks(
    spectra: Sequence[np.ndarray], shapes: Sequence[tuple[int, int]], keep: float, block: int = 128
) -> list[int]:
    """Block-aligned ranks, one per projection, whose factors hold at most keep·Σ K·N parameters in total.

    spectra[i]: the whitened singular values of projection i (descending, length min(K, N)); shapes[i] = (K, N).
    Every projection starts at one block and no rank passes the largest block multiple under the break-even rank
    K·N/(K+N), so no factored layer is bigger than its dense one (layers under one block keep `block_aligned_rank`).
    Greedy: the block that removes the most relative error per parameter goes next, until the budget is spent.
    Returns the ranks in the order of `spectra`.
    """
    if len(spectra) != len(shapes) or not spectra:
        raise ValueError(
            f"spectra and shapes: got {len(spectra)} and {len(shapes)} entries, expected the same non-zero number"
        )
    svd.check_keep(keep)
    budget = keep * sum(k * n for k, n in shapes)
    ranks, caps, tails = [], [], []
    for index, (sigma, (k, n)) in enumerate(zip(spectra, shapes)):
        sigma = np.asarray(sigma, np.float64)
        if sigma.ndim != 1 or sigma.shape[0] != min(k, n):
            raise ValueError(f"spectra[{index}]: got shape {sigma.shape}, expected ({min(k, n)},) for shape {(k, n)}")
        energy = sigma**2
        total = float(energy.sum())
        # Cumulative energy kept at each rank: tails[r] = relative error at rank r.
        tails.append(
            1.0 - np.concatenate([[0.0], np.cumsum(energy)]) / total if total > 0 else np.zeros(len(sigma) + 1)
        )
        cap = (k * n // (k + n)) // block * block
        if cap == 0:  # under one block: not allocated, the uniform rule's unaligned rank
            cap = svd.block_aligned_rank(k, n, keep, block)
        caps.append(cap)
        ranks.append(min(block, cap))
    spent = sum(r * (k + n) for r, (k, n) in zip(ranks, shapes))

    def gain(i: int) -> float:
        k, n = shapes[i]
        step = min(block, caps[i] - ranks[i])
        return (tails[i][ranks[i]] - tails[i][ranks[i] + step]) / (step * (k + n))

    heap = [(-gain(i), i) for i in range(len(ranks)) if ranks[i] < caps[i]]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        k, n = shapes[i]
        step = min(block, caps[i] - ranks[i])
        if spent + step * (k + n) > budget:
            continue  # this block does not fit; a smaller projection's block still may
        ranks[i] += step
        spent += step * (k + n)
        if ranks[i] < caps[i]:
            heapq.heappush(heap, (-gain(i), i))
    return [int(r) for r in ranks]
