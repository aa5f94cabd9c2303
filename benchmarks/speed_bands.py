"""The decode reports' headline latencies and speedups at the fitted cost terms, each with its band.

The cases behind the decode reports' headline figures are traced count-only as those reports trace them and
scheduled three ways: documented (no terms), at the fitted terms (fitted_costs.json) and at the corners of the
band nki_kernels/emulator/speed_bands.py defines. Per-launch overhead stays the reports' separate sweep.

    python benchmarks/speed_bands.py           # every case
    python benchmarks/speed_bands.py --quick   # one fp8 batch-1 pair only (writes speed_bands_quick.*)

docs/benchmarks.md ("speed_bands.py") lists the cases.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import _flag_checks  # sibling module: the script's folder is on sys.path
from absl import app, flags
from harness.comparison import decode_spec, operand_specs, published_decode_models, tp_spec
from harness.runner import run_decode_step, run_sharded_decode_step
from traced_runs import rank0_runs, write_text

from nki_kernels.decode.packing import unpacked_spec
from nki_kernels.emulator import cost_model, speed_bands

flags.DEFINE_bool("quick", False, "the Gemma 3 270M fp8 / bf16 batch-1 looped pair only (a smoke run)")
flags.DEFINE_string("out_dir", str(pathlib.Path(__file__).resolve().parent / "results"), "where the reports go")
_flag_checks.output_directory("out_dir")
FLAGS = flags.FLAGS

GEMMA, LLAMA_1B, LLAMA_8B = "Gemma 3 270M", "Llama-3.2-1B", "Llama-3.1-8B"
CACHE_LEN = 512


@dataclasses.dataclass(frozen=True)
class Case:
    key: str
    model: str
    composition: str
    compressed: bool = False
    fp8: bool = False
    batch: int = 1
    tp: int = 1
    report: str = "decode_step.md"


CASES = (
    Case("gemma-per_op", GEMMA, "per_op"),
    Case("gemma-per_layer", GEMMA, "per_layer"),
    Case("gemma-looped", GEMMA, "looped", report="decode_step.md, decode_fp8.md, frontier.md"),
    Case("gemma-looped-keep0.8", GEMMA, "looped", compressed=True),
    Case("gemma-looped-fp8", GEMMA, "looped", fp8=True, report="decode_fp8.md, frontier.md"),
    Case("gemma-looped-fp8-keep0.8", GEMMA, "looped", True, True, report="decode_fp8.md, frontier.md"),
    Case("gemma-looped-b8", GEMMA, "looped", batch=8, report="decode_fp8.md"),
    Case("gemma-looped-fp8-b8", GEMMA, "looped", fp8=True, batch=8, report="decode_fp8.md"),
    Case("llama1b-looped", LLAMA_1B, "looped", report="decode_tensor_parallel.md"),
    Case("llama1b-looped-tp8", LLAMA_1B, "looped", tp=8, report="decode_tensor_parallel.md"),
    Case("llama8b-looped", LLAMA_8B, "looped", report="decode_tensor_parallel.md"),
    Case("llama8b-looped-tp8", LLAMA_8B, "looped", tp=8, report="decode_tensor_parallel.md"),
)
# (what the speedup is, the slower case, the faster case)
SPEEDUPS = (
    ("looped over one kernel per op (Gemma 3 270M, batch 1)", "gemma-per_op", "gemma-looped"),
    ("looped over one kernel per layer (Gemma 3 270M, batch 1)", "gemma-per_layer", "gemma-looped"),
    ("keep 0.8 over dense, looped (Gemma 3 270M, batch 1)", "gemma-looped", "gemma-looped-keep0.8"),
    ("fp8 over bf16, dense looped (Gemma 3 270M, batch 1)", "gemma-looped", "gemma-looped-fp8"),
    ("fp8 keep 0.8 over bf16 dense, looped (Gemma 3 270M, batch 1)", "gemma-looped", "gemma-looped-fp8-keep0.8"),
    ("fp8 over bf16, dense looped (Gemma 3 270M, batch 8)", "gemma-looped-b8", "gemma-looped-fp8-b8"),
    ("8 ranks over 1, looped (Llama-3.2-1B, batch 1)", "llama1b-looped", "llama1b-looped-tp8"),
    ("8 ranks over 1, looped (Llama-3.1-8B, batch 1)", "llama8b-looped", "llama8b-looped-tp8"),
)
QUICK = ("gemma-looped", "gemma-looped-fp8")


class Traced:
    """One case's rank-0 runs on one target (at one and two layers when extrapolated) and its step latency at any
    terms (speed_bands.step_us: the launches plus the fixed cost once), extrapolated in layers."""

    def __init__(self, case: Case, target: str, model):
        self.case, self.target = case, target
        extrapolate = case.model != GEMMA
        self.depths = (1, 2) if extrapolate else (model.num_layers,)
        self.layers = model.num_layers
        self.runs = [self._trace(model, layers) for layers in self.depths]
        self._cache = {}

    def _trace(self, model, layers):
        case = self.case
        if case.tp > 1:
            spec = tp_spec(model, layers, case.compressed, case.tp, case.batch)
        else:
            spec = decode_spec(model, layers, case.compressed, case.fp8)
        if case.composition.startswith("per_op"):
            spec = unpacked_spec(spec)
        operands = operand_specs(spec, case.batch, CACHE_LEN)

        def step():
            if case.tp == 1:
                run_decode_step(case.composition, operands, spec, numerics=False)
            else:
                run_sharded_decode_step(case.composition, [operands] * case.tp, spec, numerics=False)

        return rank0_runs(step, self.target)

    def step_us(self, terms):
        if terms not in self._cache:
            sums = [speed_bands.step_us(runs, self.target, terms) for runs in self.runs]
            if len(sums) == 1:
                self._cache[terms] = sums[0]
            else:  # the fixed cost is in both sums once, so it stays once
                (l1, l2), (a, b) = self.depths, sums
                self._cache[terms] = a + (b - a) * (self.layers - l1) / (l2 - l1)
        return self._cache[terms]


def markdown(cases: dict, speedups: list, fitted: dict, seconds: float, quick: bool) -> str:
    targets = list(fitted)
    lines = [
        "# Decode latencies and speedups at the fitted cost terms, with bands" + (" (quick)" if quick else ""),
        "",
        "**Modeled, not measured.** Each case is traced as its report traces it (KV cache 512, one new token per "
        "row; benchmarks/speed_bands.py) and scheduled by `nki_kernels/emulator/cost_model.py`: **documented** = "
        "the hardware model alone (what the reports print); **fitted** = with the terms fitted to AWS's published "
        "end-to-end latencies (`benchmarks/results/calibration.md`; a fixed cost once per step, a per-DMA issue "
        "cost, the core's HBM efficiency, LNC=2 on trn2); **band** = fixed step cost 0 to fitted, DMA issue cost 0 "
        "to max(fitted, 600 ns), compute x1 to x2 (`nki_kernels/emulator/speed_bands.py`). A speedup's band is its "
        "smallest and largest ratio over those 8 corners.",
        "",
        "Fitted terms: "
        + "; ".join(
            f"{t}: {v.dma_issue_ns:.0f} ns per DMA issue, {v.step_fixed_us:.0f} µs per step, HBM efficiency "
            f"{v.hbm_efficiency:.2f}, LNC {v.lnc}"
            for t, v in fitted.items()
        )
        + ".",
        "",
        "## Speedups",
        "",
        "| speedup | " + " | ".join(f"{t} documented / fitted (band)" for t in targets) + " |",
        "|---|" + "---|" * len(targets),
    ]
    for s in speedups:
        cells = [
            f"{s[t]['documented']:.2f}x / **{s[t]['fitted']:.2f}x** ({s[t]['band'][0]:.2f}–{s[t]['band'][1]:.2f}x)"
            for t in targets
        ]
        lines.append(f"| {s['what']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Latencies (µs per step, rank 0 on several ranks)",
        "",
        "| case | from | " + " | ".join(f"{t} documented / fitted (band)" for t in targets) + " |",
        "|---|---|" + "---|" * len(targets),
    ]
    for key, c in cases.items():
        cells = [
            f"{c[t]['documented_us']:.1f} / **{c[t]['fitted_us']:.1f}** ({c[t]['band_us'][0]:.1f}–"
            f"{c[t]['band_us'][1]:.1f})"
            for t in targets
        ]
        lines.append(f"| {key} | {c['report']} | " + " | ".join(cells) + " |")
    lines += ["", f"Made by `python benchmarks/speed_bands.py{' --quick' if quick else ''}` in {seconds / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    start = time.time()
    fitted = {t: cost_model.fitted_terms(t) for t in cost_model.TARGETS}
    keys = QUICK if FLAGS.quick else tuple(c.key for c in CASES)
    chosen = [c for c in CASES if c.key in keys]
    models = published_decode_models(sorted({c.model for c in chosen}))
    traced = {}
    for case in chosen:
        t0 = time.time()
        traced[case.key] = {t: Traced(case, t, models[case.model]) for t in fitted}
        print(f"traced {case.key} in {time.time() - t0:.0f} s", flush=True)
    cases = {}
    for case in chosen:
        cases[case.key] = {"report": case.report} | {
            t: {
                "documented_us": tr.step_us(None),
                "fitted_us": tr.step_us(fitted[t]),
                "band_us": list(speed_bands.latency_band(tr.step_us, fitted[t])),
            }
            for t, tr in traced[case.key].items()
        }
    speedups = []
    for what, slow, fast in SPEEDUPS:
        if slow not in traced or fast not in traced:
            continue
        entry = {"what": what, "slow": slow, "fast": fast}
        for t in fitted:
            a, b = traced[slow][t], traced[fast][t]
            point, low, high = speed_bands.speedup_band(a.step_us, b.step_us, fitted[t])
            entry[t] = {"documented": a.step_us(None) / b.step_us(None), "fitted": point, "band": [low, high]}
        speedups.append(entry)
    out = pathlib.Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "speed_bands_quick" if FLAGS.quick else "speed_bands"
    seconds = time.time() - start
    payload = {"fitted": {t: dataclasses.asdict(v) for t, v in fitted.items()}, "cases": cases, "speedups": speedups}
    write_text(out / f"{stem}.json", json.dumps(payload, indent=1) + "\n")
    text = markdown(cases, speedups, fitted, seconds, FLAGS.quick)
    write_text(out / f"{stem}.md", text)
    print(text)


if __name__ == "__main__":
    app.run(main)
