"""The tuner: searches block sizes per shape on the emulator's cost model and writes the shipped table.

    python benchmarks/tuning.py [--models=...] [--tokens=...] [--out=...] [--resume]
    python benchmarks/tuning.py --merge=a.json,b.json [--out=...]

Each candidate that the footprint model (`footprint.fits`) admits runs once on the emulator in count-only
mode; the profile's modeled latency per target picks the fastest. Results go to `block_table.json`
(`block_table.save_table`, beside the kernels), which `block_table.lookup` and so `dispatch` read.
"""

from __future__ import annotations

import functools
import os

import _flag_checks  # sibling module: the script's folder is on sys.path
import numpy as np
from harness.paper_shapes import PAPER_MLP_SHAPES, paper_tuning_jobs

from nki_kernels import emulator, svd_matmul, svd_mlp
from nki_kernels.block_table import (
    DECODE_MAX_TOKENS,
    KERNEL_VARIANTS,
    TABLE_PATH,
    TUNED_TOKENS,
    load_table,
    save_table,
    table_key,
)
from nki_kernels.footprint import fits
from nki_kernels.hardware import TARGETS

# Candidate block sizes searched (elements; multiples of 128). Token blocks only matter above 512 tokens;
# smaller ones are a fallback for shapes where nothing else fits.
BLOCK_T = (512, 1024, 2048)
BLOCK_T_FALLBACK = (256, 128)
BLOCK_K = (256, 512, 1024, 2048)
BLOCK_N = (1024, 2048, 4096)


def candidates(kind, shape, itemsize, target):
    """(variant, blocks) pairs worth measuring for `shape` on `target`, all passing the footprint filter."""
    t, k, r, n = shape
    # Every block_t ≥ T gives the same kernel; keep the smallest such one.
    block_ts = [b for b in BLOCK_T if b < t] + [b for b in BLOCK_T if b >= t][:1]
    variants = [v for v in KERNEL_VARIANTS[kind] if v != "decode" or t <= DECODE_MAX_TOKENS]
    block_ks = [b for b in BLOCK_K if b < k] + [b for b in BLOCK_K if b >= k][:1]
    block_ns = [b for b in BLOCK_N if b < n] + [b for b in BLOCK_N if b >= n][:1]
    for fallback in ((),) + tuple((b,) for b in BLOCK_T_FALLBACK):
        found = [
            (variant, dict(block_t=block_t, block_k=block_k, block_n=block_n))
            for variant in variants
            for block_t in (fallback or block_ts)
            for block_k in block_ks
            for block_n in block_ns
        ]
        found = [(v, b) for v, b in found if fits(kind, v, shape, itemsize, b, target)]
        if found:
            return found
    return []


def kernel_and_operands(kind, variant, shape, dtype):
    """The kernel a table kind and variant runs, and zero operands of `shape` (T, K, r, N) in its layout."""
    t, k, r, n = shape
    zeros = functools.partial(np.zeros, dtype=dtype)
    if kind == "svd_matmul":
        kernel = svd_matmul.svd_matmul_decode_kernel if variant == "decode" else svd_matmul.svd_matmul_kernel
        return kernel, (zeros((t, k)), zeros((k, r)), zeros((r, n)))
    if kind == "svd_mlp_gate_up":
        return svd_mlp.svd_mlp_gate_up_kernel, (
            zeros((t, k)),
            zeros((k, r)),
            zeros((r, n)),
            zeros((k, r)),
            zeros((r, n)),
        )
    return svd_mlp.svd_mlp_down_kernel, (zeros((k, t)), zeros((k, r)), zeros((r, n)))


def measure(kind, variant, shape, dtype, blocks):
    """The profile's RunSummary of one count-only run of the kernel (modeled µs per target in .latency_us)."""
    kernel, operands = kernel_and_operands(kind, variant, shape, dtype)
    with emulator.count_only(), emulator.profile() as prof:
        kernel(*operands, **blocks)
    (run,) = prof.runs
    return run


def tune(kind, shape, dtype, targets=TARGETS):
    """{target: entry} with entry = {"variant", "block_t", "block_k", "block_n", "modeled_us"} the fastest
    candidate on that target. One emulator run serves every target that admits the candidate."""
    itemsize = np.dtype(dtype).itemsize
    admitted = {}
    for target in targets:
        for variant, blocks in candidates(kind, shape, itemsize, target):
            key = (variant, tuple(sorted(blocks.items())))
            admitted.setdefault(key, []).append(target)
    best = {}
    for (variant, blocks_items), for_targets in admitted.items():
        blocks = dict(blocks_items)
        try:
            run = measure(kind, variant, shape, dtype, blocks)
        except emulator.NkiHardwareError as error:  # the footprint model let through what the hardware rules refuse
            print(f"skipped {kind} {shape} {variant} {blocks}: {error}")
            continue
        for target in for_targets:
            us = run.latency_us[target]
            if target not in best or us < best[target]["modeled_us"]:
                best[target] = dict(variant=variant, **blocks, modeled_us=round(us, 3))
    return best


def main(argv):
    """Tune the paper shapes and write the table: `python benchmarks/tuning.py [--models=...] [--out=...]`,
    or merge partial tables: `--merge=a.json,b.json`."""
    del argv
    import ml_dtypes
    from absl import flags

    fl = flags.FLAGS
    out = fl.out or TABLE_PATH
    entries = dict(load_table(out)) if os.path.exists(out) else {}
    if fl.merge:
        for part in fl.merge:
            entries.update(load_table(part))
        save_table(entries, out)
        print(f"merged {len(fl.merge)} tables into {out}: {len(entries)} entries")
        return
    dtype = np.dtype(ml_dtypes.bfloat16)
    jobs = paper_tuning_jobs(tuple(fl.models), tuple(int(t) for t in fl.tokens))
    for number, (kind, shape) in enumerate(jobs, 1):
        if fl.resume and all(table_key(kind, target, dtype, shape) in entries for target in TARGETS):
            continue
        for target, entry in tune(kind, shape, dtype).items():
            entries[table_key(kind, target, dtype, shape)] = entry
        save_table(entries, out)  # after every job, so an interrupted run keeps its progress
        print(f"[{number}/{len(jobs)}] {kind} {shape}", flush=True)


def define_flags():
    """The script's flags, defined only when it runs (tests import the tuner's functions)."""
    from absl import flags

    flags.DEFINE_list("models", list(PAPER_MLP_SHAPES), "models (keys of PAPER_MLP_SHAPES) to tune")
    flags.DEFINE_list("tokens", [str(t) for t in TUNED_TOKENS], "token counts to tune")
    flags.DEFINE_string("out", None, "table to write (default: the shipped block_table.json)")
    flags.DEFINE_list("merge", [], "partial tables to merge into --out instead of tuning")
    flags.DEFINE_bool("resume", False, "skip shapes --out already has entries for")
    _flag_checks.choice_list("models", lambda: PAPER_MLP_SHAPES)
    _flag_checks.int_list("tokens")
    flags.register_validator(
        "merge",
        lambda paths: all(os.path.isfile(path) for path in paths),
        "--merge: expected existing table files (comma-separated)",
    )
    flags.register_validator(
        "out", lambda path: path is None or not os.path.isdir(path), "--out: expected a file path, got a directory"
    )


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
