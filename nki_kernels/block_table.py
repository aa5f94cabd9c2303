"""The shipped table of tuned block sizes (`block_table.json`) and `lookup`, what dispatch asks per shape.

Kinds of kernel in the table (shape = (T, K, r, N) in each kind's own terms):
  "svd_matmul"       x [T, K] · u [K, r] · v [r, N]; variants "rows" (svd_matmul_kernel) and "decode"
                     (svd_matmul_decode_kernel)
  "svd_mlp_gate_up"  x [T, H=K], gate/up factors of rank r, intermediate I=N; variant "cols"
  "svd_mlp_down"     hT [I=K, T], down factors of rank r, hidden H=N; variant "rows" (transposed input)
Entries are written by the tuner (`python benchmarks/tuning.py`); a shape the table lacks gets a
footprint-checked default.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile

import numpy as np

from nki_kernels.footprint import fits
from nki_kernels.hardware import check_target

KINDS = ("svd_matmul", "svd_mlp_gate_up", "svd_mlp_down")
KERNEL_VARIANTS = {"svd_matmul": ("rows", "decode"), "svd_mlp_gate_up": ("cols",), "svd_mlp_down": ("rows",)}
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "block_table.json")
DECODE_MAX_TOKENS = 128  # the decode variant is tried only for T up to this
# Tokens the table is tuned at; lookup maps any T to the nearest of these (in log scale).
TUNED_TOKENS = (1, 16, 128, 512, 2048)
BLOCK_NAMES = ("block_t", "block_k", "block_n")


def default_blocks(kind, variant, shape, itemsize, target, weight_itemsize=None):
    """Blocks for a shape the table lacks: the largest that fit, preferring a long token block (fewer weight
    re-reads), then long K blocks, then long N blocks; 512 / 1024 / 2048 at most. weight_itemsize: 1 for
    fp8 factors (footprint.sbuf_bytes)."""
    for block_t in (512, 256, 128):
        for block_k in (1024, 512, 256, 128):
            for block_n in (2048, 1024, 512, 256, 128):
                blocks = dict(block_t=block_t, block_k=block_k, block_n=block_n)
                if fits(kind, variant, shape, itemsize, blocks, target, weight_itemsize):
                    return blocks
    raise ValueError(
        f"{kind} {shape}: no block sizes fit {target}'s SBUF; the shape is too large for one kernel "
        f"(K = {shape[1]}, r = {shape[2]})"
    )


def table_key(kind, target, dtype, shape):
    t, k, r, n = shape
    return f"{kind}|{target}|{np.dtype(dtype).name}|T={t}|K={k}|r={r}|N={n}"


@functools.cache
def load_table(path=TABLE_PATH):
    """The tuned table: {key: entry}. Missing file → empty table (lookup falls back to defaults)."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)["entries"]


def save_table(entries, path=TABLE_PATH):
    """Write the table atomically (temp file in the same folder, then os.replace)."""
    payload = {
        "about": "Block sizes tuned on the emulator's cost model by benchmarks/tuning.py; "
        "keys kind|target|dtype|T|K|r|N.",
        "entries": dict(sorted(entries.items())),
    }
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


def lookup(kind, t, k, r, n, dtype, target="trn1", path=TABLE_PATH, weight_dtype=None):
    """{"variant", "block_t", "block_k", "block_n"} for a shape: the table's entry for (K, r, N) at the tuned
    token count nearest T when it fits this T, else a footprint-checked default.

    weight_dtype: None (factors in `dtype`), or float8_e4m3 for fp8 factors with scales: the entry tuned for
    `dtype` is used when it fits with fp8 weights and their scales (the table is tuned per activation dtype).
    """
    if kind not in KINDS:
        raise ValueError(f"kind: got {kind!r}, expected one of {KINDS}")
    check_target(target)
    for name, value in (("T", t), ("K", k), ("r", r), ("N", n)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: got {value!r}, expected a positive integer")
    itemsize = np.dtype(dtype).itemsize
    weight_itemsize = None if weight_dtype is None else np.dtype(weight_dtype).itemsize
    shape = (int(t), int(k), int(r), int(n))
    entry = load_table(path).get(table_key(kind, target, dtype, (nearest_tuned_tokens(t), k, r, n)))
    if entry is not None:
        variant = entry["variant"]
        blocks = {name: entry[name] for name in BLOCK_NAMES}
        if (variant != "decode" or t <= DECODE_MAX_TOKENS) and fits(
            kind, variant, shape, itemsize, blocks, target, weight_itemsize
        ):
            return dict(variant=variant, **blocks)
    variant = KERNEL_VARIANTS[kind][0]
    return dict(variant=variant, **default_blocks(kind, variant, shape, itemsize, target, weight_itemsize))
