"""benchmarks/results/accuracy_report.md is what benchmarks/accuracy_report.py renders from
benchmarks/results/accuracy_report.json and the hand-written findings alone (--render_only loads no model), and
rendering writes under --out_dir only."""

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def test_accuracy_report_markdown_rerenders_from_its_json(tmp_path):
    shutil.copy(RESULTS / "accuracy_report.json", tmp_path / "accuracy_report.json")
    committed = {name: (RESULTS / name).stat().st_mtime_ns for name in ("accuracy_report.md", "accuracy_report.png")}
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "accuracy_report.py"), "--render_only", f"--out_dir={tmp_path}"],
        check=True,
        env=env,
        timeout=600,
    )
    assert (tmp_path / "accuracy_report.md").read_text() == (RESULTS / "accuracy_report.md").read_text()
    assert (tmp_path / "accuracy_report.png").stat().st_size > 0
    assert {name: (RESULTS / name).stat().st_mtime_ns for name in committed} == committed
