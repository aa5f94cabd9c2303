"""Decode step over all layers: one kernel per op vs one per layer vs one looped kernel, modeled on trn1 / trn2.

For Gemma 3 270M, Llama-3.2-1B and Llama-3.1-8B shapes (the presets of their published config.json, as
`jax_neuronmm.models.decode.decode_plan` turns them into DecodeSpecs), batch 1 and 8, one new token per row,
KV-cache lengths 128 / 512 / 2048, dense and compressed at keep 0.8 (every projection of every layer and the LM
head factored at `nki_kernels.ranks.block_aligned_rank`), each composition (harness.compositions; the looped
kernel is nki_kernels.decode.step's) runs on the emulator in count-only mode (`harness.runner.run_decode_step`,
operands are shape/dtype placeholders, no weight memory): per_op (i), per_layer (ii), looped (iii) and
per_op_svd_mlp (per-op kernels, fused svd_mlp kernels for the MLP). What is measured and judged (must-move bytes,
the targets and their bounds) is harness.comparison. The peer "dense (nkilib megakernel)" is AWS nki-library's
experimental transformer_tkg, run from a local checkout (`--nki_library`) on the same emulator.

Latency of a composition = sum of its launches' modeled latencies (each launch scheduled on its own, so its
pipeline fill and drain count) + launches x a per-launch overhead (`nki_kernels.emulator.launch`: no public
Trainium figure, so 0, 2, 5, 10, 20 µs are swept). % of peak bandwidth = bytes that must move ÷ latency ÷ the
core's peak DMA-to-HBM rate. Each case (the peer's too) is also rescheduled at the cost terms fitted to AWS's
published latencies (benchmarks/results/calibration.json) and at the corners of their band (measure_spec's bands,
nki_kernels.emulator.speed_bands): the report states every latency and speedup there with its band beside the
documented figures, which the targets are judged on. A case in --cache_file without its band is traced again.

    python benchmarks/decode_compositions.py --nki_library=/path/to/nki-library     # everything
    python benchmarks/decode_compositions.py --quick                                # one shape, a few seconds

Writes benchmarks/results/decode_step{,_quick}.md and .png. All numbers are modeled, not measured.

--weight_dtype=fp8 writes the fp8-weight report instead, benchmarks/results/decode_fp8{,_quick}.md: the same cases
with every weight (each projection and the LM head, dense or factored) in fp8 e4m3 with float32 per-output-column
scales (`DecodeSpec.fp8_weights`), beside the bf16 ones traced in the same run, with each case's speedup over the
bf16 dense looped kernel; it traces our compositions only (no nkilib peer, no plot), e.g.

    python benchmarks/decode_compositions.py --weight_dtype=fp8 --models="Gemma 3 270M" --batches=1,8 \
        --cache_lengths=512 --compositions=looped

--tensor_parallel writes the tensor-parallel report instead, benchmarks/results/decode_tensor_parallel{,_quick}.md:
each model split over T NeuronCores in the Megatron layout (nki_kernels.decode.sharding; T = 1, 2, 4, 8, and 16,
32 for Llama-3.1-8B, or --tp_degrees), every rank's kernels run together on the emulator with their collectives
(simulate_spmd), rank 0 measured: per_op, per_layer and looped, dense and compressed, with µs per step, % of the
aggregate peak bandwidth, µs in collectives and, beside each looped row, the physical (byte) bound and the
dependency floor (the same kernel with unlimited DMA and link bandwidth, cost_model.dependency_floor_us), e.g.

    python benchmarks/decode_compositions.py --tensor_parallel --batches=1,8 --cache_lengths=512

--models, --tp_degrees, --batches, --cache_lengths and --compositions pick the cases (each traced dense and
compressed), e.g. a handful of looped rows in a minute:

    python benchmarks/decode_compositions.py --tensor_parallel --models="Gemma 3 270M" --tp_degrees=2,4 \
        --batches=1 --cache_lengths=512 --compositions=looped --out_dir=/tmp/tp
"""

from __future__ import annotations

import os
import pathlib
import shlex
import sys
import time

import _flag_checks  # sibling module: the script's folder is on sys.path
import decode_paged  # sibling module: the script's folder is on sys.path
from absl import app, flags
from decode_cases import CaseCache, RunInfo, run_all, run_fp8, run_tensor_parallel
from decode_fp8_report import fp8_markdown
from decode_nkilib import check_nkilib_checkout
from decode_parallel_report import tensor_parallel_markdown
from decode_step_report import markdown, plot
from harness.comparison import (
    COMPOSITIONS,
    DecodeModel,
    decode_spec,
    published_decode_models,
    targets_table,
    traced_layers,
)

from jax_neuronmm.compress.checkpoint import write_atomically

DEFAULT_MODELS = ("Gemma 3 270M", "Llama-3.2-1B", "Llama-3.1-8B")
# Tensor-parallel degrees the report traces per model (the others: TP_DEFAULT); a degree the model's heads,
# intermediate or vocabulary do not split over shows as not run.
TP_DEFAULT = (1, 2, 4, 8)
TP_DEGREES = {"Llama-3.1-8B": (1, 2, 4, 8, 16, 32)}

flags.DEFINE_bool(
    "quick", False, "Gemma 3 270M at 2 layers and an 8192-token vocabulary, batch 1, cache 128: a smoke run"
)
flags.DEFINE_list(
    "models", None, f"models to report (names in jax_neuronmm.models.presets.PUBLISHED); default {DEFAULT_MODELS}"
)
flags.DEFINE_list("batches", ["1", "8"], "batch sizes (rows, one new token each)")
flags.DEFINE_list("cache_lengths", ["128", "512", "2048"], "KV-cache lengths S")
flags.DEFINE_string(
    "nki_library",
    None,
    "checkout of aws-neuron/nki-library for the 'dense (nkilib megakernel)' "
    "peer (its experimental transformer_tkg); without it the report says so",
)
flags.DEFINE_list(
    "extrapolated_models",
    ["Llama-3.2-1B", "Llama-3.1-8B"],
    "models traced at one and two repeats of "
    "their layer pattern and extrapolated linearly in L (checked against a full trace of Gemma 3 270M); "
    "the others are traced at full depth",
)
flags.DEFINE_list("compositions", list(COMPOSITIONS), "compositions to trace (the others show as not traced)")
flags.DEFINE_enum(
    "weight_dtype",
    "bf16",
    ["bf16", "fp8"],
    "bf16: the composition report (decode_step.md); fp8: the fp8-weight report (decode_fp8.md), every weight in fp8 "
    "e4m3 with float32 scales beside the same cases in bf16 (the --compositions given, bf16 dense looped always)",
)
flags.DEFINE_bool(
    "tensor_parallel",
    False,
    "write the tensor-parallel report (decode_tensor_parallel.md) instead: each model split over T ranks "
    "(--tp_degrees), per_op, per_layer and looped (of --compositions)",
)
flags.DEFINE_list(
    "tp_degrees", None, f"tensor-parallel degrees for every model; default {dict(TP_DEGREES)} (else {TP_DEFAULT})"
)
flags.DEFINE_bool("cached_only", False, "trace nothing: report the cases found in --cache_file, the rest as not traced")
flags.DEFINE_string(
    "run_time_note",
    "",
    "how the cases were traced, for a report assembled with --cached_only (its own run time covers the assembly only)",
)
flags.DEFINE_string(
    "cache_file",
    None,
    "JSON-lines file of finished cases: cases found there are not traced "
    "again, new ones are appended (to resume a run or split it over processes by --models; only "
    "valid for the same kernels)",
)
flags.DEFINE_string(
    "out_dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), "where the markdown and PNG go"
)
FLAGS = flags.FLAGS
_flag_checks.output_directory("out_dir")
_flag_checks.not_with("quick", ("models", "batches", "cache_lengths"), "traces one small shape at batch 1, cache 128")


def _ints(values, name):
    try:
        out = [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{name}: expected positive integers, got {values}") from None
    if not out or min(out) < 1:
        raise app.UsageError(f"--{name}: expected positive integers, got {values}")
    return out


def main(argv):
    del argv
    start = time.time()
    try:
        every = published_decode_models(dict.fromkeys([*DEFAULT_MODELS, *(FLAGS.models or ())]))
    except ValueError as error:
        raise app.UsageError(f"--models: {error}") from None
    names = FLAGS.models or list(DEFAULT_MODELS)
    models = [every[n] for n in names]
    batches, cache_lengths = _ints(FLAGS.batches, "batches"), _ints(FLAGS.cache_lengths, "cache_lengths")
    if FLAGS.quick:
        # Its own name: case-cache keys name a model, its depth, the case and the traced depths.
        gemma = every["Gemma 3 270M"]
        spec = decode_spec(gemma, 2, False).replace(vocab=8192)
        models = [DecodeModel("Gemma 3 270M (2 layers, V 8192)", gemma.source, spec)]
        batches, cache_lengths = [1], [128]
    source = None
    if FLAGS.nki_library:
        try:
            source = check_nkilib_checkout(FLAGS.nki_library)
        except ValueError as error:
            raise app.UsageError(str(error)) from None
    extrapolated = set(FLAGS.extrapolated_models)
    unknown = sorted(extrapolated - set(every))
    if unknown:
        raise app.UsageError(f"--extrapolated_models: unknown {unknown}, expected some of {list(every)}")
    depths = {
        m.name: (
            "full trace"
            if traced_layers(m, m.name in extrapolated) == (m.num_layers,)
            else f"traced at {traced_layers(m, True)} layers, extrapolated to {m.num_layers}"
        )
        for m in models
    }
    if FLAGS.quick:
        depths = {m.name: "2 layers and an 8192-token vocabulary only (quick smoke run)" for m in models}
    traced = tuple(FLAGS.compositions)
    if not set(traced) <= set(COMPOSITIONS):
        raise app.UsageError(f"--compositions: got {FLAGS.compositions}, expected some of {list(COMPOSITIONS)}")
    if FLAGS.cached_only and not FLAGS.cache_file:
        raise app.UsageError("--cached_only needs --cache_file")
    cache = CaseCache(FLAGS.cache_file, FLAGS.cached_only)
    command = "python benchmarks/decode_compositions.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if FLAGS.tensor_parallel:
        if source or FLAGS.weight_dtype == "fp8":
            raise app.UsageError("--tensor_parallel: traces our bf16 kernels only (no --nki_library, no fp8)")
        chosen = _ints(FLAGS.tp_degrees, "tp_degrees") if FLAGS.tp_degrees else None

        def degrees(m):
            return chosen or TP_DEGREES.get(m.name, TP_DEFAULT)

        ours, seconds, loads, unsplit = run_tensor_parallel(
            models, degrees, batches, cache_lengths, extrapolated, cache, traced
        )
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        path = os.path.join(FLAGS.out_dir, f"decode_tensor_parallel{'_quick' if FLAGS.quick else ''}.md")
        run = RunInfo(command, FLAGS.quick, time.time() - start, depths, seconds, loads, FLAGS.run_time_note)
        text = tensor_parallel_markdown(ours, unsplit, models, degrees, batches, cache_lengths, run)
        write_atomically(path, lambda temporary: pathlib.Path(temporary).write_text(text, encoding="utf-8"))
        print(text)
        print(f"wrote {path} ({(time.time() - start) / 60:.1f} min)")
        return
    if FLAGS.weight_dtype == "fp8":
        if source:
            raise app.UsageError("--nki_library: the fp8 report (--weight_dtype=fp8) traces our kernels only")
        ours, seconds, loads = run_fp8(models, batches, cache_lengths, extrapolated, cache, traced)
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        path = os.path.join(FLAGS.out_dir, "decode_fp8_quick.md" if FLAGS.quick else "decode_fp8.md")
        run = RunInfo(command, FLAGS.quick, time.time() - start, depths, seconds, loads)
        text = fp8_markdown(ours, models, batches, cache_lengths, run)
        write_atomically(path, lambda temporary: pathlib.Path(temporary).write_text(text, encoding="utf-8"))
        print(text)
        print(f"wrote {path} ({(time.time() - start) / 60:.1f} min)")
        return
    res, seconds, loads = run_all(models, batches, cache_lengths, source, extrapolated, cache, traced)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    stem = os.path.join(FLAGS.out_dir, "decode_step_quick" if FLAGS.quick else "decode_step")
    run = RunInfo(command, FLAGS.quick, time.time() - start, depths, seconds, loads, FLAGS.run_time_note)
    text = markdown(res, batches, cache_lengths, run)
    if not FLAGS.quick:  # the paged-cache comparison, from decode_paged.py's data (benchmarks/decode_paged.py)
        text += decode_paged.report_section(FLAGS.out_dir)
    write_atomically(stem + ".md", lambda temporary: pathlib.Path(temporary).write_text(text, encoding="utf-8"))
    plot(res, batches, cache_lengths, stem + ".png")
    print("\n".join(targets_table(res)))
    print(f"wrote {stem}.md and {stem}.png ({(time.time() - start) / 60:.1f} min)")


if __name__ == "__main__":
    app.run(main)
