"""Block sizes per shape: an SBUF/PSUM footprint model, a tuner that searches the cost model, the shipped table.

Kinds of kernel tuned (shape = (T, K, r, N) in each kind's own terms):
  "svd_matmul"       x [T, K] · u [K, r] · v [r, N]; variants "rows" (svd_matmul_kernel) and "decode"
                     (svd_matmul_decode_kernel)
  "svd_mlp_gate_up"  x [T, H=K], gate/up factors of rank r, intermediate I=N; variant "cols"
  "svd_mlp_down"     hT [I=K, T], down factors of rank r, hidden H=N; variant "rows" (transposed input)
The tuner runs each candidate on the emulator in count-only mode, reads the modeled latency per target from
the profile, and keeps the fastest candidate that the footprint model says fits the target. `lookup` answers
from the shipped table (`block_table.json`, written by `python -m nki_kernels.tuning`) and otherwise from a
footprint-checked default.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile

import numpy as np

KINDS = ("svd_matmul", "svd_mlp_gate_up", "svd_mlp_down")
VARIANTS = {"svd_matmul": ("rows", "decode"), "svd_mlp_gate_up": ("cols",), "svd_mlp_down": ("rows",)}
TARGETS = ("trn1", "trn2")
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "block_table.json")

# Hardware sizes the footprint model uses (NKI docs: nl.tile_size; SBUF 192 KiB / 224 KiB per partition on
# trn1 / trn2; PSUM 8 banks of 2 KiB per partition).
PMAX = 128
MOVING_FMAX = 512
SBUF_BYTES = {"trn1": 192 * 1024, "trn2": 224 * 1024}
PSUM_BANKS = 8

# Candidate block sizes searched (elements; multiples of 128). Token blocks only matter above 512 tokens;
# smaller ones are a fallback for shapes where nothing else fits.
BLOCK_T = (512, 1024, 2048)
BLOCK_T_FALLBACK = (256, 128)
BLOCK_K = (256, 512, 1024, 2048)
BLOCK_N = (1024, 2048, 4096)
DECODE_MAX_TOKENS = 128  # the decode variant is tried only for T up to this
# Tokens the table is tuned at; lookup maps any T to the nearest of these (in log scale).
TUNED_TOKENS = (1, 16, 128, 512, 2048)
BLOCK_NAMES = ("block_t", "block_k", "block_n")


def _tiles(n, size=PMAX):
    return -(-n // size)


def sbuf_bytes(kind, variant, t, k, r, n, itemsize, block_t, block_k, block_n):
    """Peak SBUF bytes per partition the kernel keeps live (the emulator's liveness rule: a tensor lives until
    its last reference is dropped).

    Stage 1 holds the (XU)ᵀ strip(s), a float32 accumulator when K spans several blocks, and two K blocks
    (the current one and the next being loaded) of Xᵀ and full-width U rows, plus the next block's staged X
    rows. Stage 2 holds the strip(s), one V block per factor, and the output tiles.
    """
    tb = min(block_t, t)
    factors = 2 if kind == "svd_mlp_gate_up" else 1
    kb = _tiles(min(block_k, k))
    xu = _tiles(r) * tb * itemsize
    total = _tiles(r) * tb * 4 if k > block_k else 0
    k_block = kb * tb * itemsize + factors * kb * r * itemsize
    staged = 0 if (kind == "svd_mlp_down" and tb > 1) else _tiles(tb) * min(block_k, k) * itemsize
    stage1 = factors * (xu + total) + 2 * k_block + staged
    v_block = _tiles(r) * min(block_n, n) * itemsize
    if kind == "svd_mlp_gate_up":
        # hᵀ block (block_n features in the k_slots layout), the activation tile, a single token's row.
        out_tiles = (_tiles(min(block_n, n)) * tb * itemsize + min(tb, MOVING_FMAX) * 4
                     + (min(block_n, n) * itemsize if tb == 1 else 0))
    elif variant == "rows":
        out_tiles = min(block_n, n) * itemsize
    elif variant == "decode":
        out_tiles = _tiles(tb) * min(block_n, n) * itemsize + tb * itemsize
    else:
        out_tiles = tb * itemsize + (min(block_n, n) * itemsize if tb == 1 else 0)
    stage2 = factors * (xu + v_block) + out_tiles
    return max(stage1, stage2)


def psum_banks(kind, variant, t, k, r, n, block_t, block_k, block_n):
    """Peak PSUM banks live at once: stage 1 groups its rank tiles to fit beside one transpose tile; stage 2
    holds one accumulator per 512 columns (rows) or per ≤512-token chunk and factor (cols)."""
    tb = min(block_t, t)
    chunks = _tiles(tb, MOVING_FMAX)
    stage1 = max(1, (PSUM_BANKS - 1) // chunks) * chunks + 1
    if kind == "svd_mlp_gate_up":
        return max(stage1, 2 * chunks + (1 if tb == 1 else 0))
    if variant == "rows":
        return max(stage1, _tiles(min(block_n, n), MOVING_FMAX))
    return max(stage1, chunks + 1)


def fits(kind, variant, shape, itemsize, blocks, target):
    t, k, r, n = shape
    return (sbuf_bytes(kind, variant, t, k, r, n, itemsize, **blocks) <= SBUF_BYTES[target]
            and psum_banks(kind, variant, t, k, r, n, **blocks) <= PSUM_BANKS)


def candidates(kind, shape, itemsize, target):
    """(variant, blocks) pairs worth measuring for `shape` on `target`, all passing the footprint filter."""
    t, k, r, n = shape
    # Every block_t ≥ T gives the same kernel; keep the smallest such one.
    block_ts = [b for b in BLOCK_T if b < t] + [b for b in BLOCK_T if b >= t][:1]
    variants = [v for v in VARIANTS[kind] if v != "decode" or t <= DECODE_MAX_TOKENS]
    block_ks = [b for b in BLOCK_K if b < k] + [b for b in BLOCK_K if b >= k][:1]
    block_ns = [b for b in BLOCK_N if b < n] + [b for b in BLOCK_N if b >= n][:1]
    for fallback in ((),) + tuple((b,) for b in BLOCK_T_FALLBACK):
        found = [(variant, dict(block_t=block_t, block_k=block_k, block_n=block_n))
                 for variant in variants for block_t in (fallback or block_ts)
                 for block_k in block_ks for block_n in block_ns]
        found = [(v, b) for v, b in found if fits(kind, v, shape, itemsize, b, target)]
        if found:
            return found
    return []


def default_blocks(kind, variant, shape, itemsize, target):
    """Blocks for a shape the table lacks: the largest that fit, preferring a long token block (fewer weight
    re-reads), then long K blocks, then long N blocks; 512 / 1024 / 2048 at most."""
    for block_t in (512, 256, 128):
        for block_k in (1024, 512, 256, 128):
            for block_n in (2048, 1024, 512, 256, 128):
                blocks = dict(block_t=block_t, block_k=block_k, block_n=block_n)
                if fits(kind, variant, shape, itemsize, blocks, target):
                    return blocks
    raise ValueError(f"{kind} {shape}: no block sizes fit {target}'s SBUF; the shape is too large for one kernel "
                     f"(K = {shape[1]}, r = {shape[2]})")


def _kernel_and_operands(kind, variant, shape, dtype):
    from nki_kernels import svd_matmul, svd_mlp  # the kernels import the binding; keep lookup import-light

    t, k, r, n = shape
    zeros = functools.partial(np.zeros, dtype=dtype)
    if kind == "svd_matmul":
        kernel = svd_matmul.svd_matmul_decode_kernel if variant == "decode" else svd_matmul.svd_matmul_kernel
        return kernel, (zeros((t, k)), zeros((k, r)), zeros((r, n)))
    if kind == "svd_mlp_gate_up":
        return svd_mlp.svd_mlp_gate_up_kernel, (zeros((t, k)), zeros((k, r)), zeros((r, n)), zeros((k, r)),
                                               zeros((r, n)))
    return svd_mlp.svd_mlp_down_kernel, (zeros((k, t)), zeros((k, r)), zeros((r, n)))


def measure(kind, variant, shape, dtype, blocks):
    """The profile's RunSummary of one count-only run of the kernel (modeled µs per target in .latency_us)."""
    from nki_kernels import emulator

    kernel, operands = _kernel_and_operands(kind, variant, shape, dtype)
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
    from nki_kernels.emulator import NkiHardwareError

    best = {}
    for (variant, blocks_items), for_targets in admitted.items():
        blocks = dict(blocks_items)
        try:
            run = measure(kind, variant, shape, dtype, blocks)
        except NkiHardwareError as error:  # the footprint model let through what the hardware rules refuse
            print(f"skipped {kind} {shape} {variant} {blocks}: {error}")
            continue
        for target in for_targets:
            us = run.latency_us[target]
            if target not in best or us < best[target]["modeled_us"]:
                best[target] = dict(variant=variant, **blocks, modeled_us=round(us, 3))
    return best


def table_key(kind, target, dtype, shape):
    t, k, r, n = shape
    return f"{kind}|{target}|{np.dtype(dtype).name}|T={t}|K={k}|r={r}|N={n}"


@functools.lru_cache(maxsize=None)
def load_table(path=TABLE_PATH):
    """The tuned table: {key: entry}. Missing file → empty table (lookup falls back to defaults)."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)["entries"]


def save_table(entries, path=TABLE_PATH):
    """Write the table atomically (temp file in the same folder, then os.replace)."""
    payload = {"about": "Block sizes tuned on the emulator's cost model by nki_kernels.tuning; "
                        "keys kind|target|dtype|T|K|r|N.",
               "entries": dict(sorted(entries.items()))}
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".block_table.", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    load_table.cache_clear()


def nearest_tuned_tokens(t):
    return min(TUNED_TOKENS, key=lambda tuned: abs(math.log(tuned) - math.log(max(t, 1))))


def lookup(kind, t, k, r, n, dtype, target="trn1", path=TABLE_PATH):
    """{"variant", "block_t", "block_k", "block_n"} for a shape: the table's entry for (K, r, N) at the tuned
    token count nearest T when it fits this T, else a footprint-checked default."""
    if kind not in KINDS:
        raise ValueError(f"kind: got {kind!r}, expected one of {KINDS}")
    if target not in TARGETS:
        raise ValueError(f"target: got {target!r}, expected one of {TARGETS}")
    for name, value in (("T", t), ("K", k), ("r", r), ("N", n)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: got {value!r}, expected a positive integer")
    itemsize = np.dtype(dtype).itemsize
    shape = (int(t), int(k), int(r), int(n))
    entry = load_table(path).get(table_key(kind, target, dtype, (nearest_tuned_tokens(t), k, r, n)))
    if entry is not None:
        variant = entry["variant"]
        blocks = {name: entry[name] for name in BLOCK_NAMES}
        if (variant != "decode" or t <= DECODE_MAX_TOKENS) and fits(kind, variant, shape, itemsize, blocks, target):
            return dict(variant=variant, **blocks)
    variant = VARIANTS[kind][0]
    return dict(variant=variant, **default_blocks(kind, variant, shape, itemsize, target))


# MLP shapes (hidden H, intermediate I) of the models NeuronMM evaluates, and the kept-parameter ratio.
PAPER_MLP_SHAPES = {
    "Llama-3.2-1B": (2048, 8192),
    "Llama-3.2-3B": (3072, 8192),
    "Qwen3-1.7B": (2048, 6144),
    "Qwen3-4B": (2560, 9728),
    "Llama-3.1-8B": (4096, 14336),
}
PAPER_KEEP = 0.8


def block_aligned_rank(k, n, keep, block=PMAX):
    """round(k·n·keep / ((k+n)·block))·block: the rank keeping a fraction `keep` of a k×n layer's parameters."""
    return max(block, round(k * n * keep / ((k + n) * block)) * block)


def paper_tuning_jobs(models=tuple(PAPER_MLP_SHAPES), tokens=TUNED_TOKENS):
    """(kind, shape) pairs of the shipped table: per model and T, the up/gate and down projections as fused
    matmuls and the two MLP kernels."""
    jobs = []
    for model in models:
        h, i = PAPER_MLP_SHAPES[model]
        r = block_aligned_rank(h, i, PAPER_KEEP)
        for t in tokens:
            jobs += [("svd_matmul", (t, h, r, i)), ("svd_matmul", (t, i, r, h)),
                     ("svd_mlp_gate_up", (t, h, r, i)), ("svd_mlp_down", (t, i, r, h))]
    return jobs


def main(argv):
    """Tune the paper shapes and write the table: `python -m nki_kernels.tuning [--models=...] [--out=...]`,
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


def _define_flags():
    from absl import flags

    flags.DEFINE_list("models", list(PAPER_MLP_SHAPES), "models (keys of PAPER_MLP_SHAPES) to tune")
    flags.DEFINE_list("tokens", [str(t) for t in TUNED_TOKENS], "token counts to tune")
    flags.DEFINE_string("out", None, "table to write (default: the shipped block_table.json)")
    flags.DEFINE_list("merge", [], "partial tables to merge into --out instead of tuning")
    flags.DEFINE_bool("resume", False, "skip shapes --out already has entries for")


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
