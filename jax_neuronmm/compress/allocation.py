"""Rank allocation across projections under one global parameter budget, from each projection's loss at every rank.

Truncating projection i (W [K, N]) to rank r costs (K + N)·r parameters and `losses[i][r]` of accuracy: the
end-to-end KL divergence of the model's next-token distribution when that projection alone is truncated
(`pipeline.sensitivity`), interpolated between measured ranks by `loss_curve`. The losses of different projections
are added, the first-order picture of small, independent errors. Ranks move in steps of `block`; a projection may
also stay dense (`allocate_ranks(..., allow_dense=True)`).

Two solvers (`SOLVERS`): "lagrangian" prices a parameter at λ and gives each projection its option of least
loss + λ·parameters, λ the smallest price whose choices fit the budget (each projection moves along the lower
convex hull of its options); "exact" minimizes the summed loss under the budget by dynamic programming. They part
where the exact optimum fills the budget with options off a projection's convex hull, or leaves a hull vertex the
price would take for a combination that fits more tightly. The Lagrangian choice measured better after distillation
(benchmarks/results/accuracy_report.md), so it is the default.
"""

from __future__ import annotations

import functools
import math
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


# Budget cells of the allocation's dynamic program at most: costs are counted in units of their greatest common
# divisor (for a small model's projections at block 64, some thousands of cells), or of the budget / this many, each
# option's cost rounded up, when that is finer.
MAX_CELLS = 200_000
SOLVERS = ("lagrangian", "exact")


def allocate_ranks(
    losses: Sequence[np.ndarray],
    shapes: Sequence[tuple[int, int]],
    keep: float,
    block: int = 128,
    *,
    allow_dense: bool = False,
    solver: str = "lagrangian",
) -> list[int | None]:
    """Block-aligned ranks, one per projection, whose factors hold at most keep·Σ K·N parameters in total, chosen
    by `solver` to keep the summed loss low (module docstring: "exact" reaches the least summed loss, "lagrangian"
    the least at the price per parameter the budget sets).

    losses[i]: projection i's loss at every rank 0..min(K, N) (non-increasing; `loss_curve`); shapes[i] = (K, N).
    Every projection gets at least one block and no rank passes the largest block multiple under the break-even rank
    K·N/(K+N), so no factored layer is bigger than its dense one (layers under one block keep `block_aligned_rank`;
    when even one block each exceeds the budget, every projection gets its smallest rank). allow_dense: a projection
    may also stay dense (returned as None): K·N parameters, loss 0. Its factors at the largest rank still lose
    losses[i][cap], which for the most sensitive projections costs more accuracy than the few parameters between
    that rank and the dense weight buy elsewhere (for a 640 x 2048 projection, rank 448 already holds 92% of the
    dense weight's parameters).

    "exact": a dynamic program over the budget in units of the options' common divisor (`MAX_CELLS`).
    "lagrangian": the hull segments of every projection taken in order of loss saved per parameter until the next
    does not fit. Returns the ranks in the order of `losses`.
    """
    if len(losses) != len(shapes) or not losses:
        raise ValueError(
            f"losses and shapes: got {len(losses)} and {len(shapes)} entries, expected the same non-zero number"
        )
    svd.check_keep(keep)
    if solver not in SOLVERS:
        raise ValueError(f"solver: got {solver!r}, expected one of {SOLVERS}")
    budget = keep * sum(k * n for k, n in shapes)
    choices = []  # per projection: [(rank or None, parameters, loss)]
    for index, (curve, (k, n)) in enumerate(zip(losses, shapes)):
        curve = np.asarray(curve, np.float64)
        if curve.ndim != 1 or curve.shape[0] != min(k, n) + 1:
            raise ValueError(f"losses[{index}]: got shape {curve.shape}, expected ({min(k, n) + 1},) for {(k, n)}")
        cap = (k * n // (k + n)) // block * block
        ranks = list(range(block, cap + 1, block)) or [svd.block_aligned_rank(k, n, keep, block)]
        choices.append(
            [(r, r * (k + n), float(curve[r])) for r in ranks] + ([(None, k * n, 0.0)] if allow_dense else [])
        )
    chosen = _lagrangian(choices, budget) if solver == "lagrangian" else _exact(choices, budget)
    return [None if r is None else int(r) for r in chosen]


def _lower_hull(options: list[tuple]) -> list[tuple]:
    """The options [(rank, parameters, loss)] on the lower convex hull of (parameters, loss) from the cheapest to
    the least loss: each next option saves loss at a lower rate per parameter than the one before."""
    hull = []
    for option in sorted(options, key=lambda o: (o[1], o[2])):
        if hull and option[2] >= hull[-1][2]:
            continue  # costs more and saves nothing
        # Drop the last vertex while it lies on or above the segment from the one before it to this option.
        while len(hull) >= 2:
            (_, c0, l0), (_, c1, l1) = hull[-2], hull[-1]
            if (l1 - l0) * (option[1] - c0) < (option[2] - l0) * (c1 - c0):
                break
            hull.pop()
        hull.append(option)
    return hull


def _lagrangian(choices: list[list[tuple]], budget: float) -> list:
    """Each projection's hull vertex at the smallest price per parameter whose choices fit the budget: start every
    projection at its cheapest option and take hull segments in order of loss saved per parameter until the next
    one does not fit."""
    hulls = [_lower_hull(options) for options in choices]
    picks = [0] * len(hulls)
    spent = sum(hull[0][1] for hull in hulls)
    # Along one hull the rates fall, so sorting by rate takes a projection's segments in order.
    segments = sorted(
        ((hull[j][2] - hull[j - 1][2]) / (hull[j][1] - hull[j - 1][1]), i, j)
        for i, hull in enumerate(hulls)
        for j in range(1, len(hull))
    )
    for _, i, j in segments:
        step = hulls[i][j][1] - hulls[i][j - 1][1]
        if spent + step > budget:
            break
        spent += step
        picks[i] = j
    return [hull[pick][0] for hull, pick in zip(hulls, picks)]


def _exact(choices: list[list[tuple]], budget: float) -> list:
    """The options of least summed loss whose parameters fit the budget: a dynamic program over the budget."""
    unit = functools.reduce(math.gcd, (cost for options in choices for _, cost, _ in options))
    unit = max(unit, math.ceil(budget / MAX_CELLS))
    cells = int(budget // unit)
    # best[c]: the least summed loss of the projections so far at exactly c units; picks[i][c]: projection i's option.
    best = np.full(cells + 1, np.inf)
    best[0] = 0.0
    picks = []
    for options in choices:
        merged = np.full(cells + 1, np.inf)
        pick = np.zeros(cells + 1, np.int16)
        for o, (_, cost, loss) in enumerate(options):
            units = -(-cost // unit)
            if units > cells:
                continue
            candidate = np.full(cells + 1, np.inf)
            candidate[units:] = best[: cells + 1 - units] + loss
            better = candidate < merged
            merged[better], pick[better] = candidate[better], o
        best = merged
        picks.append(pick)
    if not np.isfinite(best).any():
        return [options[0][0] for options in choices]
    cell = int(np.argmin(best))
    chosen = []
    for options, pick in zip(reversed(choices), reversed(picks)):
        rank, cost, _ = options[pick[cell]]
        chosen.append(rank)
        cell -= -(-cost // unit)
    return chosen[::-1]
