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
from collections.abc import Callable, Sequence

from .cost_model import CostTerms, schedule

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
    return ratio_band(band_latencies(slow, fitted), band_latencies(fast, fitted))


def step_us(runs: Sequence, target: str, terms: CostTerms | None) -> float:
    """One step's modeled µs on `target`: its launches (trace.KernelRun with records) scheduled at `terms` without the
    fixed cost, plus the fixed cost once (a step pays it once however many launches it makes; None: the documented
    model alone)."""
    if terms is None:
        return sum(schedule(run, target).latency_us for run in runs)
    free = dataclasses.replace(terms, step_fixed_us=0.0)
    return sum(schedule(run, target, terms=free).latency_us for run in runs) + terms.step_fixed_us


def band_latencies(latency: Callable[[CostTerms], float], fitted: CostTerms) -> dict:
    """{"fitted": latency(fitted), "corners": [latency(t) for t in corners(fitted)]}: what a speedup band needs of one
    latency, kept (e.g. in a report's JSON) so bands are recomputed without the trace."""
    return {"fitted": latency(fitted), "corners": [latency(t) for t in corners(fitted)]}


def ratio_band(slow: dict, fast: dict) -> tuple[float, float, float]:
    """(at the fitted terms, lowest, highest) of slow / fast from two band_latencies of the same fitted terms."""
    if len(slow["corners"]) != len(fast["corners"]):
        raise ValueError(f"slow, fast: {len(slow['corners'])} and {len(fast['corners'])} corners, expected the same")
    point = slow["fitted"] / fast["fitted"]
    ratios = [point] + [a / b for a, b in zip(slow["corners"], fast["corners"])]
    return point, min(ratios), max(ratios)
