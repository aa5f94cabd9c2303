"""benchmarks/calibration.py: the fit of the cost model's terms to published latencies, and the committed results.

The fit is checked on synthetic rows whose "published" latencies come from known terms (it must find them); the
committed fitted_costs.json must hold the terms the committed calibration report was made with, and the report's
like-for-like held-out rows must meet the ±25% target it states.
"""

import dataclasses
import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

from nki_kernels.emulator import cost_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def calibration():
    path = ROOT / "benchmarks" / "calibration.py"
    spec = importlib.util.spec_from_file_location("calibration_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


@dataclasses.dataclass
class _Synthetic:
    """A row whose kernel time is known in closed form: bytes / efficiency + DMAs x issue cost."""

    row: object
    bytes_ms: float
    dmas: int

    def step_ms(self, terms):
        return self.bytes_ms / terms.hbm_efficiency + self.dmas * terms.dma_issue_ns / 1e6 + terms.step_fixed_us / 1e3


def test_best_fixed_cost_matches_the_float64_least_squares(calibration):
    rng = np.random.default_rng()
    n = int(rng.integers(3, 9))
    kernel = rng.uniform(1, 20, size=n)
    published = kernel + rng.uniform(2, 6) + rng.normal(0, 0.3, size=n)
    # minimize sum(((k + f) / p - 1) ** 2) over f: f = sum((p - k) / p**2) / sum(1 / p**2)
    expected = np.sum((published - kernel) / published**2) / np.sum(1 / published**2)
    got = calibration.best_fixed_us(list(kernel), list(published))
    assert got == pytest.approx(expected * 1e3, rel=1e-12)
    assert calibration.best_fixed_us([10.0], [5.0]) == 0.0  # a negative fixed cost is clipped, not fitted


def test_fit_recovers_the_terms_that_made_the_rows(calibration):
    rng = np.random.default_rng()
    issue = float(rng.choice(calibration.ISSUE_GRID_NS[1:]))
    efficiency = float(rng.choice(calibration.HBM_EFFICIENCY_GRID))
    fixed_us = float(rng.uniform(500, 5000))
    truth = cost_model.CostTerms(dma_issue_ns=issue, hbm_efficiency=efficiency, step_fixed_us=fixed_us)
    template = calibration.ROWS[0]
    rows = []
    for k in range(int(rng.integers(4, 7))):
        row = _Synthetic(template, float(rng.uniform(0.5, 20)), int(rng.integers(100, 20000)))
        row.row = dataclasses.replace(template, published_ms=row.step_ms(truth), role="fit" if k < 3 else "held out")
        rows.append(row)
    fitted = calibration.fit_target(
        rows, cost_model.CostTerms(), calibration.ISSUE_GRID_NS, calibration.HBM_EFFICIENCY_GRID
    )
    assert (fitted.dma_issue_ns, fitted.hbm_efficiency) == (issue, efficiency)
    assert fitted.step_fixed_us == pytest.approx(fixed_us, rel=1e-9)
    for row in rows:
        assert calibration.relative_error(row.step_ms(fitted), row.row.published_ms) == pytest.approx(0, abs=1e-9)
    with pytest.raises(ValueError, match="no fit rows"):
        calibration.fit_target(rows[3:], cost_model.CostTerms(), (0.0,), (1.0,))


def test_trn2_fits_only_its_fixed_cost_on_the_documented_terms(calibration):
    """One trn2 fit row fits one term: the fixed cost, on the documented issue cost, issue queues, LNC and bandwidth;
    trn1's fitted HBM efficiency is a sensitivity variant, not carried into trn2's terms."""
    rng = np.random.default_rng()
    trn1_truth = cost_model.CostTerms(hbm_efficiency=0.55, step_fixed_us=float(rng.uniform(500, 5000)))
    rows = []
    for k in range(3):
        row = _Synthetic(calibration.ROWS[k], float(rng.uniform(0.5, 20)), int(rng.integers(100, 20000)))
        row.row = dataclasses.replace(row.row, published_ms=row.step_ms(trn1_truth))
        rows.append(row)
    trn2_rows = [r for r in calibration.ROWS if r.source in (calibration.L70B, calibration.L405B)]
    for template in trn2_rows:
        published = float(rng.uniform(15, 40))
        rows.append(_Synthetic(template, float(rng.uniform(0.5, 5)), int(rng.integers(100, 20000))))
        rows[-1].row = dataclasses.replace(template, published_ms=published)
    fitted = calibration.fit_all(rows)
    trn2 = fitted["trn2"]
    assert (trn2.lnc, trn2.dma_issue_ns, trn2.issue_queues, trn2.hbm_efficiency) == (2, 600.0, 2, 1.0)
    fit_row = next(r for r in rows if r.row.target == "trn2" and r.row.role == "fit")
    expected = max(0.0, fit_row.row.published_ms - fit_row.step_ms(dataclasses.replace(trn2, step_fixed_us=0.0)))
    assert trn2.step_fixed_us == pytest.approx(expected * 1e3, rel=1e-9)
    carried, both = calibration.trn2_sensitivity(rows, fitted)
    assert carried["terms"]["hbm_efficiency"] == fitted["trn1"].hbm_efficiency
    assert both["terms"]["hbm_efficiency"] in calibration.HBM_EFFICIENCY_GRID
    assert set(carried["errors"]) == {r.row.label for r in rows if r.row.target == "trn2"}


def test_padding_rounds_heads_and_vocabulary_up_to_the_tp_degree(calibration):
    assert calibration.padded_shape("CodeLlama-13b", 32)[3:] == (64, 64, 32032)
    assert calibration.padded_shape("Llama-2-70b", 32) == calibration.SHAPES["Llama-2-70b"]
    assert "heads 40 padded to 64" in calibration.padding_note("Llama-2-13b", 32)


def test_every_row_cites_its_source_and_has_a_role(calibration):
    for row in calibration.ROWS:
        assert row.role in ("fit", "held out")
        assert row.source.endswith((".csv", ".md"))
        assert row.cache_len == row.input_len + row.output_len // 2
    for target in cost_model.TARGETS:
        roles = {r.role for r in calibration.ROWS if r.target == target}
        assert roles == {"fit", "held out"}


def test_committed_fitted_terms_are_the_calibration_reports():
    report = json.loads((RESULTS / "calibration.json").read_text())
    for target, terms in report["fitted"].items():
        assert dataclasses.asdict(cost_model.fitted_terms(target)) == terms


def test_committed_calibration_states_its_held_out_verdict():
    report = json.loads((RESULTS / "calibration.json").read_text())
    held = [r for r in report["rows"] if r["role"] == "held out" and r["like_for_like"]]
    assert held, "the calibration report has no like-for-like held-out rows"
    for r in held:
        assert r["fitted_ms"] == pytest.approx(r["published_ms"] * (1 + r["fitted_error"]))
    within = sum(abs(r["fitted_error"]) <= 0.25 for r in held)
    assert f"**{within} of {len(held)}**" in (RESULTS / "calibration.md").read_text()
    # trn1's held-out rows (the table the fit was made for) meet the ±25% target.
    for r in held:
        if r["target"] == "trn1":
            assert abs(r["fitted_error"]) <= 0.25, r["label"]


def test_committed_speed_bands_follow_from_their_cases():
    """speed_bands.json: made at the committed fitted terms; each speedup is the ratio of its cases' latencies and
    lies within its band; each latency lies within its band."""
    report = json.loads((RESULTS / "speed_bands.json").read_text())
    for target, terms in report["fitted"].items():
        assert dataclasses.asdict(cost_model.fitted_terms(target)) == terms
    cases = report["cases"]
    for case in cases.values():
        for target in report["fitted"]:
            low, high = case[target]["band_us"]
            assert low <= case[target]["fitted_us"] <= high * (1 + 1e-12)
    assert report["speedups"]
    for s in report["speedups"]:
        for target in report["fitted"]:
            slow, fast = cases[s["slow"]][target], cases[s["fast"]][target]
            assert s[target]["documented"] == pytest.approx(slow["documented_us"] / fast["documented_us"])
            assert s[target]["fitted"] == pytest.approx(slow["fitted_us"] / fast["fitted_us"])
            low, high = s[target]["band"]
            assert low <= s[target]["fitted"] * (1 + 1e-12) and s[target]["fitted"] <= high * (1 + 1e-12)
