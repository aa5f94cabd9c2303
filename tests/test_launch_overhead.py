"""emulator.launch: a composition's latency is its launches' modeled latencies plus a fixed cost per launch, and
every launch is modeled on its own (its pipeline fill and drain are paid once per launch)."""

import math

import numpy as np
import pytest

from nki_kernels import emulator
from nki_kernels.binding import nisa, nki, nl
from nki_kernels.emulator import launch


@nki.jit
def scale_rows(x):
    """out[P, F] = 2·x[P, F] for every row block of 128 (a load, a scalar op and a store per block)."""
    rows, free = x.shape
    out = nl.ndarray((rows, free), x.dtype, buffer=nl.shared_hbm)
    for start in range(0, rows, nl.tile_size.pmax):
        size = min(nl.tile_size.pmax, rows - start)
        tile = nl.ndarray((size, free), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(tile, x[start : start + size])
        nisa.activation(tile, nl.copy, tile, scale=2.0)
        nisa.dma_copy(out[start : start + size], tile)
    return out


def _runs(*inputs):
    with emulator.count_only(), emulator.profile() as prof:
        for x in inputs:
            scale_rows(x)
    return prof.runs


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize("overhead", [0.0, 2.0, 7.5, 20])
def test_latency_is_the_sum_of_launches_plus_overhead_per_launch(target, overhead):
    rng = np.random.default_rng(3)
    runs = _runs(
        rng.standard_normal((130, 700)).astype(np.float32),
        rng.standard_normal((7, 200)).astype(np.float32),
        rng.standard_normal((256, 100)).astype(np.float32),
    )
    assert len(runs) == 3
    total = launch.composition_latency_us(runs, target, overhead)
    assert total == pytest.approx(sum(r.latency_us[target] for r in runs) + 3 * overhead)
    assert launch.composition_latency_us(runs[:1], target, overhead) == pytest.approx(
        runs[0].latency_us[target] + overhead
    )
    assert launch.composition_latency_us([], target, overhead) == 0.0


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_each_launch_pays_its_own_fill_and_drain(target):
    """Splitting one kernel's row blocks over two launches costs more than the one launch even at zero overhead:
    inside one kernel the second block's load overlaps the first block's work, across launches it cannot."""
    x = np.random.default_rng(5).standard_normal((256, 1000)).astype(np.float32)
    (whole,) = _runs(x)
    halves = _runs(x[:128], x[128:])
    one = launch.composition_latency_us([whole], target, 0.0)
    two = launch.composition_latency_us(halves, target, 0.0)
    assert two > 1.2 * one
    # The per-launch overhead widens the gap by exactly one overhead.
    assert launch.composition_latency_us(halves, target, 5.0) - launch.composition_latency_us(
        [whole], target, 5.0
    ) == pytest.approx(two - one + 5.0)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "5", None, True])
def test_bad_overheads_are_value_errors_naming_the_argument(bad):
    with pytest.raises(ValueError, match="launch_overhead_us"):
        launch.composition_latency_us([], "trn2", bad)


def test_unknown_target_is_a_value_error():
    with pytest.raises(ValueError, match="target"):
        launch.composition_latency_us([], "trn9", 1.0)


def test_the_sweep_is_the_issue_s_assumed_values():
    assert launch.LAUNCH_OVERHEAD_SWEEP_US == (0.0, 2.0, 5.0, 10.0, 20.0)
    assert all(launch.check_launch_overhead(v) == v for v in launch.LAUNCH_OVERHEAD_SWEEP_US)
