"""What the benchmarks measure the kernels with, kept out of the kernel package: the decode step's per-layer and
per-op compositions and their runner, the comparison of the compositions on the cost model, the unfused baselines
and the paper's MLP shapes. Scripts in benchmarks/ import it as a sibling (`from harness import ...`; the script's
folder is on sys.path); tests through pytest.ini's pythonpath."""
