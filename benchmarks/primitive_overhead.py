"""Overhead of the svd_matmul primitive vs hand-written (x@u)@v, both jitted, on CPU XLA.

Both run side by side in one process, interleaved, best-of-N wall time per call;
prints time ratios (target ≤ 1.05).

    python benchmarks/primitive_overhead.py --repeats 30
"""

import time

import jax
import numpy as np
from absl import app, flags

import jax_neuronmm as jn

flags.DEFINE_integer("repeats", 30, "Timed calls per implementation and shape.")
FLAGS = flags.FLAGS

SHAPES = [  # (tokens, K, r, N)
    (1, 2048, 1280, 8192),
    (16, 2048, 512, 2048),
    (128, 1024, 256, 4096),
    (512, 2048, 1024, 2048),
]


def best_time(fn, args, repeats):
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    primitive = jax.jit(jn.svd_matmul)
    handwritten = jax.jit(lambda x, u, v: (x @ u) @ v)
    print(f"{'tokens':>6} {'K':>5} {'r':>5} {'N':>5} {'svd_matmul ms':>14} {'(x@u)@v ms':>11} {'ratio':>6}")
    ratios = []
    for t, k, r, n in SHAPES:
        args = [rng.standard_normal(s).astype(np.float32) for s in ((t, k), (k, r), (r, n))]
        # Alternate the two so machine noise hits both alike.
        ours, theirs = [], []
        for _ in range(3):
            ours.append(best_time(primitive, args, FLAGS.repeats // 3))
            theirs.append(best_time(handwritten, args, FLAGS.repeats // 3))
        ratio = min(ours) / min(theirs)
        ratios.append(ratio)
        print(f"{t:>6} {k:>5} {r:>5} {n:>5} {min(ours) * 1e3:>14.3f} {min(theirs) * 1e3:>11.3f} {ratio:>6.3f}")
    print(f"geometric mean ratio: {np.exp(np.mean(np.log(ratios))):.3f} (target <= 1.05)")


if __name__ == "__main__":
    app.run(main)
