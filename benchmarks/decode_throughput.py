"""Decode throughput: dense vs SVD-compressed (keep 0.8) Llama, measured on CPU and modeled on Trainium.

1. Measured, CPU XLA: a random-init Llama at Llama-3.2-1B width (hidden 2048, MLP 8192, GQA 32/8) with a few
   layers and a small vocabulary, so that MLP weights dominate the bytes a decode step reads (as they do in the
   full model). Dense, MLP-compressed (as the paper does) and MLP+attention-compressed models generate in
   alternating rounds in one process; the report gives decode tokens/s of each (median over rounds) and the
   ratios to dense (target >= 1.2x), next to the parameter ratios that bound them at batch 1.
2. Modeled, Trainium: for the paper's five models, the MLP time per decode token (T = 1, bf16) of the dense MLP
   (three tutorial-style matmul kernels) vs the fused low-rank MLP (svd_mlp gate/up + down kernels at the
   block-aligned rank keeping 80% of parameters), from count-only emulator runs and the trn1/trn2 cost model.

    python benchmarks/decode_throughput.py              # both parts (a few minutes on 2 cores)
    python benchmarks/decode_throughput.py --quick      # 2 layers, fewer tokens, 2 paper models
"""

from __future__ import annotations

import os
import statistics
import time

# One BLAS thread for the SVDs: OpenBLAS threads spinning against each other (and XLA) on a busy 2-core machine
# made them ten times slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import _flag_checks  # noqa: E402  (sibling module: the script's folder is on sys.path)
import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from harness import paper_shapes  # noqa: E402  (sibling package: the script's folder is on sys.path)

from jax_neuronmm import models, pipeline  # noqa: E402
from nki_kernels import dispatch, hardware, ranks  # noqa: E402
from nki_kernels.baseline_matmul import baseline_matmul_kernel, fit_baseline_blocks  # noqa: E402
from nki_kernels.emulator import count_only, profile  # noqa: E402

flags.DEFINE_bool("quick", False, "smaller run: 2 layers, 16 new tokens, 3 rounds, 2 paper models")
flags.DEFINE_integer("num_layers", 3, "decoder layers of the measured model", lower_bound=1)
flags.DEFINE_integer(
    "vocab_size", 1024, "vocabulary of the measured model (small: the head is not the subject)", lower_bound=1
)
flags.DEFINE_integer("prompt_len", 8, "prompt tokens", lower_bound=1)
# generate(n) - generate(1) times n - 1 decode steps: at least one.
flags.DEFINE_integer("new_tokens", 48, "tokens generated per round (at least 2)", lower_bound=2)
flags.DEFINE_integer("rounds", 5, "alternating dense / compressed rounds", lower_bound=1)
flags.DEFINE_float("keep", paper_shapes.PAPER_KEEP, "fraction of MLP parameters kept, in (0, 1]")
flags.DEFINE_bool("skip_measured", False, "only the modeled Trainium table")
flags.DEFINE_bool("skip_modeled", False, "only the measured CPU comparison")
FLAGS = flags.FLAGS
MEASURED_FLAGS = ("num_layers", "vocab_size", "prompt_len", "new_tokens", "rounds", "keep")
_flag_checks.fraction("keep")
_flag_checks.not_with("quick", ("num_layers", "new_tokens", "rounds"), "sets the layers, new tokens and rounds")
_flag_checks.not_with("skip_measured", MEASURED_FLAGS, "skips the measured comparison those flags configure")
flags.register_multi_flags_validator(
    ["skip_measured", "skip_modeled"],
    lambda values: not (values["skip_measured"] and values["skip_modeled"]),
    message="--skip_measured and --skip_modeled together leave nothing to run; give at most one",
)

TARGET_RATIO = 1.2
BF16 = np.dtype(ml_dtypes.bfloat16)


def measured_cpu(num_layers, new_tokens, rounds):
    model = models.from_preset(
        "llama", "1b", num_layers=num_layers, vocab_size=FLAGS.vocab_size, tie_word_embeddings=False
    )
    start = time.perf_counter()
    compressed_mlp = pipeline.compress_model(model, pipeline.Recipe(keep=FLAGS.keep, include=("mlp",), method="svd"))
    # Attention factored on top of the MLP-compressed model: its MLP factors are reused as they are.
    compressed_all = pipeline.compress_model(
        compressed_mlp, pipeline.Recipe(keep=FLAGS.keep, include=("attention",), method="svd")
    )
    print(f"compressed {num_layers} layers at keep {FLAGS.keep} in {time.perf_counter() - start:.1f} s")
    prompt = np.random.default_rng(0).integers(0, FLAGS.vocab_size, size=(1, FLAGS.prompt_len))
    contenders = {"dense": model, "compressed MLP": compressed_mlp, "compressed MLP + attention": compressed_all}

    def decode_seconds(m):
        # generate(n) - generate(1): prefill and the first token cancel, leaving n - 1 decode steps.
        t0 = time.perf_counter()
        models.generate(m, prompt, 1).block_until_ready()
        t1 = time.perf_counter()
        models.generate(m, prompt, new_tokens).block_until_ready()
        t2 = time.perf_counter()
        return (t2 - t1) - (t1 - t0)

    for m in contenders.values():  # compile prefill / decode for both lengths
        decode_seconds(m)
    seconds = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, m in contenders.items():
            seconds[name].append(decode_seconds(m))
    rates = {name: (new_tokens - 1) / statistics.median(s) for name, s in seconds.items()}
    params = {name: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param))) for name, m in contenders.items()}
    print(
        f"\n## Measured decode on CPU XLA (fp32, batch 1, {num_layers} layers at Llama-3.2-1B width, "
        f"vocab {FLAGS.vocab_size}, median of {rounds} alternating rounds of {new_tokens - 1} decode steps)\n"
    )
    # Batch-1 decode is memory bound, so the parameter ratio is about the best speedup to expect.
    print(
        "| model | parameters | decode tokens/s | speed ÷ dense | parameter ratio (ceiling) | target >= "
        f"{TARGET_RATIO}x |\n|---|---|---|---|---|---|"
    )
    for name in contenders:
        ratio = rates[name] / rates["dense"]
        verdict = "" if name == "dense" else ("met" if ratio >= TARGET_RATIO else "NOT met")
        print(
            f"| {name} | {params[name] / 1e6:.1f} M | {rates[name]:.2f} | {ratio:.3f}x | "
            f"{params['dense'] / params[name]:.3f}x | {verdict} |"
        )


def _counted(fn):
    with count_only(), profile() as prof:
        fn()
    return prof.runs


def modeled_mlp_us(h, i, r):
    """{target: µs} of one decode token's MLP, dense and fused low-rank (bf16, T = 1)."""
    x = np.zeros((1, h), BF16)
    dense_runs = []
    for k, n in ((h, i), (h, i), (i, h)):  # gate, up, down
        blocks = fit_baseline_blocks(1, k, n, BF16.itemsize, hardware.SBUF_BYTES_PER_PARTITION["trn1"])
        dense_runs += _counted(lambda: baseline_matmul_kernel(np.zeros((k, 1), BF16), np.zeros((k, n), BF16), **blocks))
    dense = {t: sum(run.latency_us[t] for run in dense_runs) for t in hardware.TARGETS}
    fused = {}
    for target in hardware.TARGETS:
        (gate_up, gate_up_kwargs), (down, down_kwargs) = dispatch.svd_mlp_plan(1, h, i, r, r, r, BF16, target)
        runs = _counted(
            lambda: gate_up(
                x,
                np.zeros((h, r), BF16),
                np.zeros((r, i), BF16),
                np.zeros((h, r), BF16),
                np.zeros((r, i), BF16),
                **gate_up_kwargs,
            )
        )
        runs += _counted(
            lambda: down(np.zeros((i, 1), BF16), np.zeros((i, r), BF16), np.zeros((r, h), BF16), **down_kwargs)
        )
        fused[target] = sum(run.latency_us[target] for run in runs)
    return dense, fused


def modeled_table(model_names):
    print(
        f"\n## Modeled MLP time per decode token on Trainium (bf16, T = 1, keep {paper_shapes.PAPER_KEEP}; "
        "count-only emulator + cost model, not measured)\n"
    )
    print(
        "| model | H | I | rank | trn1 dense µs | trn1 fused µs | trn1 speedup | trn2 dense µs | trn2 fused µs "
        "| trn2 speedup |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for name in model_names:
        h, i = paper_shapes.PAPER_MLP_SHAPES[name]
        r = ranks.block_aligned_rank(h, i, paper_shapes.PAPER_KEEP)
        dense, fused = modeled_mlp_us(h, i, r)
        cells = "".join(f"| {dense[t]:.1f} | {fused[t]:.1f} | {dense[t] / fused[t]:.2f}x " for t in hardware.TARGETS)
        print(f"| {name} | {h} | {i} | {r} {cells}|", flush=True)


def main(argv):
    del argv
    quick = FLAGS.quick
    if not FLAGS.skip_measured:
        measured_cpu(2 if quick else FLAGS.num_layers, 16 if quick else FLAGS.new_tokens, 3 if quick else FLAGS.rounds)
    if not FLAGS.skip_modeled:
        names = list(paper_shapes.PAPER_MLP_SHAPES)
        modeled_table(names[:2] if quick else names)


if __name__ == "__main__":
    app.run(main)
