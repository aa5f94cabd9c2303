"""The decode reports' Markdown tables built from measured cases (harness.comparison.Measured): the fp8 report's
rows beside bf16 dense looped and the tensor-parallel report's rows beside their bounds and one rank, each speedup
also at the fitted cost terms with its band (`speedup_band`, `band_text`, `latency_band_text`)."""

from __future__ import annotations

from harness.comparison import (
    BF16,
    COMPOSITIONS,
    LABELS,
    TARGETS,
    TP_COMPOSITIONS,
    DecodeModel,
    Measured,
    must_move_bytes,
    peak_fraction,
    tensor_parallel_bound_us,
    tp_spec,
    where,
)
from nki_kernels.decode import traffic
from nki_kernels.emulator import speed_bands


def speedup_band(slow: Measured | None, fast: Measured | None, target: str) -> tuple[float, float, float] | None:
    """slow ÷ fast on `target` at the fitted cost terms, lowest and highest over the band's corners
    (speed_bands.ratio_band of their band_us); None where either has no band there."""
    if slow is None or fast is None or target not in slow.band_us or target not in fast.band_us:
        return None
    return speed_bands.ratio_band(slow.band_us[target], fast.band_us[target])


def band_text(band: tuple[float, float, float] | None) -> str:
    """A speedup_band as "1.21x (1.20–1.91x)": at the fitted terms, then the band; "–" without one."""
    return "–" if band is None else f"{band[0]:.2f}x ({band[1]:.2f}–{band[2]:.2f}x)"


def latency_band_text(band: dict | None) -> str:
    """A band_latencies as "12270 (3130–15100)" µs: at the fitted terms, then the lowest and highest corner; "–"
    without one."""
    if band is None:
        return "–"
    return f"{band['fitted']:.0f} ({min(band['corners']):.0f}–{max(band['corners']):.0f})"


def fp8_table(ours: dict, model: DecodeModel, batches, cache_lengths) -> list[str]:
    """The fp8 report's Markdown table for `model`: a row per batch, S, weights (bf16 / fp8), dense or compressed
    and composition in `ours` ({(model name, fp8, compressed, batch, S, composition): Measured}) with its launches,
    HBM bytes moved and must-move, and per target the modeled µs at 0 µs per launch, % of peak and the speedup
    over bf16 dense looped at the same batch and S, then that speedup at the fitted cost terms with its band ("–"
    where a case did not run or has no band)."""
    lines = [
        "| batch | S | weights | model | composition | launches | HBM MB moved / must move "
        + "".join(f"| {t} µs / % peak / × bf16 dense looped / fitted (band) " for t in TARGETS)
        + "|",
        "|---|---|---|---|---|---|---|" + "---|" * len(TARGETS),
    ]
    for b in batches:
        for s in cache_lengths:
            base = ours.get((model.name, False, False, b, s, "looped"))
            for fp8 in (False, True):
                for compressed in (False, True):
                    need = must_move_bytes(model, compressed, b, s, fp8=fp8)
                    for comp in COMPOSITIONS:
                        m = ours.get((model.name, fp8, compressed, b, s, comp))
                        if m is None:
                            continue
                        cells = []
                        for t in TARGETS:
                            us = m.latency_us(t, 0.0)
                            base_us = None if base is None else base.latency_us(t, 0.0)
                            if us is None:
                                cells.append("– / – / – / –")
                                continue
                            speedup = "–" if base_us is None else f"{base_us / us:.2f}x"
                            cells.append(
                                f"{us:.1f} / {100 * peak_fraction(need, us, t):.0f}% / {speedup} / "
                                + band_text(speedup_band(base, m, t))
                            )
                        moved = f"{m.hbm_bytes / 1e6:.1f}" if m.kernel_us else "–"
                        lines.append(
                            f"| {b} | {s} | {'fp8' if fp8 else 'bf16'} | {where(compressed)} | {LABELS[comp]} "
                            f"| {m.launches:.0f} | {moved} / {need / 1e6:.1f} "
                            + "".join(f"| {c} " for c in cells)
                            + "|"
                        )
    return lines


def tensor_parallel_table(ours: dict, model: DecodeModel, degrees, batches, cache_lengths) -> list[str]:
    """The tensor-parallel report's Markdown table for `model`: a row per degree T, batch, S, dense or compressed
    and composition in `ours` ({(model name, T, compressed, batch, S, composition): Measured of rank 0}), with
    launches, one rank's HBM bytes moved and must-move and bytes sent to collectives, and per target the modeled
    µs of the step, tok/s (batch ÷ µs, all ranks together), % of the aggregate peak bandwidth (T ranks' must-move
    bytes ÷ µs ÷ T cores' peak) and µs in collectives; beside each looped row, per target, the physical (byte)
    bound (tensor_parallel_bound_us) and its dependency floor (Measured.floor_us: the same kernel with unlimited
    DMA and link bandwidth), each with the row's latency as a multiple of it, and which of the two is larger:
    "bytes" or "chain" (the engines' dependency chain); and its speedup over the same case on one rank, documented
    and at the fitted cost terms with its band (speedup_band)."""
    lines = [
        "| T | batch | S | model | composition | launches | per rank: HBM MB moved / must move, KB to collectives "
        + "".join(f"| {t} µs / tok/s / % aggregate peak / µs in collectives " for t in TARGETS)
        + f"| looped: physical (byte) bound µs (latency ÷ bound), {' / '.join(TARGETS)} "
        + f"| looped: dependency floor µs (latency ÷ floor, the larger limit), {' / '.join(TARGETS)} "
        + f"| looped: × T = 1, documented / fitted (band), {' / '.join(TARGETS)} |",
        "|---|---|---|---|---|---|---|" + "---|" * len(TARGETS) + "---|---|---|",
    ]
    for p in degrees:
        for b in batches:
            for s in cache_lengths:
                for compressed in (False, True):
                    try:
                        spec = tp_spec(model, model.num_layers, compressed, p)
                    except ValueError:
                        continue
                    need = traffic.must_move_bytes(spec, b, s, itemsize=BF16.itemsize)
                    sent = traffic.collective_bytes(spec, b)
                    for comp in TP_COMPOSITIONS:
                        m = ours.get((model.name, p, compressed, b, s, comp))
                        if m is None:
                            continue
                        cells = []
                        for t in TARGETS:
                            us = m.latency_us(t, 0.0)
                            if us is None:
                                cells.append("– / – / – / –")
                                continue
                            coll = m.collective_us.get(t, 0.0)
                            cells.append(
                                f"{us:.1f} / {b / us * 1e6:,.0f} / {100 * peak_fraction(need, us, t):.0f}% / "
                                f"{coll:.1f} ({100 * coll / us:.0f}%)"
                            )
                        bound = floor = scaling = "–"
                        one = ours.get((model.name, 1, compressed, b, s, "looped"))
                        if comp == "looped" and m.kernel_us and one is not None and one.kernel_us:
                            scaling = " / ".join(
                                f"{one.latency_us(t, 0.0) / m.latency_us(t, 0.0):.2f}x / "
                                + band_text(speedup_band(one, m, t))
                                if t in m.kernel_us and t in one.kernel_us
                                else "–"
                                for t in TARGETS
                            )
                        if comp == "looped" and m.kernel_us:
                            bounds, floors = [], []
                            for t in TARGETS:
                                limit, us = tensor_parallel_bound_us(spec, b, s, t), m.latency_us(t, 0.0)
                                bounds.append(f"{limit:.1f} ({us / limit:.2f}x)" if us is not None else "–")
                                chain = m.floor_us.get(t)
                                floors.append(
                                    f"{chain:.1f} ({us / chain:.2f}x, {'chain' if chain > limit else 'bytes'})"
                                    if us is not None and chain
                                    else "–"
                                )
                            bound, floor = " / ".join(bounds), " / ".join(floors)
                        moved = f"{m.hbm_bytes / 1e6:.1f}" if m.kernel_us else "–"
                        lines.append(
                            f"| {p} | {b} | {s} | {where(compressed)} | {LABELS[comp]} | {m.launches:.0f} "
                            f"| {moved} / {need / 1e6:.1f}, {sent / 1e3:.1f} "
                            + "".join(f"| {c} " for c in cells)
                            + f"| {bound} | {floor} | {scaling} |"
                        )
    return lines
