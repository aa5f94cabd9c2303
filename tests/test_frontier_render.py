"""benchmarks/results/frontier.md is what benchmarks/frontier.py renders from benchmarks/results/frontier.json alone:
every figure of the report can be recomputed from the JSON (--render_only traces and measures nothing)."""

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def test_frontier_markdown_rerenders_from_its_json(tmp_path):
    shutil.copy(RESULTS / "frontier.json", tmp_path / "frontier.json")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "frontier.py"), "--render_only", f"--out_dir={tmp_path}"],
        check=True,
        env=env,
        timeout=600,
    )
    assert (tmp_path / "frontier.md").read_text() == (RESULTS / "frontier.md").read_text()


def _frontier_render():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import frontier_render
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return frontier_render


def test_rows_are_ordered_only_beyond_both_intervals():
    """A faster row dominates another only when its whole interval lies below the other's; overlapping intervals
    (or a row without one) leave both on the frontier."""
    render = _frontier_render()
    ratio = render.Ratio
    points = {
        "fast, clearly better": (2.0, ratio(1.010, 1.006, 1.014, True)),
        "slow, clearly worse": (1.5, ratio(1.040, 1.030, 1.050, True)),
        "slow, overlapping": (1.2, ratio(1.016, 1.011, 1.021, True)),
        "slow, no interval": (1.1, ratio(1.100, 1.100, 1.100, False)),
    }
    assert render.frontier(points) == {"fast, clearly better", "slow, overlapping", "slow, no interval"}
    assert ratio(1.01, 1.0, 1.02, True).text() == "1.010 [1.000, 1.020]"
    assert ratio(1.01, 1.01, 1.01, False).text() == "1.010†"


def test_a_rows_ratio_and_interval_come_from_its_windows_against_the_dense_windows_of_its_count():
    import numpy as np

    render = _frontier_render()
    rng = np.random.default_rng()
    windows = int(rng.integers(5, 40))
    dense_nll = rng.uniform(2.0, 4.0, windows)
    model_nll = dense_nll + rng.normal(0.01, 0.02, windows)
    dense = {str(windows): {"novel": {"window_nll": list(dense_nll)}, "ppl_novel": float(np.exp(dense_nll.mean()))}}
    row = {"eval_windows": windows, "novel": {"window_nll": list(model_nll)}, "ppl_novel": 0.0}
    got = render.text_ratio(row, dense, "novel")
    assert got.interval and got.low <= got.ratio <= got.high
    np.testing.assert_allclose(got.ratio, np.exp(model_nll.mean() - dense_nll.mean()), rtol=1e-12)
    legacy = {"eval_windows": windows, "ppl_novel": 1.5 * dense[str(windows)]["ppl_novel"]}
    assert render.text_ratio(legacy, dense, "novel") == render.Ratio(1.5, 1.5, 1.5, False)
