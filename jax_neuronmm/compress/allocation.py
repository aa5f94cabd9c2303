"""Rank allocation across projections under one global parameter budget, from each projection's loss at every rank.

Truncating projection i (W [K, N]) to rank r costs (K + N)·r parameters and `losses[i][r]` of accuracy: the
end-to-end KL divergence of the model's next-token distribution when that projection alone is truncated
(`compress.sensitivity`), interpolated between measured ranks by `loss_curve`. The losses of different projections
are added, the first-order picture of small, independent errors. Ranks move in steps of `block`.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np

from jax_neuronmm.compress import svd


def loss_curve(measured: Mapping[int, float], full_rank: int) -> np.ndarray:
    """The loss at every rank 0..full_rank [full_rank + 1] from losses measured at a few ranks.

    Between measured ranks the log of the loss is linear in the rank (truncation losses fall about geometrically
    with the rank); below the lowest and above the highest measured rank the nearest segment's slope continues (a
    single measurement: flat), the loss at full_rank is 0 (the projection is exact) and the curve never rises
    with the rank (a measurement above a lower rank's is clipped to it)."""
    points = sorted((int(r), float(v)) for r, v in measured.items() if 0 < int(r) < full_rank)
    if not points:
        raise ValueError(f"measured: got ranks {sorted(measured)}, expected at least one in [1, {full_rank})")
    if any(not np.isfinite(v) or v < 0 for _, v in points):
        raise ValueError(f"measured: got losses {[v for _, v in points]}, expected finite values >= 0")
    ranks = np.array([r for r, _ in points], np.float64)
    # A noisy measurement above a lower rank's is clipped first, so no segment (nor its extrapolation) rises.
    logs = np.log(np.maximum(np.minimum.accumulate([v for _, v in points]), 1e-30))
    grid = np.arange(full_rank + 1, dtype=np.float64)
    if len(points) == 1:
        curve = np.full(grid.shape, logs[0])
    else:
        curve = np.interp(grid, ranks, logs)
        low = (logs[1] - logs[0]) / (ranks[1] - ranks[0])
        high = (logs[-1] - logs[-2]) / (ranks[-1] - ranks[-2])
        curve = np.where(grid < ranks[0], logs[0] + low * (grid - ranks[0]), curve)
        curve = np.where(grid > ranks[-1], logs[-1] + high * (grid - ranks[-1]), curve)
    curve = np.minimum.accumulate(np.exp(curve))
    curve[full_rank] = 0.0
    return curve


def allocate_ranks(
    losses: Sequence[np.ndarray], shapes: Sequence[tuple[int, int]], keep: float, block: int = 128
) -> list[int]:
    """Block-aligned ranks, one per projection, whose factors hold at most keep·Σ K·N parameters in total.

    losses[i]: projection i's loss at every rank 0..min(K, N) (non-increasing; `loss_curve`); shapes[i] = (K, N).
    Every projection starts at one block and no rank passes the largest block multiple under the break-even rank
    K·N/(K+N), so no factored layer is bigger than its dense one (layers under one block keep `block_aligned_rank`).
    Greedy: the block that removes the most loss per parameter goes next, until the budget is spent (optimal when
    each curve is convex). Returns the ranks in the order of `losses`.
    """
    if len(losses) != len(shapes) or not losses:
        raise ValueError(
            f"losses and shapes: got {len(losses)} and {len(shapes)} entries, expected the same non-zero number"
        )
    svd.check_keep(keep)
    budget = keep * sum(k * n for k, n in shapes)
    ranks, caps, curves = [], [], []
    for index, (curve, (k, n)) in enumerate(zip(losses, shapes)):
        curve = np.asarray(curve, np.float64)
        if curve.ndim != 1 or curve.shape[0] != min(k, n) + 1:
            raise ValueError(f"losses[{index}]: got shape {curve.shape}, expected ({min(k, n) + 1},) for {(k, n)}")
        curves.append(curve)
        cap = (k * n // (k + n)) // block * block
        if cap == 0:  # under one block: not allocated, the uniform rule's unaligned rank
            cap = svd.block_aligned_rank(k, n, keep, block)
        caps.append(cap)
        ranks.append(min(block, cap))
    spent = sum(r * (k + n) for r, (k, n) in zip(ranks, shapes))

    def gain(i: int) -> float:
        k, n = shapes[i]
        step = min(block, caps[i] - ranks[i])
        return (curves[i][ranks[i]] - curves[i][ranks[i] + step]) / (step * (k + n))

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
