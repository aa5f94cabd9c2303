"""Helpers the calibration and speed-band benchmarks share: rank 0's kernel runs of a count-only step, atomic text
writes."""

from __future__ import annotations

from jax_neuronmm.compress.checkpoint import write_atomically
from nki_kernels import emulator
from nki_kernels.emulator import trace


def rank0_runs(step, target: str) -> list[trace.KernelRun]:
    """The kernel runs of rank 0 (every run of a plain launch) while step() runs count-only on `target`."""
    runs = []

    def keep(run):
        if run.rank == 0:
            runs.append(run)

    trace.add_listener(keep)
    try:
        with emulator.use_target(target), emulator.count_only():
            step()
    finally:
        trace.remove_listener(keep)
    return runs


def write_text(path, text: str) -> None:
    """Write `text` to `path` atomically (a reader sees the old file or the new one)."""

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_atomically(path, write)
