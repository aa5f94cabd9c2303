"""Instructions per second of the NKI emulator, with numerics on and in count-only mode.

    python benchmarks/emulator_speed.py --k=2048 --m=1280 --n=1024 --repeats=3

Runs a blocked bf16 matmul kernel (out[M, N] = lhs_t[K, M].T @ rhs[K, N], 128x128x512 tiles, lhs_t
tiles hoisted per m-block) and prints instructions, seconds and instructions/second per mode, plus the
ratio of the two measured side by side in one run.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
from absl import app, flags

from nki_kernels import emulator
from nki_kernels.binding import nki, nisa, nl
from nki_kernels.emulator import trace

FLAGS = flags.FLAGS
flags.DEFINE_integer("k", 2048, "contraction size")
flags.DEFINE_integer("m", 1280, "rows of the output (stationary side)")
flags.DEFINE_integer("n", 1024, "columns of the output (moving side)")
flags.DEFINE_integer("repeats", 3, "timed runs per mode (best is reported)")


@nki.jit
def blocked_matmul(lhs_t, rhs):
    """out[M, N] = lhs_t[K, M].T @ rhs[K, N] in lhs_t's dtype, fp32 PSUM accumulation."""
    k_total, m_total = lhs_t.shape
    _, n_total = rhs.shape
    tk, tm, tn = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax
    out = nl.ndarray((m_total, n_total), lhs_t.dtype, buffer=nl.shared_hbm)
    for m in range(0, m_total, tm):
        mt = min(tm, m_total - m)
        lhs_tiles = []
        for k in range(0, k_total, tk):
            kt = min(tk, k_total - k)
            tile = nl.ndarray((kt, mt), lhs_t.dtype, buffer=nl.sbuf)
            nisa.dma_copy(tile, lhs_t[k:k + kt, m:m + mt])
            lhs_tiles.append(tile)
        for n in range(0, n_total, tn):
            nt = min(tn, n_total - n)
            acc = nl.ndarray((mt, nt), nl.float32, buffer=nl.psum)
            for i, k in enumerate(range(0, k_total, tk)):
                kt = min(tk, k_total - k)
                moving = nl.ndarray((kt, nt), rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(moving, rhs[k:k + kt, n:n + nt])
                nisa.nc_matmul(acc, lhs_tiles[i], moving)
            result = nl.ndarray((mt, nt), out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(result, acc)
            nisa.dma_copy(out[m:m + mt, n:n + nt], result)
    return out


def _timed(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    lhs_t = rng.standard_normal((FLAGS.k, FLAGS.m)).astype(ml_dtypes.bfloat16)
    rhs = rng.standard_normal((FLAGS.k, FLAGS.n)).astype(ml_dtypes.bfloat16)
    runs = []
    trace.add_listener(runs.append)
    try:
        blocked_matmul(lhs_t, rhs)
    finally:
        trace.remove_listener(runs.append)
    instructions = len(runs[0].records)

    def count_only():
        with emulator.count_only():
            blocked_matmul(lhs_t, rhs)

    numerics_s = _timed(lambda: blocked_matmul(lhs_t, rhs), FLAGS.repeats)
    count_s = _timed(count_only, FLAGS.repeats)
    print(f"blocked bf16 matmul K={FLAGS.k} M={FLAGS.m} N={FLAGS.n}: {instructions} instructions")
    print(f"{'mode':<12}{'seconds':>10}{'instr/s':>12}")
    print(f"{'numerics':<12}{numerics_s:>10.3f}{instructions / numerics_s:>12.0f}")
    print(f"{'count-only':<12}{count_s:>10.3f}{instructions / count_s:>12.0f}")
    print(f"count-only is {numerics_s / count_s:.1f}x faster than numerics")


if __name__ == "__main__":
    app.run(main)
