"""Renders the serving report (Markdown and PNG) from its results JSON alone: the CPU rows with their targets, the
engine's schedule modeled on Trainium and the HBM capacity table (benchmarks/serving.py measures; nothing here runs
a model)."""

from __future__ import annotations

import os

import numpy as np
import serving_modeled  # sibling module: the script's folder is on sys.path

from jax_neuronmm.compress.checkpoint import write_atomically


def summary(row: dict) -> dict:
    """A measured row's figures from its per-request records (static rows: tokens / seconds only)."""
    if "requests" not in row:
        return dict(tokens_per_s=row["tokens"] / row["seconds"], failed=0)
    requests = row["requests"]
    ttft = [r["ttft"] for r in requests if r["ttft"] is not None]
    itl = [gap for r in requests for gap in r["itl"]]

    def pct(values, q):
        return float(np.percentile(values, q)) if values else float("nan")

    return dict(
        tokens_per_s=sum(r["tokens"] for r in requests) / row["seconds"],
        ttft_p50=pct(ttft, 50),
        ttft_p99=pct(ttft, 99),
        itl_p50=pct(itl, 50),
        itl_p99=pct(itl, 99),
        failed=sum(r["failed"] for r in requests),
    )


def write_report(results: dict, out: str, stem: str) -> None:
    """{stem}.md and {stem}.png from the results ({stem}.json's content)."""
    rows = results["rows"]
    figures = [(row, summary(row)) for row in rows]
    static = {row["config"]: fig for row, fig in figures if row["system"] == "static"}
    engine16 = {row["config"]: fig for row, fig in figures if row["system"] == "engine" and row["clients"] == 16}
    llama16 = next((fig for row, fig in figures if row["system"] == "llama.cpp" and row["clients"] == 16), None)
    lines = [
        "# Serving: the engine under load vs static-batch generate and llama.cpp's server (CPU), and on Trainium "
        "(modeled)",
        "",
        f"Model: {results['model']}. {results['requests']} requests, prompts 16..96 tokens of held-out text, outputs "
        "8..40 tokens, greedy, end-of-sequence ignored. The engine (XLA on CPU, max_batch "
        f"{results['max_batch']}, 16-slot blocks) driven in-process by closed-loop clients (no HTTP), after a warm-up "
        f"pass; static: `generate` in batches of {results['static_batch']}; llama.cpp: its OpenAI server (2 threads) "
        "on the same GGUF through the openai client, streamed. Peak RSS: the process's VmHWM reset before each row "
        "(the engine's and static rows: this Python process, model and compiled programs included; llama.cpp: the "
        "server process). Machine: 2 CPU cores; when each part ran: "
        + "; ".join(f"{part}: {when}" for part, when in results["runs"].items())
        + f". Data: {stem}.json (every figure below is computed from it).",
        "",
        "| system | weights | clients | output tok/s | vs static (same weights) | TTFT p50 / p99 (s) "
        "| ITL p50 / p99 (s) | failed | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row, fig in figures:
        base = static.get(row["config"])
        vs = f"{fig['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and row["system"] != "llama.cpp" else "-"
        latency = "- | -"
        if "ttft_p50" in fig:
            latency = f"{fig['ttft_p50']:.2f} / {fig['ttft_p99']:.2f} | {fig['itl_p50']:.3f} / {fig['itl_p99']:.3f}"
        clients = f"batch {row['clients']}" if row["system"] == "static" else row["clients"]
        lines.append(
            f"| {row['system']} | {row['config']} | {clients} | {fig['tokens_per_s']:.1f} | {vs} | {latency} | "
            f"{fig['failed']} | {row['peak_rss_mib']:.0f} |"
        )
    lines += ["", "Targets (ratios from this run):", ""]
    for config, fig in engine16.items():
        if config in static:
            ratio = fig["tokens_per_s"] / static[config]["tokens_per_s"]
            lines.append(
                f"- engine at 16 clients / static generate at batch {results['static_batch']} ({config}): "
                f"{ratio:.2f}x (target >= 0.9x: {'met' if ratio >= 0.9 else 'missed'})"
            )
        if llama16 is not None:
            ratio = fig["tokens_per_s"] / llama16["tokens_per_s"]
            # The target is the GGUF's own weights (dense here); fp8 is shown beside it, not held to it.
            verdict = f"target >= 1: {'met' if ratio >= 1 else 'missed'}" if config == "dense" else "not a target"
            lines.append(
                f"- engine ({config}) at 16 clients / llama.cpp's server at 16 clients: {ratio:.2f}x ({verdict})"
            )
    if llama16 is None:
        lines.append(f"- llama.cpp's server: {results.get('llama_cpp_status', 'not run')}")
    scaling = [(row["config"], row["clients"], fig) for row, fig in figures if row["system"] == "engine"]
    for config in dict.fromkeys(c for c, _, _ in scaling):
        steps = [f"{n}: {f['tokens_per_s']:.1f}" for c, n, f in scaling if c == config]
        lines.append(f"- engine scaling ({config}), clients: tok/s = {', '.join(steps)}")
    failed64 = [(row["config"], fig["failed"], row["peak_rss_mib"]) for row, fig in figures if row["clients"] == 64]
    for config, failed, rss in failed64:
        lines.append(f"- 64 clients ({config}): {failed} failed requests, peak RSS {rss:.0f} MiB")
    modeled = results.get("modeled")
    if modeled:
        lines += modeled_lines(modeled, results["requests"])
    write_atomically(
        os.path.join(out, f"{stem}.md"), lambda p: open(p, "w", encoding="utf-8").write("\n".join(lines) + "\n")
    )
    plot(figures, os.path.join(out, f"{stem}.png"), results["model"])


def record_run(runs: dict, part: str, configs, all_configs, when: str) -> None:
    """Keeps when `part` ran in the JSON's `runs` (the engine's key names its configs), dropping the engine runs
    whose every configuration was measured again now (key "engine": an older report's run of all_configs)."""
    if part == "engine":
        for old in [k for k in runs if k == "engine" or k.startswith("engine ")]:
            if set(old.split(" ", 1)[1].split("/") if " " in old else all_configs) <= set(configs):
                del runs[old]
        part = f"engine {'/'.join(configs)}"
    runs[part] = when


def modeled_lines(modeled: dict, requests: int) -> list[str]:
    steps = modeled["schedule"]
    slots, ratios = serving_modeled.paged_over_contiguous(modeled)
    shares = {}  # weights -> target -> prefill steps' share of the modeled time
    for kind, priced in modeled["priced"].items():
        for t in serving_modeled.TARGETS:
            rate = serving_modeled.modeled_rate(steps, priced, t)
            if rate is not None:
                shares.setdefault(kind, {})[t] = rate["prefill_us"] / (rate["prefill_us"] + rate["decode_us"])
    decodes = [s for s in steps if s[0] == "decode"]
    mean_rows = sum(s[4] for s in decodes) / max(len(decodes), 1)
    return [
        "",
        "## Trainium, modeled",
        "",
        f"The schedule of an engine run on this CPU at max_batch {modeled['batch']} ({2 * modeled['batch']} "
        f"closed-loop clients over {modeled['requests']} requests of the same mix: the {requests} above and "
        f"more drawn the same way; {modeled['model']}'s token counts): {len(steps)} steps, "
        f"{len(decodes)} decode steps of {mean_rows:.2f} active rows on average, "
        f"{len(steps) - len(decodes)} prefill steps (a prompt chunk for each row waiting, all but its last token, "
        f"{sum(s[4] for s in steps if s[0] != 'decode')} chunks), {modeled['tokens']} output tokens. Each decode "
        f"step priced as the paged looped kernel at {modeled['model']}'s shape (full depth, count-only trace, its "
        "batch bucket and block-table slots); prefill steps at their roofline (a lower bound: weights read once for "
        "the step's rows); 0 µs per launch. Alone (the ratios' denominator): the looped kernel at batch 8 over a "
        "contiguous cache of each decode step's slots, 8 tokens a step; the whole-context column: at the engine's "
        "whole context. Decode-only below 1 counts the partial batches: the run's last requests drain rows one by "
        "one, which a server under steady load never does; the saturated column prices only the steps up to the "
        "last prefill (while requests still waited for rows), the target is judged on the whole run. Per "
        "NeuronCore; all figures modeled, not measured. Decode-only ÷ alone also carries the kernels' own "
        f"difference: the paged step ÷ the contiguous one at batch {serving_modeled.STANDALONE_BATCH} and {slots} "
        "slots (the commonest full step) is "
        + ", ".join(f"{kind} " + " / ".join(f"{r:.2f}" for r in by.values()) for kind, by in ratios.items())
        + f" ({' / '.join(serving_modeled.TARGETS)}). Prefill steps (each reads every layer's weights once for its "
        "rows; no LM head: a new row's first decode step feeds its last prompt token and samples its first output) "
        "take "
        + ", ".join(f"{kind} " + " / ".join(f"{100 * p:.0f}%" for p in by.values()) for kind, by in shares.items())
        + " of the modeled time.",
        "",
        *serving_modeled.schedule_lines(modeled),
        *sweep_section(modeled),
        "",
        "### Concurrent sequences per NeuronCore (HBM)",
        "",
        "HBM per NeuronCore: trn1 32 GiB / 2 cores, trn2 96 GiB / 8 physical cores (AWS's architecture guides). "
        "Weights: every projection and the LM head as the decode step stores them (fp8: one byte a value plus "
        "float32 scales; compressed: SVD factors at keep 0.8), norms, plus the bf16 embedding table where the head "
        "is not that table (both models tie them). KV: bf16, every layer's blocks for the whole context (the pool "
        "also holds a sliding-window layer's). An upper bound: no activations or runtime reserve.",
        "",
        *serving_modeled.capacity_lines(modeled["capacity"]),
    ]


def sweep_section(modeled: dict) -> list[str]:
    """The prefill_ahead sweep (serving_modeled.sweep_lines) with what it shows; none before the JSON held one."""
    if "prefill_ahead" not in modeled:
        return []
    return [
        "",
        f"The run above admits up to {modeled['prefill_ahead']} requests beyond the decoding rows "
        "(`EngineOptions.prefill_ahead`): a prefill step runs only when a row would go empty, and then prefills "
        "them too, so one weight read serves several prompts and the next rows to free start decoding without a "
        "prefill step of their own. The same mix run again at other values, priced alike (engine ÷ alone, the "
        "whole run; a prefill step of more prompts is compute-bound at its roofline, its rows padded to the longest "
        "chunk's bucket, so more is not always faster):",
        "",
        *serving_modeled.sweep_lines(modeled),
    ]


def plot(figures, path: str, model_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    series = dict.fromkeys((row["system"], row["config"]) for row, _ in figures if row["system"] != "static")
    for system, config in series:
        points = [
            (row["clients"], f["tokens_per_s"])
            for row, f in figures
            if (row["system"], row["config"]) == (system, config)
        ]
        ax.plot(*zip(*points), "o-", label=f"{system}, {config}")
    for row, f in figures:
        if row["system"] == "static":
            ax.axhline(f["tokens_per_s"], ls="--", color="gray", lw=1)
            ax.annotate(f"static generate, batch {row['clients']}, {row['config']}", (1, f["tokens_per_s"]), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{model_name} on CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_atomically(path, lambda p: fig.savefig(p, dpi=120, format="png"))
    plt.close(fig)
