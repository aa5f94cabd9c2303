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
