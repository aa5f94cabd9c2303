"""`make demo`: an SVD-compressed Llama generating through the NKI kernels, then dense vs compressed speed.

1. A small random-init Llama is compressed at keep 0.8 (its MLPs become fused low-rank `svd_mlp` calls) and
   generates on the "emulator" backend: every MLP runs as the project's NKI kernels on the CPU emulator of the
   `nki` language. The demo lists the kernels that ran with their modeled trn1 latency and checks that the tokens
   equal those of the XLA backend.
2. A larger random-init Llama (MLP-dominated, as real models are at decode time) decodes on CPU XLA, dense and
   compressed side by side, and the demo prints both tokens/s and their ratio.

Random weights: the generated ids are noise; the kernels, the equality check and the speed are real.
"""

from __future__ import annotations

import collections
import os
import statistics
import time

# The factorizations here are small: one BLAS thread avoids OpenBLAS threads spinning against each other (and
# against XLA) on a busy 2-core machine, which made them ten times slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import jax_neuronmm  # noqa: E402
from jax_neuronmm import models  # noqa: E402

flags.DEFINE_float("keep", 0.8, "fraction of MLP parameters kept")
flags.DEFINE_integer("emulated_tokens", 6, "tokens generated on the emulator")
flags.DEFINE_integer("timed_tokens", 32, "tokens per timed CPU round")
flags.DEFINE_integer("rounds", 3, "alternating dense / compressed CPU rounds")
FLAGS = flags.FLAGS

SMALL = dict(vocab_size=1024, hidden_size=512, intermediate_size=2048, num_layers=2, num_heads=8, num_kv_heads=4,
             head_dim=64)
MEDIUM = dict(vocab_size=1024, hidden_size=1024, intermediate_size=4096, num_layers=3, num_heads=16, num_kv_heads=4,
              head_dim=64, tie_word_embeddings=False)


def emulated_generation():
    model = models.from_preset("llama", "tiny", seed=0, **SMALL)
    compressed = models.compress_model(model, keep=FLAGS.keep)
    mlp = compressed.layers[0].mlp
    print(f"[1] Llama {SMALL['num_layers']} layers, hidden {SMALL['hidden_size']}, MLP {SMALL['intermediate_size']}:"
          f" MLPs compressed at keep {FLAGS.keep} -> rank {mlp.gate_proj.rank} (gate/up), {mlp.down_proj.rank} "
          "(down), block-aligned to the 128-row PE array")
    prompt = np.random.default_rng(0).integers(0, SMALL["vocab_size"], size=(1, 5))
    on_xla = np.asarray(models.generate(compressed, prompt, FLAGS.emulated_tokens))
    start = time.perf_counter()
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        on_emulator = np.asarray(models.generate(compressed, prompt, FLAGS.emulated_tokens))
    seconds = time.perf_counter() - start
    print(f"    prompt {prompt[0].tolist()} -> new ids {on_emulator[0, 5:].tolist()} "
          f"({seconds:.1f} s of emulation; same tokens as XLA: {'yes' if (on_xla == on_emulator).all() else 'NO'})")
    by_kernel = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
    for call in prof.runs:
        row = by_kernel[call.name]
        row[0] += 1
        row[1] += call.latency_us["trn1"]
        row[2] += call.latency_us["trn2"]
        row[3] += call.hbm_bytes_read + call.hbm_bytes_written
    print(f"    NKI kernels run on the emulator ({len(prof.runs)} launches: prefill + "
          f"{FLAGS.emulated_tokens - 1} decode steps x {SMALL['num_layers']} layers x 2 kernels):")
    print(f"    {'kernel':26s} {'launches':>8s} {'HBM MiB':>8s} {'trn1 µs':>9s} {'trn2 µs':>9s}")
    for name, (count, trn1, trn2, hbm) in by_kernel.items():
        print(f"    {name:26s} {count:8d} {hbm / 2**20:8.2f} {trn1:9.1f} {trn2:9.1f}")
    # The first 2 launches per layer are the prefill; the rest are decode steps.
    prefill_launches = 2 * SMALL["num_layers"]
    decode_calls = prof.runs[prefill_launches:]
    per_token = sum(c.latency_us["trn1"] for c in decode_calls) / max(1, len(decode_calls) // prefill_launches)
    print(f"    modeled trn1 MLP time per decode token: {per_token:.1f} µs (fp32 weights; kernel launch time not "
          "modeled)")


def timed_comparison():
    model = models.from_preset("llama", "tiny", seed=1, **MEDIUM)
    start = time.perf_counter()
    compressed = models.compress_model(model, keep=FLAGS.keep)
    print(f"\n[2] Llama {MEDIUM['num_layers']} layers, hidden {MEDIUM['hidden_size']}, MLP "
          f"{MEDIUM['intermediate_size']} on CPU XLA (compressed in {time.perf_counter() - start:.1f} s)")
    prompt = np.random.default_rng(1).integers(0, MEDIUM["vocab_size"], size=(1, 8))
    contenders = {"dense": model, f"compressed (keep {FLAGS.keep})": compressed}
    for m in contenders.values():  # compile once per model before timing
        models.generate(m, prompt, FLAGS.timed_tokens).block_until_ready()
    seconds = {name: [] for name in contenders}
    for _ in range(FLAGS.rounds):
        for name, m in contenders.items():
            start = time.perf_counter()
            models.generate(m, prompt, FLAGS.timed_tokens).block_until_ready()
            seconds[name].append(time.perf_counter() - start)
    rates = {name: FLAGS.timed_tokens / statistics.median(s) for name, s in seconds.items()}
    for name, rate in rates.items():
        print(f"    {name:24s} {rate:8.1f} tokens/s")
    dense_rate, compressed_rate = rates.values()
    print(f"    speedup: {compressed_rate / dense_rate:.2f}x (median of {FLAGS.rounds} alternating rounds of "
          f"{FLAGS.timed_tokens} tokens, prefill included)")


def main(argv):
    del argv
    emulated_generation()
    timed_comparison()


if __name__ == "__main__":
    app.run(main)
