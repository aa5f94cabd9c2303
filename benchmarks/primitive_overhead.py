"""Overhead of the svd_matmul primitive vs hand-written (x@u)@v, both jitted, on CPU XLA.

Both run side by side in one process, call by call alternately, best-of-N wall
time per call; prints time ratios (target ≤ 1.05) and whether XLA compiled the
two to the same optimized HLO (instructions compared without names or metadata).

    python benchmarks/primitive_overhead.py --repeats 60
"""

import re
import time

import jax
import numpy as np
from absl import app, flags

import jax_neuronmm as jn

flags.DEFINE_integer("repeats", 60, "Timed calls per implementation and shape.", lower_bound=1)
FLAGS = flags.FLAGS

SHAPES = [  # (tokens, K, r, N)
    (1, 2048, 1280, 8192),
    (16, 2048, 512, 2048),
    (128, 1024, 256, 4096),
    (512, 2048, 1024, 2048),
]


def timed_call(fn, args):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    return time.perf_counter() - start


def best_times_alternating(fns, args, repeats):
    """Best wall time of each function, calls alternating so machine noise hits all alike."""
    for fn in fns:
        fn(*args).block_until_ready()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], timed_call(fn, args))
    return best


def hlo_instructions(fn, args):
    """The optimized HLO's entry instructions with names, metadata and configs stripped."""
    text = fn.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY") :]
    lines = []
    for line in entry.splitlines()[1:]:
        line = re.sub(r", (metadata|backend_config)=.*", "", line.strip())
        line = re.sub(r"%[\w.]+", "%", line)
        if line and line != "}":
            lines.append(line)
    return lines


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    primitive = jax.jit(jn.svd_matmul)
    handwritten = jax.jit(lambda x, u, v: (x @ u) @ v)
    print(
        f"{'tokens':>6} {'K':>5} {'r':>5} {'N':>5} {'svd_matmul ms':>14} {'(x@u)@v ms':>11} {'ratio':>6} "
        f"{'same HLO':>8}"
    )
    ratios = []
    for t, k, r, n in SHAPES:
        args = [rng.standard_normal(s).astype(np.float32) for s in ((t, k), (k, r), (r, n))]
        ours, theirs = best_times_alternating([primitive, handwritten], args, FLAGS.repeats)
        same = hlo_instructions(primitive, args) == hlo_instructions(handwritten, args)
        ratio = ours / theirs
        ratios.append(ratio)
        print(
            f"{t:>6} {k:>5} {r:>5} {n:>5} {ours * 1e3:>14.3f} {theirs * 1e3:>11.3f} {ratio:>6.3f} "
            f"{'yes' if same else 'no':>8}"
        )
    print(f"geometric mean ratio: {np.exp(np.mean(np.log(ratios))):.3f} (target <= 1.05)")


if __name__ == "__main__":
    app.run(main)
