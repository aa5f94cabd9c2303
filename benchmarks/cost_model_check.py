"""Modeled vs published latencies of AWS's public NKI example kernels (not used to build the model).

    python benchmarks/cost_model_check.py --sdk_path=/path/to/aws-neuron-sdk [--cases=matmul_tiled,...]

`--sdk_path` is a checkout of github.com/aws-neuron/aws-neuron-sdk; kernels are imported unmodified
from its nki/examples folder inside `emulator.as_nki()` and traced in count-only mode (no numerics),
then `cost_model` models each run on trn1 and trn2. "DMA eff" is the byte-weighted throughput of the
run's DMAs relative to peak under the documented size curve (cost_model.dma_efficiency). Published
numbers are device measurements from AWS's tutorials (sources below); they include per-execution
start-up that the model leaves out.
Prints modeled / published ratios as they come out: nothing here is fitted to them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from collections.abc import Callable

import _flag_checks  # sibling module: the script's folder is on sys.path
import ml_dtypes
import numpy as np
from absl import app, flags

from nki_kernels import emulator
from nki_kernels.emulator import cost_model, trace

FLAGS = flags.FLAGS
flags.DEFINE_string("sdk_path", None, "checkout of aws-neuron/aws-neuron-sdk", required=True)
flags.DEFINE_list("cases", [], "case names to run (default: all)")
_flag_checks.directory_with("sdk_path", os.path.join("nki", "examples"), "aws-neuron/aws-neuron-sdk")
_flag_checks.choice_list("cases", lambda: [case.name for case in CASES], optional=True)

# The accuracy the model is held to: modeled / published within ±30%.
TOLERANCE = 0.30
MATMUL_FILE = "matrix_multiplication/matrix_multiplication_nki_kernels.py"
MAMBA_FILE = "fused_mamba/mamba_nki_kernels.py"
# Matmul tutorial, "Latency (ms)" table: [4096, 8192] @ [8192, 8192], bf16, Trn1.32xlarge
# (aws-neuron-sdk nki/tutorials/matrix_multiplication.rst, e.g. commit 1db4d74e, Oct 2025).
MATMUL_SOURCE = "matmul tutorial table (trn1.32xlarge)"
# Fused Mamba tutorial, nki/guides/tutorials/fused_mamba.rst: device execution latencies quoted in the
# text and the seq_len scaling table (channels 4096, state 16, batch 1, fp32). The instance type
# is not stated there; it is compared with trn1 here and the trn2 ratio is printed as well.
MAMBA_SOURCE = "fused mamba tutorial (instance not stated)"
# Kernel optimization tutorial, nki/guides/tutorials/kernel-optimization.rst: the same tiled and hoisted
# kernels (the examples' nki_matmul_tiled_ / nki_matmul_hoist_load_ line for line) on float32
# [4096, 8192] @ [8192, 8192] inputs, compiled for trn2 (NEURON_PLATFORM_TARGET_OVERRIDE); latency = the
# end of the profile timeline in its figures how-to/v2-full.png (39,894,938 ns) and v3-full.png
# (28,197,982 ns). Its blocked versions (v4, v5) are left out: in float32 the free-dimension-blocked
# kernel's live tiles exceed SBUF in the emulator (the compiler spills), and v5 is not the examples' kernel.
KERNEL_OPT_SOURCE = "kernel optimization tutorial profiles (trn2, fp32)"


@dataclasses.dataclass
class Case:
    name: str
    file: str  # relative to nki/examples
    kernel: str
    make_args: Callable[[], tuple]
    published_us: float
    target: str  # the target the published number was measured on
    source: str
    flops: float  # useful flops, for the roofline floor
    matmul_dtype: str = "bfloat16"


def _matmul_case(kernel, published_ms, dtype=ml_dtypes.bfloat16, target="trn1", source=MATMUL_SOURCE):
    k, m, n = 8192, 4096, 8192

    def make():
        return (np.zeros((k, m), dtype), np.zeros((k, n), dtype))

    name = f"matmul_{kernel.removeprefix('nki_matmul_').rstrip('_')}"
    if source != MATMUL_SOURCE:
        name += f"_{np.dtype(dtype).name}_{target}"
    return Case(
        name, MATMUL_FILE, kernel, make, published_ms * 1e3, target, source, 2.0 * k * m * n, np.dtype(dtype).name
    )


def _mamba_case(kernel, channels, seq_len, published_us):
    batch, state = 1, 16

    def make():
        f32 = np.float32
        return (
            np.zeros((batch, channels, seq_len), f32),
            np.zeros((batch, channels, seq_len), f32),
            np.zeros((channels, state), f32),
            np.zeros((batch, state, seq_len), f32),
            np.zeros((batch, state, seq_len), f32),
        )

    return Case(
        f"{kernel}_c{channels}_s{seq_len}", MAMBA_FILE, kernel, make, published_us, "trn1", MAMBA_SOURCE, 0.0, "float32"
    )


CASES = [
    _matmul_case("nki_matmul_tiled_", 51.80),
    _matmul_case("nki_matmul_hoist_load_", 42.96),
    _matmul_case("nki_matmul_block_free_dimension_", 22.07),
    _matmul_case("nki_matmul_fully_optimized_", 6.97),
    _matmul_case("nki_matmul_tiled_", 39.894938, np.float32, "trn2", KERNEL_OPT_SOURCE),
    _matmul_case("nki_matmul_hoist_load_", 28.197982, np.float32, "trn2", KERNEL_OPT_SOURCE),
    _mamba_case("mamba_v1", 256, 512, 172.93),
    _mamba_case("mamba_v1", 4096, 512, 2340.0),
    _mamba_case("mamba_v2", 4096, 512, 1610.0),
    _mamba_case("mamba_v3", 4096, 2048, 6600.0),
]


def _load_kernel(sdk_path, file, kernel):
    path = os.path.join(sdk_path, "nki", "examples", file)
    spec = importlib.util.spec_from_file_location(f"aws_example_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    with emulator.as_nki():
        spec.loader.exec_module(module)
    return getattr(module, kernel)


def _run_case(case, sdk_path):
    """(RunSummary, DMA efficiency of the run's traffic, seconds to emulate and model it)."""
    kernel = _load_kernel(sdk_path, case.file, case.kernel)
    args = case.make_args()
    raw_runs = []
    trace.add_listener(raw_runs.append)
    started = time.perf_counter()
    try:
        with emulator.use_target(case.target), emulator.count_only(), emulator.profile() as prof:
            kernel(*args)
        (run,) = prof.runs
        run.latency_us["trn1"], run.latency_us["trn2"]  # modeled on first read: time it here
    finally:
        trace.remove_listener(raw_runs.append)
    emulated_s = time.perf_counter() - started
    return run, _dma_efficiency(raw_runs[0]), emulated_s


def _dma_efficiency(raw_run):
    """Bytes / (bytes at each DMA's modeled size-dependent rate): 1.0 when every buffer is >= 32 KiB."""
    moved = weighted = 0.0
    for record in raw_run.records:
        if record.dma is not None:
            moved += record.dma.nbytes
            weighted += record.dma.nbytes / cost_model.dma_efficiency(cost_model.dma_buffer_bytes(record))
    return moved / weighted if weighted else 1.0


def main(argv):
    del argv
    sdk_path = os.path.expanduser(FLAGS.sdk_path)
    chosen = [c for c in CASES if not FLAGS.cases or c.name in FLAGS.cases]
    header = (
        f"{'case':34s} {'published':>12s} {'on':>4s} {'model trn1':>11s} {'model trn2':>11s} "
        f"{'ratio':>6s} {'roofline':>9s} {'instr':>7s} {'HBM MiB':>8s} {'DMA eff':>7s} {'emul s':>7s}"
    )
    print(header)
    print("-" * len(header))
    ratios = {}
    for case in chosen:
        try:
            run, dma_efficiency, emulated_s = _run_case(case, sdk_path)
        except Exception as err:  # report and go on: one unsupported kernel must not hide the rest
            print(f"{case.name:34s} {case.published_us:10.1f}us  NOT RUN: {type(err).__name__}: {err}")
            continue
        hbm = run.hbm_bytes_read + run.hbm_bytes_written
        floor = cost_model.roofline_us(case.flops, hbm, case.target, case.matmul_dtype)
        ratio = run.latency_us[case.target] / case.published_us
        ratios[case.name] = ratio
        print(
            f"{case.name:34s} {case.published_us:10.1f}us {case.target:>4s} "
            f"{run.latency_us['trn1']:9.1f}us {run.latency_us['trn2']:9.1f}us {ratio:6.2f} "
            f"{floor:7.1f}us {run.instructions:7d} {hbm / 2**20:8.1f} {dma_efficiency:7.3f} "
            f"{emulated_s:7.1f}"
        )
    if ratios:
        values = list(ratios.values())
        worst = max(ratios, key=lambda name: abs(ratios[name] - 1.0))
        outside = [name for name, r in ratios.items() if abs(r - 1.0) > TOLERANCE]
        print(
            f"\nmodeled / published on the published target: geometric mean "
            f"{float(np.exp(np.mean(np.log(values)))):.2f}, min {min(values):.2f}, max {max(values):.2f} "
            f"over {len(values)} kernels"
        )
        print(
            f"worst: {worst} {ratios[worst]:.2f}; outside ±{TOLERANCE:.0%}: {', '.join(outside) if outside else 'none'}"
        )
    print("sources:", MATMUL_SOURCE, "|", KERNEL_OPT_SOURCE, "|", MAMBA_SOURCE)


if __name__ == "__main__":
    app.run(main)
