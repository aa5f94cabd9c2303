"""The cost model's fitted terms (cost_model.CostTerms) and the speed bands built on them, on small hand-built traces.

Each test pins one term: a chain of N DMAs costs N x the issue cost more, the fixed step cost adds once per launch,
the HBM cap is shared by the core's engines, LNC=2 gives a rank both physical cores' DMA engines, compute_scale
scales compute only; the fitted values load from where they live (fitted_costs.json) and bad ones fail closed.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

from nki_kernels.emulator import cost_model, speed_bands, trace

A = trace.Access
FULL_RATE_BYTES = 32768  # bytes per partition at the top of the documented DMA curve


def _dma(src, dst, nbytes, *, partitions=128, hbm_offset=0):
    """HBM -> SBUF load of nbytes over `partitions` into SBUF storage dst."""
    per_partition = nbytes // partitions
    return trace.InstructionRecord(
        opcode="dma_copy",
        engine="dma",
        line="k.py:1",
        partitions=partitions,
        free_elements=per_partition // 2,
        dtype="bfloat16",
        reads=(A(src, "hbm", 0, 1, hbm_offset, hbm_offset + nbytes),),
        writes=(A(dst, "sbuf", 0, partitions, 0, per_partition),),
        dma=trace.DmaInfo(nbytes, "hbm", "sbuf", per_partition),
    )


def _matmul(stationary, moving, out, moving_free):
    return trace.InstructionRecord(
        opcode="nc_matmul",
        engine="tensor",
        line="k.py:2",
        partitions=128,
        free_elements=moving_free,
        dtype="float32",
        reads=(A(stationary, "sbuf", 0, 128, 0, 256), A(moving, "sbuf", 0, 128, 0, moving_free * 2)),
        writes=(A(out, "psum", 0, 128, 0, moving_free * 4),),
        matmul=trace.MatmulInfo(128, 128, moving_free, "bfloat16"),
    )


def _run(records, target):
    return trace.KernelRun(name="synthetic", target=target, records=list(records))


def _mixed_run(rng, target):
    """Loads of ragged sizes feeding matmuls of ragged widths, some loads independent of any matmul."""
    records = []
    for i in range(int(rng.integers(5, 9))):
        partitions = int(rng.choice([7, 64, 100, 128]))
        records.append(_dma(1, 10 + i, partitions * int(rng.integers(33, 9000)), partitions=partitions))
        if i % 2:
            records.append(_matmul(10 + i, 10 + i - 1, 500 + i, int(rng.integers(1, 513))))
    return _run(records, target)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_a_chain_of_n_dmas_costs_n_issue_costs_more(target):
    rng = np.random.default_rng()
    n = int(rng.integers(3, 12))
    issue_ns = float(rng.uniform(100, 2000))
    # Every load writes the same SBUF tile: each waits for the previous one (write after write).
    sizes = rng.integers(1, 5000, size=n) * 128
    run = _run([_dma(1, 2, int(s), hbm_offset=int(sizes[:k].sum())) for k, s in enumerate(sizes)], target)
    base = cost_model.model_latency(run, target, terms=cost_model.CostTerms())
    with_issue = cost_model.model_latency(run, target, terms=cost_model.CostTerms(dma_issue_ns=issue_ns))
    assert with_issue - base == pytest.approx(n * issue_ns / 1e3, rel=1e-9)


def test_independent_dmas_share_the_issue_queues_of_the_ranks_physical_cores():
    rng = np.random.default_rng()
    n = int(rng.integers(20, 40))
    issue_ns = 5000.0  # far above a tiny transfer's engine time: the issue queue is the bottleneck
    run = _run([_dma(1, 100 + i, 128 * 33, hbm_offset=i * 128 * 33) for i in range(n)], "trn2")

    def issue_bound(terms, queues):
        """The step is the busiest queue's issue slots, plus at most the last transfer's own latency."""
        slots = math.ceil(n / queues) * issue_ns
        latency_ns = cost_model.model_latency(run, "trn2", terms=terms) * 1e3
        assert slots <= latency_ns < slots + 2 * cost_model.DMA_FIXED_LATENCY_NS + 1e3, (n, queues, latency_ns)

    issue_bound(cost_model.CostTerms(dma_issue_ns=issue_ns), 1)
    issue_bound(cost_model.CostTerms(dma_issue_ns=issue_ns, lnc=2), 2)
    # Two issue queues per physical core (trn2's two descriptor-generation engines): four queues at LNC=2.
    issue_bound(cost_model.CostTerms(dma_issue_ns=issue_ns, lnc=2, issue_queues=2), 4)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_the_fixed_step_cost_adds_once_per_launch(target):
    rng = np.random.default_rng()
    fixed_us = float(rng.uniform(1, 500))
    launches = [_mixed_run(rng, target) for _ in range(int(rng.integers(2, 6)))]
    terms = cost_model.CostTerms(step_fixed_us=fixed_us)
    plain = sum(cost_model.model_latency(run, target, terms=cost_model.CostTerms()) for run in launches)
    fixed = sum(cost_model.model_latency(run, target, terms=terms) for run in launches)
    assert fixed - plain == pytest.approx(len(launches) * fixed_us, rel=1e-9)
    schedule = cost_model.schedule(launches[0], target, terms=terms)
    assert schedule.latency_us == pytest.approx(max(schedule.finish_us) + fixed_us)


def test_default_terms_are_the_documented_model_where_the_hbm_cap_does_not_bind():
    # trn1: 16 engines x 17 B/ns = 272 GB/s, under the core's 410 GB/s HBM share, so the per-core cap never binds.
    rng = np.random.default_rng()
    run = _mixed_run(rng, "trn1")
    assert cost_model.model_latency(run, "trn1", terms=cost_model.CostTerms()) == pytest.approx(
        cost_model.model_latency(run, "trn1"), rel=1e-12
    )


def test_hbm_efficiency_caps_the_core_not_each_transfer():
    # Two 64-partition loads (8 engines each) at once on trn2: per transfer each may draw 362.5 GB/s, so the
    # documented model lets them draw 16 x 23 = 368 GB/s together; with the terms the 16 engines share the core's
    # HBM share x efficiency.
    rng = np.random.default_rng()
    efficiency = float(rng.uniform(0.3, 1.0))
    nbytes = 64 * FULL_RATE_BYTES
    run = _run([_dma(1, 2, nbytes, partitions=64), _dma(1, 3, nbytes, partitions=64, hbm_offset=nbytes)], "trn2")
    got = cost_model.model_latency(run, "trn2", terms=cost_model.CostTerms(hbm_efficiency=efficiency))
    rate = min(23.0, efficiency * 2900.0 / 8 / 16)
    assert got * 1e3 == pytest.approx(nbytes / (8 * rate) + cost_model.DMA_FIXED_LATENCY_NS)
    documented = cost_model.model_latency(run, "trn2")
    assert documented * 1e3 == pytest.approx(nbytes / (8 * 23.0) + cost_model.DMA_FIXED_LATENCY_NS)


def test_lnc2_gives_a_rank_both_physical_cores_dma_engines():
    rng = np.random.default_rng()
    n = 2 * int(rng.integers(1, 4))
    nbytes = 128 * FULL_RATE_BYTES
    run = _run([_dma(1, 10 + i, nbytes, hbm_offset=i * nbytes) for i in range(n)], "trn2")
    rate = min(23.0, 2900.0 / 8 / 16)
    one = cost_model.model_latency(run, "trn2", terms=cost_model.CostTerms(lnc=1))
    two = cost_model.model_latency(run, "trn2", terms=cost_model.CostTerms(lnc=2))
    assert one * 1e3 == pytest.approx(n * nbytes / (16 * rate) + cost_model.DMA_FIXED_LATENCY_NS)
    assert two * 1e3 == pytest.approx(n * nbytes / (32 * rate) + cost_model.DMA_FIXED_LATENCY_NS)


def test_compute_scale_scales_compute_and_not_dma():
    rng = np.random.default_rng()
    widths = rng.integers(65, 513, size=int(rng.integers(2, 7)))
    matmuls = _run([_matmul(1, 2, 3 + k, int(w)) for k, w in enumerate(widths)], "trn1")
    scale = float(rng.uniform(1.1, 3.0))
    expected_us = float(np.sum(widths.astype(np.float64))) / 2.8 / 1e3
    assert cost_model.model_latency(matmuls, "trn1", terms=cost_model.CostTerms(compute_scale=scale)) == (
        pytest.approx(scale * expected_us)
    )
    load = _run([_dma(1, 2, 128 * FULL_RATE_BYTES)], "trn1")
    assert cost_model.model_latency(load, "trn1", terms=cost_model.CostTerms(compute_scale=scale)) == pytest.approx(
        cost_model.model_latency(load, "trn1")
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("dma_issue_ns", -1.0),
        ("step_fixed_us", math.nan),
        ("hbm_efficiency", 0.0),
        ("hbm_efficiency", 1.5),
        ("lnc", 4),
        ("compute_scale", 0.0),
        ("issue_queues", 3),
        ("issue_queues", True),
    ],
)
def test_bad_terms_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=f"CostTerms.{field}"):
        cost_model.CostTerms(**{field: value})


def test_fitted_terms_load_from_fitted_costs_json():
    with open(cost_model.FITTED_COSTS_PATH, encoding="utf-8") as f:
        table = json.load(f)
    for target in cost_model.TARGETS:
        assert cost_model.fitted_terms(target) == cost_model.CostTerms(**table["targets"][target])
    assert cost_model.fitted_terms("trn2").lnc == 2  # trn2 ranks are LNC=2 logical cores


def test_fitted_terms_read_a_given_file_and_fail_closed(tmp_path):
    rng = np.random.default_rng()
    entry = {
        "dma_issue_ns": float(rng.uniform(0, 2000)),
        "step_fixed_us": float(rng.uniform(0, 5000)),
        "hbm_efficiency": float(rng.uniform(0.1, 1.0)),
        "lnc": 1,
        "compute_scale": 1.0,
        "issue_queues": int(rng.integers(1, 3)),
    }
    path = tmp_path / "terms.json"
    path.write_text(json.dumps({"targets": {"trn1": entry}}))
    assert dataclasses.asdict(cost_model.fitted_terms("trn1", path)) == entry
    with pytest.raises(ValueError, match="targets.trn2"):
        cost_model.fitted_terms("trn2", path)
    path.write_text(json.dumps({"targets": {"trn1": {**entry, "extra_ns": 1.0}}}))
    with pytest.raises(ValueError, match="targets.trn1"):
        cost_model.fitted_terms("trn1", path)
    path.write_text(json.dumps({"targets": {"trn1": {**entry, "hbm_efficiency": 2.0}}}))
    with pytest.raises(ValueError, match="hbm_efficiency"):
        cost_model.fitted_terms("trn1", path)


@pytest.mark.parametrize("fitted_issue_ns", [0.0, 600.0, 1700.0])
def test_latency_band_runs_from_all_low_to_all_high_terms(fitted_issue_ns):
    rng = np.random.default_rng()
    run = _mixed_run(rng, "trn2")
    fitted = cost_model.CostTerms(dma_issue_ns=fitted_issue_ns, step_fixed_us=float(rng.uniform(10, 400)), lnc=2)
    low, high = speed_bands.latency_band(lambda t: cost_model.model_latency(run, "trn2", terms=t), fitted)
    at_fitted = cost_model.model_latency(run, "trn2", terms=fitted)
    all_low = dataclasses.replace(fitted, dma_issue_ns=0.0, step_fixed_us=0.0, compute_scale=1.0)
    assert low == pytest.approx(cost_model.model_latency(run, "trn2", terms=all_low))
    assert low < at_fitted <= high
    # A fit that found no issue cost still carries the documented ~600 ns at the band's high end.
    all_high = dataclasses.replace(fitted, dma_issue_ns=max(fitted_issue_ns, 600.0), compute_scale=2.0)
    assert high == pytest.approx(cost_model.model_latency(run, "trn2", terms=all_high))


def test_speedup_band_holds_the_ratio_at_every_corner():
    rng = np.random.default_rng()
    slow, fast = _mixed_run(rng, "trn1"), _mixed_run(rng, "trn1")
    fitted = cost_model.CostTerms(dma_issue_ns=float(rng.uniform(100, 1500)), step_fixed_us=float(rng.uniform(1, 50)))

    def latency(run):
        return lambda t: cost_model.model_latency(run, "trn1", terms=t)

    point, low, high = speed_bands.speedup_band(latency(slow), latency(fast), fitted)
    ratios = [latency(slow)(t) / latency(fast)(t) for t in speed_bands.corners(fitted)]
    assert len(ratios) == 8
    assert low == pytest.approx(min(ratios + [point])) and high == pytest.approx(max(ratios + [point]))
    assert low <= point <= high
    with pytest.raises(TypeError, match="fitted"):
        speed_bands.corners({"dma_issue_ns": 600.0})


def test_a_step_of_several_launches_pays_the_fixed_cost_once():
    rng = np.random.default_rng()
    runs = [_mixed_run(rng, "trn1") for _ in range(3)]
    terms = cost_model.CostTerms(dma_issue_ns=float(rng.uniform(100, 900)), step_fixed_us=float(rng.uniform(5, 500)))
    free = dataclasses.replace(terms, step_fixed_us=0.0)
    launches = [cost_model.model_latency(run, "trn1", terms=free) for run in runs]
    assert speed_bands.step_us(runs, "trn1", terms) == pytest.approx(sum(launches) + terms.step_fixed_us)
    documented = sum(cost_model.model_latency(run, "trn1") for run in runs)
    assert speed_bands.step_us(runs, "trn1", None) == pytest.approx(documented)
    band = speed_bands.band_latencies(lambda t: speed_bands.step_us(runs, "trn1", t), terms)
    assert band["fitted"] == pytest.approx(sum(launches) + terms.step_fixed_us) and len(band["corners"]) == 8
