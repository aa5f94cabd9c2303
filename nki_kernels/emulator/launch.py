"""Modeled latency of kernel launches run back to back, with a per-launch fixed overhead.

The cost model schedules each run on its own (pipeline fill and drain included) but not the fixed cost of a launch
itself, for which no public source gives a NeuronCore figure; a composition of launches is therefore

    latency = sum over launches of modeled latency + launches x launch_overhead_us

with the overhead a parameter that benchmarks sweep (LAUNCH_OVERHEAD_SWEEP_US). docs/emulator.md ("Launch
overhead") lists what the public documentation does say.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from . import cost_model

# Assumed per-launch overheads (µs) the benchmarks sweep, as no documented Trainium value exists (above).
LAUNCH_OVERHEAD_SWEEP_US = (0.0, 2.0, 5.0, 10.0, 20.0)


def check_launch_overhead(launch_overhead_us) -> float:
    """launch_overhead_us as a float; ValueError unless it is a finite number >= 0."""
    if (
        not isinstance(launch_overhead_us, numbers.Real)
        or isinstance(launch_overhead_us, bool)
        or not math.isfinite(launch_overhead_us)
        or launch_overhead_us < 0
    ):
        raise ValueError(f"launch_overhead_us: got {launch_overhead_us!r}, expected a finite number of µs >= 0")
    return float(launch_overhead_us)


def composition_latency_us(runs: Sequence, target: str, launch_overhead_us: float) -> float:
    """Modeled µs of `runs` (profile.RunSummary, one per launch) issued back to back on one NeuronCore.

    Each run keeps its own modeled latency (fill and drain included); every run adds launch_overhead_us.
    """
    if target not in cost_model.TARGETS:
        raise ValueError(f"target: got {target!r}, expected one of {cost_model.TARGETS}")
    overhead = check_launch_overhead(launch_overhead_us)
    return sum(run.latency_us[target] for run in runs) + len(runs) * overhead
