"""The fp8-weight decode report: every case with fp8 weights beside the same case in bf16 (`fp8_markdown`)."""

from __future__ import annotations

from decode_cases import RunInfo, timing_note  # sibling module: the script's folder is on sys.path
from harness.tables import fp8_table


def fp8_markdown(ours, models, batches, cache_lengths, run: RunInfo) -> str:
    """The fp8 report of the cases `ours` (run_fp8's): each model's table and how the run went."""
    timing = timing_note(run.seconds)
    load_averages = run.loads
    lines = [
        "# Decode step with fp8 weights" + (" (quick subset)" if run.quick else ""),
        "",
        "**All figures are modeled, not measured**: count-only emulator runs of our decode-step kernels "
        "(`harness.runner.run_decode_step`), latency from `nki_kernels/emulator/cost_model.py` at 0 µs "
        "per launch. fp8 = every weight (each projection of every layer and the LM head, dense or factored) stored "
        "as fp8 e4m3 (Trainium's, ±240) with one float32 scale per output column (`DecodeSpec.fp8_weights`): the "
        "kernels DMA the fp8 bytes and multiply PSUM sums by the scales as they evict them; activations, norms "
        "and the KV cache stay bf16, logits fp32. Compressed = keep 0.8 (every projection and the head factored at "
        "`nki_kernels.ranks.block_aligned_rank(K, N, 0.8)`; fp8 factors scale by rank and by output column). One "
        "new token per row.",
        "",
        "- **Must move** = `nki_kernels.decode.traffic.must_move_bytes`: fp8 weights at one byte a value plus "
        "4 bytes a scale, the rest as in decode_step.md. **% peak** = must-move bytes ÷ latency ÷ the core's peak "
        "DMA-to-HBM rate (272 GB/s trn1, 362.5 GB/s trn2). **× bf16 dense** = bf16 dense looped latency ÷ this "
        "row's latency, the bf16 row traced in the same run. **fitted (band)** = the same speedup at the cost terms "
        "fitted to AWS's published end-to-end latencies (calibration.md), with its band over the uncertain terms "
        "(speed_bands.md): a fixed per-step cost that fp8 does not shrink takes most of the gain.",
        f"- Depths: {'; '.join(f'{k}: {v}' for k, v in run.depths.items())}.",
        f"- Made by `{run.command}`: {timing}; {run.elapsed_s / 60:.1f} min in all on a 2-core machine "
        f"shared with other jobs (1-minute load average {load_averages[0]:.1f} at the start, "
        f"{min(load_averages):.1f} to {max(load_averages):.1f} during the run).",
        "",
    ]
    for m in models:
        lines += [
            f"## {m.name} (L {m.num_layers}, H {m.hidden}, I {m.intermediate}, V {m.vocab})",
            "",
            *fp8_table(ours, m, batches, cache_lengths),
            "",
        ]
    return "\n".join(lines) + "\n"
