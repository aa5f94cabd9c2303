"""Modeled latency of kernel launches run back to back, with a per-launch fixed overhead.

The cost model (cost_model.py) schedules each kernel run on its own: a run starts with empty engines and queues
and ends when its last instruction finishes, so the pipeline fill and drain of every launch are in its modeled
latency. What it leaves out is the fixed cost of a launch itself (the runtime starting the kernel's instruction
streams and the synchronization at its end). A composition of launches (one kernel per op, one per layer, one
looped kernel) is therefore modeled as

    latency = sum over launches of modeled latency + launches x launch_overhead_us

with the overhead an explicit parameter: no public source gives a per-launch overhead for a NeuronCore.
What the public Neuron documentation does give (aws-neuron/aws-neuron-sdk; none of it is this quantity):
- vllm-neuron/docs/design/framework/async_execution.md: 437 µs of host-side overhead between synchronous
  NEFF executions on trn2 ("dispatch overheads, tensor allocations, and Python overheads"), hidden entirely by
  asynchronous execution: a host round trip per model call, not the cost of a kernel boundary inside one NEFF;
- release-notes/components/runtime.rst (Neuron 2.32.0): "Improved trn3 NEFF start overhead by 20us": a NEFF
  start costs at least that much on trn3 before the change, but no total and no trn1/trn2 figure is given;
- nki/library/api/transformer-tkg.rst: running all layers in one kernel "reduces kernel launch overhead",
  without a number.
The SambaNova kernel-looping paper (arXiv 2410.23668) measures synchronization at kernel boundaries on SN40L
and DGX H100, not on Trainium. Benchmarks therefore show LAUNCH_OVERHEAD_SWEEP_US instead of one value.
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
