"""The looped decode kernel on a paged KV cache vs a contiguous one, modeled on trn1 / trn2.

For published model shapes (`harness.comparison.published_decode_models`), batch 8 and KV-cache lengths of
2048 (--batches, --cache_lengths), dense weights in bf16 and in fp8 (--weight_dtypes), the looped kernel
(nki_kernels.decode.step.decode_step_kernel) runs on the emulator in count-only mode (shape/dtype
placeholders, no weight memory) with a contiguous cache and with pools of 16-, 32- and 128-slot blocks
(`DecodeSpec.block_size`, --block_sizes; the pool holds every row's blocks). Models deeper than two repeats of
their layer pattern are traced at one and two repeats and extrapolated linearly to their depth
(harness.comparison.measure_depths). The ratio paged / contiguous is judged against TARGET at block 128.

    python benchmarks/decode_paged.py                    # writes benchmarks/results/decode_paged.{md,json}
    python benchmarks/decode_paged.py --quick            # one 2-layer shape, a few seconds

All numbers are modeled, not measured: the cost model (nki_kernels.emulator.cost_model) prices a gathering DMA
(per-partition vector offsets) like a plain one of the same shape; what the descriptor generation of an indirect
DMA adds on hardware has no documented figure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time

import _flag_checks  # sibling module: the script's folder is on sys.path
from absl import app, flags
from harness.comparison import (
    TARGETS,
    cut_layers,
    measure_depths,
    measure_spec,
    published_decode_models,
    traced_layers,
)

from jax_neuronmm.compress.checkpoint import write_atomically
from jax_neuronmm.models.presets import PUBLISHED

FLAGS = flags.FLAGS


def define_flags():
    """The script's flags, defined only when it runs (decode_compositions.py imports report_section, and its own
    flags share these names)."""
    flags.DEFINE_list("models", ["Gemma 3 270M", "Llama-3.2-1B"], "published models to trace")
    flags.DEFINE_list("batches", ["8"], "batch sizes (rows, one new token each)")
    flags.DEFINE_list("cache_lengths", ["2048"], "KV-cache lengths S (slots per row)")
    flags.DEFINE_list("block_sizes", ["16", "32", "128"], "paged block sizes (slots per block)")
    flags.DEFINE_list("weight_dtypes", ["bf16", "fp8"], "weights: bf16 and / or fp8 (every weight, float32 scales)")
    flags.DEFINE_bool("quick", False, "one 2-layer Gemma 3 270M shape with an 8192-token vocabulary")
    flags.DEFINE_string("out_dir", "benchmarks/results", "where decode_paged{,_quick}.{md,json} go")
    _flag_checks.choice_list("models", lambda: PUBLISHED)
    for name in ("batches", "cache_lengths", "block_sizes"):
        _flag_checks.int_list(name)
    _flag_checks.choice_list("weight_dtypes", lambda: ("bf16", "fp8"))
    _flag_checks.output_directory("out_dir")
    _flag_checks.not_with("quick", ("models",), "traces one 2-layer Gemma 3 270M shape")


TARGET = 1.05  # paged / contiguous at block 128, at most
JUDGED_BLOCK = 128


def case_spec(model, weights: str, block_size: int | None):
    """model's dense spec, its weights in bf16 or fp8, with a contiguous (None) or paged cache."""
    fp8 = ("q", "k", "v", "o", "gate", "up", "down", "head") if weights == "fp8" else ()
    return model.spec.replace(fp8_weights=fp8, block_size=block_size)


def measure(model, weights: str, block_size: int | None, batch: int, cache_len: int):
    """{target: µs} of the looped kernel for one case (extrapolated in depth where the model is deep), with how it
    was traced."""
    spec = case_spec(model, weights, block_size)
    depths = traced_layers(model, True)
    measured = measure_depths(
        lambda layers: measure_spec(cut_layers(spec, layers), "looped", batch, cache_len), model, depths
    )
    return measured.kernel_us, measured.hbm_bytes, depths, measured.note


def run(models, batches, cache_lengths, block_sizes, weight_dtypes) -> list[dict]:
    rows = []
    for model in models:
        for weights in weight_dtypes:
            for batch in batches:
                for cache_len in cache_lengths:
                    for block_size in (None, *block_sizes):
                        start = time.time()
                        kernel_us, hbm, depths, note = measure(model, weights, block_size, batch, cache_len)
                        rows.append(
                            dict(
                                model=model.name,
                                weights=weights,
                                batch=batch,
                                cache_len=cache_len,
                                block_size=block_size,
                                kernel_us=kernel_us,
                                hbm_bytes=hbm,
                                traced_layers=list(depths),
                                layers=model.num_layers,
                                note=note,
                                trace_seconds=round(time.time() - start, 1),
                            )
                        )
                        print(rows[-1], flush=True)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Each paged row with its paged / contiguous latency ratio per target (the contiguous row of its case)."""
    contiguous = {(r["model"], r["weights"], r["batch"], r["cache_len"]): r for r in rows if r["block_size"] is None}
    out = []
    for r in rows:
        if r["block_size"] is None:
            continue
        base = contiguous[(r["model"], r["weights"], r["batch"], r["cache_len"])]
        ratio = {t: r["kernel_us"][t] / base["kernel_us"][t] for t in TARGETS if t in r["kernel_us"]}
        out.append(dict(r, ratio=ratio, contiguous_us=base["kernel_us"]))
    return out


def table_lines(rows: list[dict]) -> list[str]:
    """The Markdown table of paged vs contiguous latency, a row per paged case, judged at JUDGED_BLOCK."""
    lines = [
        "| model | weights | B | S | block | trn1 µs (contiguous) | trn1 paged / contiguous | trn2 µs (contiguous) "
        "| trn2 paged / contiguous | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ratios(rows):
        cells = []
        for t in TARGETS:
            if t in r["ratio"]:
                cells += [f"{r['kernel_us'][t]:.1f} ({r['contiguous_us'][t]:.1f})", f"{r['ratio'][t]:.3f}"]
            else:
                cells += ["did not run", "-"]
        met = bool(r["ratio"]) and all(v <= TARGET for v in r["ratio"].values())
        verdict = ("met" if met else "**missed**") if r["block_size"] == JUDGED_BLOCK else ""
        lines.append(
            f"| {r['model']} | {r['weights']} | {r['batch']} | {r['cache_len']} | {r['block_size']} | "
            + " | ".join(cells)
            + f" | {verdict} |"
        )
    notes = [f"- {r['model']} {r['weights']} block {r['block_size']}: {r['note']}" for r in rows if r["note"]]
    return lines + (["", "Notes:", *notes] if notes else [])


DESCRIPTION = (
    "The looped kernel (one launch for the whole step) with each row's cache contiguous vs in pools of blocks read "
    "through a per-row block table (`DecodeSpec.block_size`, `nki_kernels/decode/paged.py`): per row one small DMA "
    "of its table entries per window span (once per launch, shared by the layers), one gathering DMA for V per group "
    "of blocks (partition p holds a slice of one block); Kᵀ on trn2 (a 2-byte cache) by gathering transposes (one slot "
    "per index, [128, M] index tiles), where every transpose writes as many bytes per partition as the cache's DMAs "
    "are spread to, else (and on trn1) K gathered like V and turned on the PE; each row's new token "
    "scattered to its own slot. A sliding-window layer reads the whole blocks that hold its window (up to one "
    "block more than the window). Deep models are traced at one and two repeats of their layer pattern and "
    "extrapolated to their depth. A gathering DMA (or transpose) is priced like a plain one of the same shape: what "
    "an indirect DMA's descriptors add on hardware has no documented figure."
)


def markdown(data: dict) -> str:
    """decode_paged.md from its JSON data."""
    lines = [
        "# Decode step on a paged KV cache vs a contiguous one (modeled)",
        "",
        f"Generated by `{data['command']}` in {data['seconds']:.0f} s. All numbers are modeled by the project's cost "
        "model on the CPU emulator (count-only traces), not measured on Trainium. Data: `decode_paged.json` beside "
        "this file.",
        "",
        DESCRIPTION,
        "",
        f"Target: paged within {TARGET - 1:.0%} of contiguous at block {JUDGED_BLOCK} (ratio <= {TARGET}).",
        "",
        *table_lines(data["rows"]),
    ]
    return "\n".join(lines) + "\n"


def report_section(out_dir: str) -> str:
    """The decode report's paged-cache section from out_dir/decode_paged.json ("" when there is none yet)."""
    path = os.path.join(out_dir, "decode_paged.json")
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    lines = [
        "## Paged KV cache vs contiguous (looped kernel)",
        "",
        f"From `decode_paged.json` (`{data['command']}`; the full report: `decode_paged.md`). {DESCRIPTION} "
        f"Target: paged within {TARGET - 1:.0%} of contiguous at block {JUDGED_BLOCK}.",
        "",
        *table_lines(data["rows"]),
    ]
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    start = time.time()
    models = list(published_decode_models(FLAGS.models).values())
    batches, cache_lengths, block_sizes = (
        [int(v) for v in FLAGS[name].value] for name in ("batches", "cache_lengths", "block_sizes")
    )
    if FLAGS.quick:
        gemma = published_decode_models(["Gemma 3 270M"])["Gemma 3 270M"]
        spec = cut_layers(gemma.spec, 2).replace(vocab=8192)
        models = [dataclasses.replace(gemma, name="Gemma 3 270M (2 layers, V 8192)", spec=spec)]
    rows = run(models, batches, cache_lengths, block_sizes, FLAGS.weight_dtypes)
    command = "python benchmarks/decode_paged.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    seconds = time.time() - start
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    stem = os.path.join(FLAGS.out_dir, f"decode_paged{'_quick' if FLAGS.quick else ''}")
    data = dict(command=command, seconds=round(seconds, 1), target=TARGET, judged_block=JUDGED_BLOCK, rows=rows)

    def write_text(text):
        return lambda path: open(path, "w", encoding="utf-8").write(text)

    write_atomically(stem + ".json", write_text(json.dumps(data, indent=1) + "\n"))
    write_atomically(stem + ".md", write_text(markdown(data)))
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    define_flags()
    app.run(main)
