"""Instructions per second of the NKI emulator, with numerics on and in count-only mode.

    python benchmarks/emulator_speed.py --k=2048 --m=1280 --n=1024 --repeats=3

Two workloads, each timed in both modes side by side in one run (best of --repeats):
- matmul: the AWS-style baseline kernel (`baseline_matmul_kernel`, tutorial blocks) on bf16
  out[M, N] = lhs_t[K, M].T @ rhs[K, N];
- mlp: the issue's reference workload, one Llama-3.2-1B-sized low-rank MLP layer (hidden 2048, intermediate
  8192, rank 1280, 128 tokens, bf16) through the fused `svd_mlp_gate_up_kernel` + `svd_mlp_down_kernel` with
  the block sizes `dispatch.svd_mlp_plan` picks.
Prints instructions, seconds and instructions/second per workload and mode, and the count-only speed-up.
"""

from __future__ import annotations

import time

import _flag_checks  # sibling module: the script's folder is on sys.path
import ml_dtypes
import numpy as np
from absl import app, flags

from nki_kernels import emulator
from nki_kernels.baseline_matmul import TUTORIAL_BLOCKS, baseline_matmul_kernel
from nki_kernels.dispatch import svd_mlp_plan
from nki_kernels.emulator import trace
from nki_kernels.svd_mlp import svd_mlp_down_kernel, svd_mlp_gate_up_kernel

FLAGS = flags.FLAGS
flags.DEFINE_integer("k", 2048, "contraction size of the matmul workload", lower_bound=1)
flags.DEFINE_integer("m", 1280, "rows of the matmul output (stationary side)", lower_bound=1)
flags.DEFINE_integer("n", 1024, "columns of the matmul output (moving side)", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "timed runs per workload and mode (best is reported)", lower_bound=1)
flags.DEFINE_string("target", "trn1", "emulated target (trn1 or trn2): block sizes and hardware rules")
_flag_checks.target("target")

# The reference layer: Llama-3.2-1B's MLP with every factor at rank 1280.
MLP_TOKENS, MLP_HIDDEN, MLP_INTERMEDIATE, MLP_RANK = 128, 2048, 8192, 1280


def _timed(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _instructions(fn):
    """Instructions the kernel launches in fn() execute, summed over launches."""
    runs = []
    trace.add_listener(runs.append)
    try:
        fn()
    finally:
        trace.remove_listener(runs.append)
    return sum(len(run.records) for run in runs)


def _matmul_workload(rng):
    lhs_t = rng.standard_normal((FLAGS.k, FLAGS.m)).astype(ml_dtypes.bfloat16)
    rhs = rng.standard_normal((FLAGS.k, FLAGS.n)).astype(ml_dtypes.bfloat16)
    label = f"baseline bf16 matmul K={FLAGS.k} M={FLAGS.m} N={FLAGS.n}"
    return label, lambda: baseline_matmul_kernel(lhs_t, rhs, **TUTORIAL_BLOCKS)


def _mlp_workload(rng):
    t, h, i, r = MLP_TOKENS, MLP_HIDDEN, MLP_INTERMEDIATE, MLP_RANK

    def factor(rows, cols):  # scaled so activations stay O(1) through the chain
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(ml_dtypes.bfloat16)

    x = rng.standard_normal((t, h)).astype(ml_dtypes.bfloat16)
    gate_u, gate_v, up_u, up_v = factor(h, r), factor(r, i), factor(h, r), factor(r, i)
    down_u, down_v = factor(i, r), factor(r, h)
    (_, gate_up_kwargs), (_, down_kwargs) = svd_mlp_plan(t, h, i, r, r, r, ml_dtypes.bfloat16, FLAGS.target)

    def layer():
        hT = svd_mlp_gate_up_kernel(x, gate_u, gate_v, up_u, up_v, **gate_up_kwargs)
        return svd_mlp_down_kernel(hT, down_u, down_v, **down_kwargs)

    label = f"low-rank MLP T={t} H={h} I={i} r={r} bf16 (gate_up {gate_up_kwargs}, down {down_kwargs})"
    return label, layer


def _report(label, fn):
    instructions = _instructions(fn)

    def count_only():
        with emulator.count_only():
            fn()

    numerics_s = _timed(fn, FLAGS.repeats)
    count_s = _timed(count_only, FLAGS.repeats)
    print(f"{label}: {instructions} instructions")
    print(f"{'mode':<12}{'seconds':>10}{'instr/s':>12}")
    print(f"{'numerics':<12}{numerics_s:>10.3f}{instructions / numerics_s:>12.0f}")
    print(f"{'count-only':<12}{count_s:>10.3f}{instructions / count_s:>12.0f}")
    print(f"count-only is {numerics_s / count_s:.1f}x faster than numerics\n")


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    with emulator.use_target(FLAGS.target):
        for workload in (_matmul_workload, _mlp_workload):
            _report(*workload(rng))


if __name__ == "__main__":
    app.run(main)
