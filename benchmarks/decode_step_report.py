"""The decode composition report: per-op, per-layer and looped kernels per shape (`markdown`: targets, a
headline, the launch-overhead sweep, every shape, the same at the fitted cost terms with bands, the nkilib peer and
its launches, the extrapolation check) and its plot."""

from __future__ import annotations

from decode_cases import NOT_TRACED, RunInfo, timing_note  # sibling module: the script's folder is on sys.path
from decode_nkilib import nkilib_launch_table, nkilib_note  # sibling module: the script's folder is on sys.path
from harness.comparison import (
    COMPOSITIONS,
    LABELS,
    PEAK_FRACTION,
    TARGETS,
    DecodeModel,
    Results,
    must_move_bytes,
    peak_fraction,
    targets_table,
)
from harness.tables import band_text, latency_band_text

from jax_neuronmm.compress.checkpoint import write_atomically
from nki_kernels.emulator import launch, speed_bands


def _tokens(batch, latency_us):
    return "–" if latency_us is None else f"{batch / latency_us * 1e6:,.0f}"


def _ratio(slow_us, fast_us):
    return "–" if slow_us is None or fast_us is None else f"{slow_us / fast_us:.2f}x"


def _row_values(latency_us, batch, nbytes, target):
    if latency_us is None:
        return "– / – / –"
    return (
        f"{latency_us:.1f} / {batch / latency_us * 1e6:,.0f} / {100 * peak_fraction(nbytes, latency_us, target):.0f}%"
    )


def shape_table(res: Results, model: DecodeModel, batches, cache_lengths, overhead_us) -> list[str]:
    lines = [
        "| batch | S | model | composition | launches | HBM MB moved / must move "
        + "".join(f"| {t} µs / tok/s / % peak " for t in TARGETS)
        + "|",
        "|---|---|---|---|---|---|" + "---|" * len(TARGETS),
    ]
    for b in batches:
        for s in cache_lengths:
            for c in (False, True):
                need = must_move_bytes(model, c, b, s)
                for comp in COMPOSITIONS:
                    m = res.ours[(model.name, c, b, s, comp)]
                    if not m.kernel_us:
                        lines.append(
                            f"| {b} | {s} | {'compressed' if c else 'dense'} | {LABELS[comp]} | – | – / "
                            f"{need / 1e6:.1f} " + "| – " * len(TARGETS) + "|"
                        )
                        continue
                    lines.append(
                        f"| {b} | {s} | {'compressed' if c else 'dense'} | {LABELS[comp]} | {m.launches:.0f} "
                        f"| {m.hbm_bytes / 1e6:.1f} / {need / 1e6:.1f} "
                        + "".join(f"| {_row_values(m.latency_us(t, overhead_us), b, need, t)} " for t in TARGETS)
                        + "|"
                    )
            peer = res.nkilib.get((model.name, b, s))
            if peer is not None:
                need = must_move_bytes(model, False, b, s)
                lines.append(
                    f"| {b} | {s} | dense (nkilib megakernel) | transformer_tkg + our LM head "
                    f"| {peer.launches + 1:.0f} "
                    f"| {peer.hbm_bytes / 1e6:.1f} + head / {need / 1e6:.1f} "
                    + "".join(
                        f"| {_row_values(res.nkilib_step_us(model.name, b, s, t, overhead_us), b, need, t)} "
                        for t in TARGETS
                    )
                    + "|"
                )
    return lines


def sweep_table(res: Results, model: DecodeModel, batch: int, cache_len: int) -> list[str]:
    """tokens/s per composition at each assumed per-launch overhead, and the looped kernel's speedups."""
    sweep = launch.LAUNCH_OVERHEAD_SWEEP_US
    lines = [
        f"| {model.name}, batch {batch}, S {cache_len} | target | launches "
        + "".join(f"| {o:g} µs " for o in sweep)
        + "|",
        "|---|---|---|" + "---|" * len(sweep),
    ]
    for c in (False, True):
        for t in TARGETS:
            rows = {comp: res.ours[(model.name, c, batch, cache_len, comp)] for comp in COMPOSITIONS}
            for comp, m in rows.items():
                lines.append(
                    f"| {'compressed' if c else 'dense'} {LABELS[comp]} tok/s | {t} | {m.launches:.0f} "
                    + "".join(f"| {_tokens(batch, m.latency_us(t, o))} " for o in sweep)
                    + "|"
                )
            looped = rows["looped"]
            for other in ("per_op", "per_layer", "per_op_svd_mlp"):
                lines.append(
                    f"| {'compressed' if c else 'dense'} looped ÷ {other} speedup | {t} | "
                    + "".join(f"| {_ratio(rows[other].latency_us(t, o), looped.latency_us(t, o))} " for o in sweep)
                    + "|"
                )
            if not c:
                peer = [res.nkilib_step_us(model.name, batch, cache_len, t, o) for o in sweep]
                if peer[0] is not None:
                    p = res.nkilib[(model.name, batch, cache_len)]
                    lines.append(
                        f"| dense (nkilib megakernel) + our head tok/s | {t} | {p.launches + 1:.0f} "
                        + "".join(f"| {batch / us * 1e6:,.0f} " for us in peer)
                        + "|"
                    )
    return lines


def _speedups(res: Results, model: str, b: int, s: int) -> list[tuple[str, object, object]]:
    """(what, (slow, fast) documented µs on a target, (slow, fast) bands on a target) of each speedup the report
    states at one shape: looped over per_op, per_layer and per_op + svd_mlp, compressed over dense looped, and the
    nkilib peer (its step: nkilib_step_us / nkilib_step_band) over our dense and compressed looped kernels."""

    def ours(c, comp):
        m = res.ours.get((model, c, b, s, comp))
        return (lambda t: None if m is None else m.latency_us(t, 0.0)), (
            lambda t: None if m is None else m.band_us.get(t)
        )

    rows = []
    for c in (False, True):
        for other in ("per_op", "per_layer", "per_op_svd_mlp"):
            rows.append(
                (f"{'compressed' if c else 'dense'}: looped vs {LABELS[other]}", ours(c, other), ours(c, "looped"))
            )
    rows.append(("compressed looped vs dense looped", ours(False, "looped"), ours(True, "looped")))
    peer = (
        lambda t: res.nkilib_step_us(model, b, s, t, 0.0),
        lambda t: res.nkilib_step_band(model, b, s, t),
    )
    for c in (False, True):
        rows.append((f"{'compressed' if c else 'dense'}: looped vs dense (nkilib megakernel)", peer, ours(c, "looped")))
    return [(what, (slow[0], fast[0]), (slow[1], fast[1])) for what, slow, fast in rows]


def _band(slow: dict | None, fast: dict | None) -> str:
    return band_text(None if slow is None or fast is None else speed_bands.ratio_band(slow, fast))


def headline_speedups(res: Results, model: DecodeModel, batch: int, cache_lengths) -> list[str]:
    """Each speedup the report states at `model`, `batch` and each S: documented (0 µs per launch), then at the
    fitted cost terms with its band."""
    lines = [
        "| S | speedup (slower ÷ faster) " + "".join(f"| {t} documented | {t} fitted (band) " for t in TARGETS) + "|",
        "|---|---|" + "---|---|" * len(TARGETS),
    ]
    for s in cache_lengths:
        for what, (slow_us, fast_us), (slow_band, fast_band) in _speedups(res, model.name, batch, s):
            lines.append(
                f"| {s} | {what} "
                + "".join(f"| {_ratio(slow_us(t), fast_us(t))} | {_band(slow_band(t), fast_band(t))} " for t in TARGETS)
                + "|"
            )
    return lines


def band_table(res: Results, model: DecodeModel, batches, cache_lengths) -> list[str]:
    """Per batch, S and target: dense and compressed looped µs at the fitted cost terms (band), and each
    speedup the report states there at the fitted terms (band)."""
    first = _speedups(res, model.name, batches[0], cache_lengths[0])
    lines = [
        "| batch | S | hw | dense looped µs | compressed looped µs "
        + "".join(f"| {what} " for what, _, _ in first)
        + "|",
        "|---|---|---|---|---|" + "---|" * len(first),
    ]
    for b in batches:
        for s in cache_lengths:
            for t in TARGETS:
                latencies = [res.ours.get((model.name, c, b, s, "looped")) for c in (False, True)]
                cells = [latency_band_text(None if m is None else m.band_us.get(t)) for m in latencies]
                cells += [_band(slow(t), fast(t)) for _, _, (slow, fast) in _speedups(res, model.name, b, s)]
                lines.append(f"| {b} | {s} | {t} " + "".join(f"| {c} " for c in cells) + "|")
    return lines


def extrapolation_lines(res: Results) -> list[str]:
    if not res.extrapolation_check:
        return ["Every model here was traced at full depth."]
    lines = [
        "| composition | model | batch, S | depths traced "
        + "".join(f"| {t}: extrapolated ÷ full trace " for t in TARGETS)
        + "| launches: extrapolated vs full |",
        "|---|---|---|---|" + "---|" * len(TARGETS) + "---|",
    ]
    for comp, c, b, s, full, guess in res.extrapolation_check:
        lines.append(
            f"| {LABELS[comp]} | {'compressed' if c else 'dense'} | {b}, {s} | {guess.extrapolated} "
            + "".join(
                f"| {guess.kernel_us[t] / full.kernel_us[t]:.4f} "
                if t in guess.kernel_us and t in full.kernel_us
                else "| – "
                for t in TARGETS
            )
            + f"| {guess.launches:.1f} vs {full.launches:.0f} |"
        )
    return lines


def markdown(res: Results, batches, cache_lengths, run: RunInfo) -> str:
    """The report of run_all's Results, traced as `run` says."""
    quick, loads = run.quick, run.loads
    sweep = ", ".join(f"{o:g}" for o in launch.LAUNCH_OVERHEAD_SWEEP_US)
    lines = [
        "# Decode step over all layers: per-op vs per-layer vs looped kernels" + (" (quick subset)" if quick else ""),
        "",
        "**All figures are modeled, not measured**: count-only emulator runs (`harness.runner."
        "run_decode_step(composition, operands, spec, numerics=False)` on shape/dtype placeholders), latency from "
        "`nki_kernels/emulator/cost_model.py` per launch, composed by `nki_kernels/emulator/launch.py`. bf16 "
        "weights and cache, one new token per row, fp32 logits. Compressed = keep 0.8: every projection of every "
        "layer and the LM head factored at `nki_kernels.ranks.block_aligned_rank(K, N, 0.8)` (the same rank in "
        "every layer). Compositions: (i) per_op = one kernel per op, the hidden state in HBM between them; (ii) "
        "per_layer = one fused kernel per layer, then the LM-head kernel; (iii) looped = one kernel for all "
        "layers, final norm and LM head; per_op + svd_mlp = per-op kernels except the MLP, which is the fused svd_mlp "
        "kernels when compressed (per-op projection kernels when dense).",
        "",
        "- **Latency** of a composition = Σ modeled latency of its launches (each launch scheduled on its own, so "
        "its pipeline fill and drain count) + launches × per-launch overhead. **No public source gives a "
        "per-launch overhead for a NeuronCore** (searched: the Neuron docs, runtime release notes, vllm-neuron "
        "design notes; the nearest figures are a 437 µs host-side gap between synchronous NEFF executions and a "
        '"20 µs" trn3 NEFF-start improvement, neither of them the cost of a kernel boundary; the kernel-looping '
        "paper, arXiv 2410.23668, measures SN40L and H100): the overhead is an assumption, swept over "
        f"{sweep} µs. Tables without a sweep use 0 µs (kernels only).",
        "- **Bytes that must move** (per step) = weights read once (projections K·N dense or r·(K+N) factored, "
        "norm weights, final norm, LM head H·V or r·(H+V)) + KV cache: k and v of every visible slot read "
        "(min(S, 512) slots in Gemma 3's sliding-window layers, S in the others) and the step's slot written, "
        "2·B·kv_heads·D per slot per layer + logits written (B·V fp32). Token embeddings, RoPE tables and masks "
        "are left out (< 0.1%). Our kernels read only the window's slots in sliding-window layers "
        "(`DecodeSpec.mask_windows`: a window of min(S, 512) slots ending at the step's slot, placed by a "
        "runtime DMA offset), so HBM MB moved tracks must-move at every S.",
        "- **% of peak** = must-move bytes ÷ latency ÷ the core's peak DMA-to-HBM rate: min(its share of the "
        "chip's HBM bandwidth, 16 DMA engines) = 272 GB/s on trn1 (DMA-bound: 16 × 17 GB/s), 362.5 GB/s on trn2 "
        "(2.9 TB/s ÷ 8 cores). tok/s = batch ÷ latency, per NeuronCore.",
        "- **At the fitted cost terms, with bands**: each latency and speedup again at the cost terms fitted to "
        "AWS's published end-to-end latencies (benchmarks/results/calibration.md: a fixed cost per step, paid once "
        "however many launches the step makes, a DMA issue cost, the core's HBM efficiency, LNC=2 on trn2), "
        "rescheduled from each case's instruction records, and over the band's corners (fixed step cost 0 to "
        "fitted, DMA issue cost 0 to max(fitted, 600 ns), compute x1 to x2; `nki_kernels/emulator/speed_bands.py`): "
        "**fitted (lowest–highest)**. The targets are judged on the documented model, as in the other reports; "
        "the fitted figures say how much of each speedup survives a host's fixed cost per step (most of it at the "
        "band's low corners, little at the fitted point).",
        f"- Depths: {'; '.join(f'{k}: {v}' for k, v in run.depths.items())}.",
        f"- Made by `{run.command}`: {timing_note(run.seconds)}; {run.elapsed_s / 60:.1f} min in all on a 2-core "
        f"machine shared with other jobs (1-minute load average {loads[0]:.1f} at the start, {loads[-1]:.1f} at "
        f"the end, {min(loads):.1f} to {max(loads):.1f} during the run)" + (f"; {run.note}." if run.note else "."),
        "",
        "## Targets (batch 1), at each assumed per-launch overhead",
        "",
        "The bound column: the most a ratio target can reach at 0 µs per launch, at the shape where that is lowest "
        "(other ÷ looped ≤ other's latency ÷ must-move bytes at the peak rate; compressed ÷ dense looped ≤ dense ÷ "
        'compressed must-move bytes); "unreachable": under the goal, so no looped kernel meets it there at 0 µs '
        "per launch (launch overhead slows only the many-launch side, so the bound rises with it). The targets are "
        "judged on the documented model; the same speedups at the fitted cost terms, with bands: under the "
        'headline and in "At the fitted cost terms, with bands" below.',
        "",
        *targets_table(res),
        "",
    ]
    first = res.models[0]
    b0 = batches[0]
    lines += [
        f"## Headline: {first.name}, batch {b0} (0 µs per launch)",
        "",
        *shape_table(res, first, [b0], cache_lengths, 0.0),
        "",
        "Its speedups, documented (as above) and at the fitted cost terms with their bands:",
        "",
        *headline_speedups(res, first, b0, cache_lengths),
        "",
    ]
    lines += ["## Launch-overhead sweep (assumed per-launch overhead)", ""]
    for m in res.models:
        s = cache_lengths[min(1, len(cache_lengths) - 1)]
        lines += [*sweep_table(res, m, b0, s), ""]
    lines += ["## Every shape (0 µs per launch)", ""]
    for m in res.models:
        lines += [
            f"### {m.name} (L {m.num_layers}, H {m.hidden}, heads {m.num_heads}/{m.num_kv_heads}, D "
            f"{m.head_dim}, I {m.intermediate}, V {m.vocab}; {m.source})",
            "",
            *shape_table(res, m, batches, cache_lengths, 0.0),
            "",
        ]
    lines += [
        "## At the fitted cost terms, with bands (0 µs per launch)",
        "",
        "The looped kernel's latency and each speedup of the tables above, at the cost terms fitted to AWS's "
        "published latencies: **fitted (lowest–highest over the band's corners)**, µs or speedup (slower ÷ "
        "faster; the peer's step: its calls and our LM head, the fixed step cost once). The fitted fixed cost per "
        "step is the same for every composition and the peer, so it pulls every fitted speedup toward 1x; the "
        "band's corners without it come closer to the documented speedups.",
        "",
    ]
    for m in res.models:
        lines += [f"### {m.name}", "", *band_table(res, m, batches, cache_lengths), ""]
    failed = [
        f"- {model}, {'compressed' if c else 'dense'}, batch {b}, S {s}, {LABELS[comp]}: {m.note}"
        for (model, c, b, s, comp), m in res.ours.items()
        if m.note and m.note != NOT_TRACED
    ]
    untraced = [
        f"{model} {'compressed' if c else 'dense'} b{b} S{s} {comp}"
        for (model, c, b, s, comp), m in res.ours.items()
        if m.note == NOT_TRACED
    ]
    if untraced:
        failed.append(f"- {NOT_TRACED}: " + ", ".join(untraced))
    if failed:
        lines += ["## Did not run (– in the tables)", "", *failed, ""]
    lines += [
        "## The peer: dense (nkilib megakernel)",
        "",
        nkilib_note(res),
        "",
        *nkilib_launch_table(res, b0),
        "",
        "## Layer-count extrapolation check",
        "",
        "Models deeper than the traced depth are traced at two layer counts (multiples of the layer pattern) "
        "and extrapolated linearly in L (latency, launches and bytes). The check traces Gemma 3 270M both ways:",
        "",
        *extrapolation_lines(res),
        "",
    ]
    return "\n".join(lines) + "\n"


def plot(res: Results, batches, cache_lengths, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(TARGETS), figsize=(12, 8))
    sweep = launch.LAUNCH_OVERHEAD_SWEEP_US
    first, b0 = res.models[0], batches[0]
    s0 = cache_lengths[min(1, len(cache_lengths) - 1)]
    colors = dict(zip(COMPOSITIONS, ("tab:red", "tab:orange", "tab:green", "tab:gray")))
    for col, t in enumerate(TARGETS):
        ax = axes[0][col]
        for comp in COMPOSITIONS:
            for c, style in ((False, "-o"), (True, "--s")):
                m = res.ours[(first.name, c, b0, s0, comp)]
                if t not in m.kernel_us:
                    continue
                ax.plot(
                    sweep,
                    [b0 / m.latency_us(t, o) * 1e6 for o in sweep],
                    style,
                    color=colors[comp],
                    label=f"{'compressed' if c else 'dense'} {LABELS[comp]}",
                )
        peer = [res.nkilib_step_us(first.name, b0, s0, t, o) for o in sweep]
        if peer[0] is not None:
            ax.plot(sweep, [b0 / us * 1e6 for us in peer], ":^", color="black", label="dense (nkilib megakernel)")
        ax.set_title(f"{t}: {first.name}, batch {b0}, S {s0}: tok/s vs assumed µs per launch", fontsize=9)
        ax.set_xlabel("per-launch overhead (µs, assumed)")
        ax.set_ylabel("tokens/s per NeuronCore (modeled)")
        ax.grid(alpha=0.3)
        ax = axes[1][col]
        for m in res.models:
            for c, style in ((False, "-o"), (True, "--s")):
                points = [(s, res.ours[(m.name, c, b0, s, "looped")].latency_us(t, 0.0)) for s in cache_lengths]
                points = [(s, us) for s, us in points if us is not None]
                ax.plot(
                    [s for s, _ in points],
                    [100 * peak_fraction(must_move_bytes(m, c, b0, s), us, t) for s, us in points],
                    style,
                    label=f"{m.name} {'compressed' if c else 'dense'}",
                )
        ax.axhline(100 * PEAK_FRACTION, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.set_title(f"{t}: looped kernel, % of peak HBM bandwidth, batch {b0}, 0 µs/launch", fontsize=9)
        ax.set_xlabel("KV-cache length S")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    axes[0][-1].legend(fontsize=6)
    axes[1][0].legend(fontsize=6)
    fig.suptitle("Decode step, modeled (emulator cost model, bf16; compressed = keep 0.8)")
    fig.tight_layout()
    write_atomically(path, lambda temporary: fig.savefig(temporary, format="png", dpi=110))
    plt.close(fig)
