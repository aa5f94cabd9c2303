"""Compression that holds on text it never saw: each real model compressed or quantized on a few thousand tokens of
ONE kind of text (the "user's text"), then measured on every other kind (models.text_kinds), none of which any
calibration, training or step-selection saw: perplexity ratio over the dense model with a bootstrap interval over
windows, and top-1 agreement; the headline is the worst kind. With --speed, the modeled decode speed on trn2 over
bf16 dense from the built model's own DecodeSpec (bytes roofline; --trace: the looped kernel on the cost model).

    python benchmarks/generalization.py --models=smollm2 --configs="fp8 gptq"
    python benchmarks/generalization.py --render_only

Rows are appended to benchmarks/results/generalization.json as they finish; generalization.md is rendered from
it. docs/benchmarks.md ("generalization.py") gives the texts and what each row records.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import _flag_checks  # sibling module: the script's folder is on sys.path
import numpy as np
from absl import app, flags
from harness.comparison import DecodeModel, measure_model, roofline_us

from jax_neuronmm import models, pipeline
from jax_neuronmm.compress.checkpoint import write_atomically
from jax_neuronmm.models import decode, evaluation, quality, real_models, text_kinds
from jax_neuronmm.pipeline import self_distillation
from jax_neuronmm.pipeline.distill import DistillOptions
from nki_kernels.decode import traffic

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODELS = {"gemma": real_models.GEMMA3_270M, "smollm2": real_models.SMOLLM2_135M}

flags.DEFINE_multi_string("models", None, f"models to measure, of {sorted(MODELS)} (default: both)")
flags.DEFINE_multi_string("configs", None, "configurations to measure (default: all)")
flags.DEFINE_integer("seq_len", 256, "tokens per window", lower_bound=2)
flags.DEFINE_string("user_kind", "license", "the kind of text the user calibrates on (models.text_kinds)")
flags.DEFINE_integer("user_tokens", 8192, "tokens of the user's text (whole windows of --seq_len)", lower_bound=1)
flags.DEFINE_integer("eval_windows", 16, "at most this many evaluation windows of each kind", lower_bound=1)
flags.DEFINE_bool("speed", True, "the modeled decode speed (trn2, batch 1, bytes roofline) of each row over bf16 dense")
flags.DEFINE_bool("trace", False, "with --speed, also trace the looped decode kernel on the emulator's cost model")
flags.DEFINE_integer(
    "self_text_windows",
    None,
    "generated windows (SelfTextOptions.windows; default: the library's default)",
    lower_bound=1,
)
flags.DEFINE_bool("render_only", False, "only re-render the Markdown from the JSON")
flags.DEFINE_bool("dense_only", False, "only record the dense model's own figures on each kind (no configuration)")
_flag_checks.not_with("dense_only", ("configs", "render_only"), "records the dense model's own figures only")
_flag_checks.choice_list("models", lambda: MODELS, optional=True)
_flag_checks.choice_list("configs", lambda: [c.name for c in CONFIGS], optional=True)
flags.register_validator(
    "user_kind",
    lambda kind: kind in text_kinds.TEXT_KINDS,
    f"--user_kind: expected one of {list(text_kinds.TEXT_KINDS)}",
)
FLAGS = flags.FLAGS

CACHE_LEN = 512
TARGET = "trn2"


@dataclasses.dataclass(frozen=True)
class Config:
    """One row: fp8 GPTQ of the dense weights (quantize), or compress_model(dense, keep, calibration_ids=user
    windows, include=include, **kwargs)."""

    name: str
    quantize: bool = False
    # What GPTQ (fp8 rows) or the layer-wise steps (compression rows without self_text, which adds them itself)
    # calibrate on: "user" windows, "user+generated" (the user's and the first SelfTextOptions.calibration_windows of
    # the dense model's own samples), or "none" (fp8 rows: round to nearest)
    calibrate_on: str = "user"
    # fp8 rows: what quantize_model rounds (the LM head stays in the model's dtype without "head")
    targets: tuple = ("attention", "mlp", "head")
    # fp8 rows: trained through the rounding on the user's and generated text (pipeline.distill_fp8) instead of GPTQ,
    # at distill_fp8's step size or at this one (scaled to the text as distill_fp8 scales its own)
    trained: bool = False
    learning_rate: float | None = None
    keep: float = 0.8
    include: tuple = ("mlp",)
    self_text: bool = True
    # the recovery steps (None: the recommended pipeline's); ("fisher", "allocate") measures it without distillation
    steps: tuple | None = None
    # DistillOptions.anchor (a pull toward the starting factors), the options otherwise scaled as the pipeline's
    anchor: float = 0.0
    # "before": the pipeline as it was: no generated text, the default distillation options on the user's windows.
    before: bool = False

    def __post_init__(self):
        if self.calibrate_on not in ("user", "user+generated", "none"):
            raise ValueError(f"{self.name}: calibrate_on={self.calibrate_on!r}")
        if not self.quantize and (self.calibrate_on == "none" or (self.calibrate_on != "user" and self.self_text)):
            raise ValueError(f"{self.name}: compression calibrates on user text (plus generated without self_text)")
        if self.trained and (not self.quantize or self.calibrate_on != "user" or "head" in self.targets):
            raise ValueError(f"{self.name}: distill_fp8 trains attention / MLP weights and mixes in generated text")


CONFIGS = (
    Config("fp8 gptq", quantize=True),
    Config("fp8 round to nearest", quantize=True, calibrate_on="none"),
    Config("fp8 gptq, user + generated text", quantize=True, calibrate_on="user+generated"),
    Config("fp8 gptq, head in bf16", quantize=True, targets=("attention", "mlp")),
    Config(
        "fp8 gptq, head in bf16, user + generated text",
        quantize=True,
        calibrate_on="user+generated",
        targets=("attention", "mlp"),
    ),
    # Gemma 3 270M's fp8 loss on the legal kinds comes from its MLPs: attention alone in fp8 holds every kind
    Config(
        "fp8 gptq, attention only (MLPs and head in bf16), user + generated text",
        quantize=True,
        calibrate_on="user+generated",
        targets=("attention",),
    ),
    Config(
        "fp8 distilled, head in bf16, user + generated text", quantize=True, targets=("attention", "mlp"), trained=True
    ),
    Config(
        "fp8 distilled at a quarter of the step size, head in bf16, user + generated text",
        quantize=True,
        targets=("attention", "mlp"),
        trained=True,
        learning_rate=5e-5,
    ),
    Config("keep 0.8 mlp, before (user text only)", self_text=False, before=True),
    Config("keep 0.8 mlp"),
    Config(
        "keep 0.8 mlp+attention, before (user text only)", include=("mlp", "attention"), self_text=False, before=True
    ),
    Config("keep 0.8 mlp+attention", include=("mlp", "attention")),
    # the cut of keep 0.8 MLP + attention's bytes (and a little more, for 1.2x on SmolLM2) all on the MLPs, whose
    # neurons pruning drops, where attention's factors lose most of their rank
    Config("keep 0.7 mlp, attention dense", keep=0.7),
    Config("keep 0.8 mlp+attention, anchored", include=("mlp", "attention"), anchor=3.0),
    Config("keep 0.8 mlp+attention, anchored 300", include=("mlp", "attention"), anchor=300.0),
    Config("keep 0.8 mlp, no distillation", self_text=False, steps=("fisher", "allocate")),
    Config(
        "keep 0.8 mlp+attention, no distillation",
        include=("mlp", "attention"),
        self_text=False,
        steps=("fisher", "allocate"),
    ),
    Config(
        "keep 0.8 mlp, no distillation, user + generated calibration",
        self_text=False,
        steps=("fisher", "allocate"),
        calibrate_on="user+generated",
    ),
    Config(
        "keep 0.8 mlp+attention, no distillation, user + generated calibration",
        include=("mlp", "attention"),
        self_text=False,
        steps=("fisher", "allocate"),
        calibrate_on="user+generated",
    ),
)


def describe(config: Config) -> str:
    """What a row's configuration builds, in words (the report's legend)."""
    if config.quantize:
        on = {"none": "rounded to nearest", "user": "GPTQ on the user's text", "user+generated": "GPTQ on the user's"}
        text = on[config.calibrate_on] + (" and generated text" if config.calibrate_on == "user+generated" else "")
        if config.trained:
            text = "trained through the rounding on the user's and generated text (distill_fp8), rounded to nearest"
            if config.learning_rate is not None:
                text += f", peak step {config.learning_rate:g} before scaling to the text"
        return f"fp8 e4m3 weights of {' + '.join(config.targets)}, {text}"
    words = [f"compress_model at keep {config.keep} of {' + '.join(config.include)}"]
    if config.before:
        words.append("the default distillation options on the user's windows only")
    elif config.steps is not None:
        words.append(f"steps {' + '.join(config.steps)} only (no training)")
    else:
        words.append("the recommended pipeline" + (" with the dense model's own samples" if config.self_text else ""))
    if config.calibrate_on == "user+generated":
        words.append(f"calibrated on the user's and {self_text_options().calibration_windows} generated windows")
    if config.anchor:
        words.append(f"distillation pulled toward the starting factors (DistillOptions.anchor {config.anchor})")
    return ", ".join(words)


def self_text_options(start_id=None) -> self_distillation.SelfTextOptions:
    """The library's SelfTextOptions (samples from start_id when given), or --self_text_windows windows of them (a
    third of them calibrating)."""
    options = self_distillation.SelfTextOptions(start_id=start_id)
    if FLAGS.self_text_windows is None:
        return options
    windows = FLAGS.self_text_windows
    return dataclasses.replace(
        options, windows=windows, calibration_windows=min(options.calibration_windows, windows // 3)
    )


def scaled_options(user_ids, self_text, base: DistillOptions) -> DistillOptions:
    """`base` scaled as the library scales its defaults (`self_distillation.scaled_options`) to the windows it will
    train on: the user's and the generated (self_text: SelfTextOptions or False), less those held out."""
    holdout = self_text.holdout if self_text else base.holdout
    train = user_ids.shape[0] + (self_text.windows if self_text else 0) - holdout
    return self_distillation.scaled_options(train, holdout, base)


def build(dense, config: Config, user_ids, start_id):
    if config.calibrate_on == "user+generated":
        options = self_text_options(start_id)
        generated = self_distillation.generated_windows(dense, user_ids, options)
        user_ids = np.concatenate([user_ids, generated[: options.calibration_windows]])
    if config.trained:
        self_text, options = self_text_options(start_id), None
        if config.learning_rate is not None:
            options = scaled_options(user_ids, self_text, DistillOptions(learning_rate=config.learning_rate))
        return pipeline.distill_fp8(dense, user_ids, targets=config.targets, options=options, self_text=self_text)
    if config.quantize:
        if config.calibrate_on == "none":
            return pipeline.quantize_model(dense, "float8_e4m3", targets=config.targets)
        return pipeline.quantize_model(dense, "float8_e4m3", calibration_ids=user_ids, targets=config.targets)
    self_text = self_text_options(start_id) if config.self_text else False
    distill = DistillOptions() if config.before else None
    if config.anchor:
        distill = scaled_options(user_ids, self_text, DistillOptions(anchor=config.anchor))
    recipe = pipeline.Recipe(
        keep=config.keep,
        include=config.include,
        steps=config.steps,
        self_text=self_text,
        distill=distill,
    )
    return pipeline.compress_model(dense, recipe, calibration_ids=user_ids)


def modeled(model) -> dict:
    """Modeled decode-step µs on TARGET at batch 1, cache CACHE_LEN, of `model`'s own DecodeSpec: "roofline_us"
    (its must-move bytes at the peak HBM rate), and with --trace "looped_us" (None when the trace fails; its note
    says why)."""
    spec = decode.model_spec(model)
    out = dict(roofline_us=roofline_us(0, traffic.must_move_bytes(spec, 1, CACHE_LEN), TARGET))
    if FLAGS.trace:
        traced = measure_model(DecodeModel("row", "models.decode.model_spec", spec), "looped", 1, CACHE_LEN, True)
        out.update(looped_us=traced.latency_us(TARGET, 0.0), looped_note=traced.note)
    return out


def measure(model, windows: dict, dense_predictions: dict) -> dict:
    kinds = {}
    for kind, ids in windows.items():
        predictions = evaluation.predictions(model, ids)
        interval = quality.perplexity_ratio_interval(predictions, dense_predictions[kind])
        kinds[kind] = dict(
            ratio=interval.ratio,
            low=interval.low,
            high=interval.high,
            windows=interval.windows,
            ppl=predictions.perplexity,
            dense_ppl=dense_predictions[kind].perplexity,
            top1=quality.top1_agreement(predictions, dense_predictions[kind]),
        )
    return kinds


def dense_figures(predictions, ids) -> dict:
    """The dense model on one kind's windows: its perplexity and the share of positions where its most likely next
    token is the text's own (high on a text it has seen often enough to recite)."""
    accuracy = float(np.mean(predictions.top1 == np.asarray(ids)[:, 1:]))
    return dict(windows=int(ids.shape[0]), ppl=predictions.perplexity, next_token_accuracy=accuracy)


def run_model(key: str, configs, results: dict, json_path: str) -> None:
    name = MODELS[key]
    path = real_models.real_model_path(name)
    if path is None:
        print(f"skipped: {real_models.missing_reason(name)}", flush=True)
        return
    dense = models.load_gguf(path)
    tokenizer = dense.tokenizer
    bos = tokenizer.token_to_id("<bos>") if key == "gemma" else None  # SmolLM2's tokenizer adds none
    # Where samples without a prompt start: Gemma's windows share <bos>; SmolLM2's chat turns begin <|im_start|>.
    start_id = None if key == "gemma" else tokenizer.token_to_id("<|im_start|>")
    user_ids = text_kinds.kind_windows(
        tokenizer, FLAGS.user_kind, FLAGS.seq_len, bos, max_windows=FLAGS.user_tokens // FLAGS.seq_len
    )
    windows = {
        kind: text_kinds.kind_windows(tokenizer, kind, FLAGS.seq_len, bos, max_windows=FLAGS.eval_windows)
        for kind in text_kinds.TEXT_KINDS
        if kind != FLAGS.user_kind
    }
    dense_predictions = {kind: evaluation.predictions(dense, ids) for kind, ids in windows.items()}
    results.setdefault("dense", {})[name] = {
        kind: dense_figures(dense_predictions[kind], ids) for kind, ids in windows.items()
    }
    _write(json_path, results)
    if FLAGS.dense_only:
        return
    dense_speed = modeled(models.load_gguf(path, dtype="bfloat16")) if FLAGS.speed else None
    for config in configs:
        load_before = os.getloadavg()
        start = time.perf_counter()
        model = build(dense, config, user_ids, start_id)
        seconds = time.perf_counter() - start
        load_after = os.getloadavg()
        kinds = measure(model, windows, dense_predictions)
        uses_generated = (
            config.calibrate_on == "user+generated" or config.trained or (not config.quantize and config.self_text)
        )
        generated = self_text_options().windows if uses_generated else 0
        row = dict(
            model=name,
            config=config.name,
            seconds=seconds,
            load_before=list(load_before),
            load_after=list(load_after),
            user_kind=FLAGS.user_kind,
            user_tokens=int(user_ids.size),
            generated_tokens=int(generated * FLAGS.seq_len),
            kinds=kinds,
            worst_ratio=max(k["ratio"] for k in kinds.values()),
            worst_top1=min(k["top1"] for k in kinds.values()),
        )
        if FLAGS.speed:
            speed = modeled(model)
            row.update(modeled_trn2_b1=speed, dense_bf16_trn2_b1=dense_speed)
            row["roofline_speedup_trn2_b1"] = dense_speed["roofline_us"] / speed["roofline_us"]
            if speed.get("looped_us") and dense_speed.get("looped_us"):
                row["looped_speedup_trn2_b1"] = dense_speed["looped_us"] / speed["looped_us"]
        print(json.dumps(row), flush=True)
        results["rows"][f"{name}|{config.name}"] = row
        _write(json_path, results)
        del model


def _write(json_path: str, results: dict) -> None:
    payload = json.dumps(results, indent=1, sort_keys=True).encode()

    def write(temporary):
        with open(temporary, "wb") as f:
            f.write(payload)

    write_atomically(json_path, write)
    render(results, os.path.dirname(json_path))


def render(results: dict, out_dir: str) -> None:
    lines = [
        "# Compression on text it never saw",
        "",
        "Generated by benchmarks/generalization.py from generalization.json. Each row is calibrated (and distilled)",
        "on the user's text of one kind only; every column below is a kind no step saw. Ratio: perplexity over the",
        "dense model's on the same windows, with a 95% bootstrap interval over windows; top-1: agreement with the",
        "dense model's next token. Load: the 1-minute load average before / after building (2 shared cores).",
        "Speedup: MODELED decode step over bf16 dense (trn2, batch 1, cache 512) from the built model's own",
        "DecodeSpec: the looped kernel's cost-model trace where the row has one, else the bytes roofline (must-move",
        "bytes at the peak HBM rate). Never measured on hardware.",
        "",
    ]
    rows = list(results["rows"].values())
    kinds = sorted({k for row in rows for k in row["kinds"]})
    head = ["model", "config", "worst ratio", "worst top-1", *kinds, "s", "load", "user tok", "gen tok", "speedup"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["model"], row["config"], f"{row['worst_ratio']:.3f}x", f"{row['worst_top1']:.2f}"]
        for kind in kinds:
            k = row["kinds"].get(kind)
            cells.append("" if k is None else f"{k['ratio']:.3f} [{k['low']:.3f}, {k['high']:.3f}], {k['top1']:.2f}")
        speed = row.get("looped_speedup_trn2_b1", row.get("roofline_speedup_trn2_b1"))
        cells += [
            f"{row['seconds']:.0f}",
            f"{row['load_before'][0]:.1f}/{row['load_after'][0]:.1f}",
            str(row["user_tokens"]),
            str(row["generated_tokens"]),
            "" if speed is None else f"{speed:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _dense_lines(results.get("dense", {}))
    names = dict.fromkeys(row["config"] for row in rows)
    lines += ["", "Configurations:", ""] + [f"- {c.name}: {describe(c)}." for c in CONFIGS if c.name in names]
    notes = [f"- {row['model']}, {row['config']}: {row['note']}" for row in rows if row.get("note")]
    lines += ["", "Notes on how rows ran:", "", *notes] if notes else []
    with open(os.path.join(out_dir, "generalization.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _dense_lines(dense: dict) -> list[str]:
    """The dense models' own perplexity and next-token accuracy on each kind: where a model recites a text it has
    seen, every compressed row's ratio on that text measures lost recall as much as lost fluency."""
    if not dense:
        return []
    kinds = sorted({k for figures in dense.values() for k in figures})
    lines = [
        "",
        "The dense models on each kind (perplexity; next-token accuracy = share of positions where the dense model's "
        "most likely next token is the text's own):",
        "",
        "| model | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for model, figures in dense.items():
        cells = [
            f"{figures[k]['ppl']:.2f}, {figures[k]['next_token_accuracy']:.2f} ({figures[k]['windows']} windows)"
            if k in figures
            else ""
            for k in kinds
        ]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines


def main(argv):
    del argv
    json_path = os.path.join(RESULTS, "generalization.json")
    results = {"rows": {}}
    if os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as f:
            results = json.load(f)
    if FLAGS.render_only:
        render(results, RESULTS)
        return
    configs = [c for c in CONFIGS if not FLAGS.configs or c.name in FLAGS.configs]
    for key in FLAGS.models or sorted(MODELS):
        run_model(key, configs, results, json_path)


if __name__ == "__main__":
    app.run(main)
