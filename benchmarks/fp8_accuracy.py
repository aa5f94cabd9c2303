"""Accuracy of fp8 e4m3 weights on the real Gemma 3 270M: held-out perplexity ratio and top-1 agreement with the
dense model, round to nearest vs calibration-aware (GPTQ) rounding, projections alone and with the LM head.

    python benchmarks/fp8_accuracy.py                      # the real model from the `demo` extra's package
    python benchmarks/fp8_accuracy.py --checkpoint_dir DIR  # or an HF directory of Gemma 3 270M

Windows and metrics are the accuracy report's (models.text_kinds.text_windows, models.evaluation.predictions,
models.quality.top1_agreement): chapters 1-12 of Pride and Prejudice calibrate, chapters 50-61 evaluate.
Writes benchmarks/results/fp8_accuracy.md.
"""

from __future__ import annotations

import os
import time

import _flag_checks  # sibling module: the script's folder is on sys.path
from absl import app, flags
from accuracy_report import load_model

from jax_neuronmm import pipeline
from jax_neuronmm.compress.checkpoint import write_atomically
from jax_neuronmm.models import evaluation, quality, text_kinds
from jax_neuronmm.pipeline.calibration import CALIBRATION_TEXT

# --checkpoint_dir, --seq_len, --calibration_windows and --eval_windows are the accuracy report's flags (defined
# when it is imported), with its defaults: 256-token windows, 16 to calibrate, 8 to evaluate.
FLAGS = flags.FLAGS
_flag_checks.unused(
    (
        "distill_windows",
        "prompts",
        "prompt_tokens",
        "new_tokens",
        "cloze_items",
        "configs",
        "render_only",
        "load_note",
    ),
    "fp8_accuracy.py",
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONFIGURATIONS = [  # (label, targets, calibrated)
    ("projections, round to nearest", ("attention", "mlp"), False),
    ("projections, GPTQ", ("attention", "mlp"), True),
    ("projections + head, round to nearest", ("attention", "mlp", "head"), False),
    ("projections + head, GPTQ", ("attention", "mlp", "head"), True),
]


def text_windows(model, path: str, count: int):
    """The first `count` [count, seq_len] windows of the text file at `path` (the accuracy report's windows)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    bos = model.tokenizer.token_to_id("<bos>")
    return text_kinds.text_windows(model.tokenizer, text, count, FLAGS.seq_len, bos, name=os.path.basename(path))


def main(argv):
    del argv
    model = load_model()
    calibration = text_windows(model, CALIBRATION_TEXT, FLAGS.calibration_windows)
    held_out = text_windows(model, text_kinds.EVALUATION_TEXT, FLAGS.eval_windows)
    dense = evaluation.predictions(model, held_out)
    dense_ppl = dense.perplexity
    rows = []
    for label, targets, calibrated in CONFIGURATIONS:
        start = time.time()
        quantized = pipeline.quantize_model(
            model, targets=targets, calibration_ids=calibration if calibrated else None, progress=False
        )
        seconds = time.time() - start
        predicted = evaluation.predictions(quantized, held_out)
        ppl = predicted.perplexity
        agreement = quality.top1_agreement(predicted, dense)
        rows.append((label, ppl / dense_ppl, agreement, seconds))
        print(f"{label}: {ppl / dense_ppl:.4f}x perplexity, top-1 agreement {agreement:.3f}, {seconds:.0f} s")
        del quantized
    tokens = FLAGS.calibration_windows * FLAGS.seq_len
    lines = [
        "# fp8 e4m3 weights on Gemma 3 270M",
        "",
        f"Held-out perplexity (Pride and Prejudice ch. 50-61, {FLAGS.eval_windows} windows of {FLAGS.seq_len} "
        f"tokens) relative to the dense model ({dense_ppl:.3f}), and top-1 agreement with the dense model's next-token "
        f"predictions. One fp32 scale per output channel; GPTQ calibrates on {tokens} tokens of ch. 1-12. "
        "Written by benchmarks/fp8_accuracy.py.",
        "",
        "| weights in fp8 | perplexity / dense | top-1 agreement | quantize time (s) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {label} | {ratio:.4f} | {agreement:.3f} | {seconds:.0f} |" for label, ratio, agreement, seconds in rows
    ]

    def write(temporary):
        with open(temporary, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

    write_atomically(os.path.join(RESULTS, "fp8_accuracy.md"), write)


if __name__ == "__main__":
    app.run(main)
