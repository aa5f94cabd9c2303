"""Quickstart: replace a dense projection by its SVD factors and call svd_matmul under jit.

Shows the jaxpr (one svd_matmul equation), the error against the dense product it
replaces, and the parameter savings.

    python examples/quickstart.py --tokens 64 --in_features 1024 --out_features 4096 --keep 0.5

The rank is the library's rule, `compress.block_aligned_rank(K, N, keep, block)`: the kept parameter fraction
rounded to a multiple of --block (the 128-row PE array), as `compress_model` and `compress_checkpoint` choose it.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jax_neuronmm as jn
from jax_neuronmm import compress

flags.DEFINE_integer("tokens", 64, "Tokens (rows of x).", lower_bound=1)
flags.DEFINE_integer("in_features", 1024, "K: input features.", lower_bound=1)
flags.DEFINE_integer("out_features", 4096, "N: output features.", lower_bound=1)
flags.DEFINE_float("keep", 0.5, "Fraction of the dense weight's parameters kept by the factors, in (0, 1].")
flags.DEFINE_integer("block", 128, "Rank alignment (compress.block_aligned_rank).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.register_validator("keep", lambda keep: 0 < keep <= 1, message="--keep must lie in (0, 1]")
FLAGS = flags.FLAGS


def low_rank_weight(rng, k, n, spectrum_decay=0.01):
    """A K×N weight whose singular values decay, as trained projections' do."""
    q1, _ = np.linalg.qr(rng.standard_normal((k, min(k, n))))
    q2, _ = np.linalg.qr(rng.standard_normal((n, min(k, n))))
    sigma = np.exp(-spectrum_decay * np.arange(min(k, n)))
    return (q1 * sigma) @ q2.T


def main(argv):
    del argv
    rng = np.random.default_rng(FLAGS.seed)
    k, n = FLAGS.in_features, FLAGS.out_features
    rank = compress.block_aligned_rank(k, n, FLAGS.keep, FLAGS.block)  # the library's rank rule
    w = low_rank_weight(rng, k, n)
    left, sigma, right = np.linalg.svd(w, full_matrices=False)
    u = (left[:, :rank] * np.sqrt(sigma[:rank])).astype(np.float32)
    v = (np.sqrt(sigma[:rank])[:, None] * right[:rank]).astype(np.float32)
    x = rng.standard_normal((FLAGS.tokens, k)).astype(np.float32)

    @jax.jit
    def layer(x, u, v):
        return jax.nn.silu(jn.svd_matmul(x, u, v))

    print("jaxpr of the jitted layer:")
    print(jax.make_jaxpr(layer)(x, u, v))
    y = layer(x, u, v)
    dense = jax.nn.silu(jnp.asarray(x @ w.astype(np.float32)))
    rel = float(jnp.linalg.norm(y - dense) / jnp.linalg.norm(dense))
    print(f"shape x {x.shape} · u {u.shape} · v {v.shape} -> y {y.shape}")
    print(f"relative error vs the dense layer it replaces: {rel:.3e}")
    print(
        f"parameters: dense {k * n:,}  factors {rank * (k + n):,}  ({rank * (k + n) / (k * n):.1%} kept, rank {rank})"
    )


if __name__ == "__main__":
    app.run(main)
