"""Modeled latencies and speedups as bands over the cost model's uncertain terms.

A modeled figure is quoted at the fitted terms (cost_model.fitted_terms) with the range its uncertain terms
give: the fixed cost per step from 0 (a host that hides it, e.g. asynchronous execution) to the fitted value,
the DMA issue cost from 0 to the larger of the fitted value and the ~600 ns per DMA AWS documents for trn2's
hardware DGE (trainium2_arch.rst; a fit that finds no issue cost does not rule one out), and compute at 1x to
2x the documented instruction costs (what the model cannot check against a profile). The band's ends for a
latency are the all-low and all-high corners (latency grows with each term); a speedup is a ratio of two
latencies under the same terms, so its band is the smallest and largest ratio over every corner.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from .cost_model import CostTerms

COMPUTE_SCALES = (1.0, 2.0)
DOCUMENTED_DMA_ISSUE_NS = 600.0


def corners(fitted: CostTerms) -> list[CostTerms]:
    """The 8 combinations of fixed step cost {0, fitted}, DMA issue cost {0, max(fitted, DOCUMENTED_DMA_ISSUE_NS)}
    and compute {x1, x2}; HBM
    efficiency and LNC stay at their fitted values. The first corner is the all-low one, the last the all-high."""
    if not isinstance(fitted, CostTerms):
        raise TypeError(f"fitted: got {type(fitted).__name__}, expected cost_model.CostTerms")
    return [
        dataclasses.replace(fitted, step_fixed_us=fixed, dma_issue_ns=issue, compute_scale=scale)
        for fixed, issue, scale in itertools.product(
            (0.0, fitted.step_fixed_us), (0.0, max(fitted.dma_issue_ns, DOCUMENTED_DMA_ISSUE_NS)), COMPUTE_SCALES
        )
    ]


def latency_band(latency: Callable[[CostTerms], float], fitted: CostTerms) -> tuple[float, float]:
    """(low, high) of latency(terms) over the corners: the all-low and all-high ones."""
    ends = corners(fitted)
    return latency(ends[0]), latency(ends[-1])


def speedup_band(
    slow: Callable[[CostTerms], float], fast: Callable[[CostTerms], float], fitted: CostTerms
) -> tuple[float, float, float]:
    """(at the fitted terms, lowest, highest) of slow(terms) / fast(terms), the band over every corner and the fitted
    point (a ratio of two latencies need not be monotone in the terms, so the point can lie outside the corners')."""
    point = slow(fitted) / fast(fitted)
    ratios = [point] + [slow(t) / fast(t) for t in corners(fitted)]
    return point, min(ratios), max(ratios)
