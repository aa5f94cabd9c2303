"""AWS nki-library ("nkilib") kernels run unmodified on the emulator, each against a float64 numpy reference.

Used by `benchmarks/aws_examples.py --nki_library=<checkout of aws-neuron/nki-library>`. The kernels are imported
from the checkout at run time (inside `nki_kernels.emulator.as_nki()`); nothing of theirs is copied here. Each
case is a small driver kernel (allocating the buffers a subkernel expects), the call, and the reference.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import traceback
from typing import Callable

import ml_dtypes
import numpy as np

from nki_kernels import emulator

BF16 = ml_dtypes.bfloat16


def _f64(x):
    return np.asarray(x, dtype=np.float64)


@dataclasses.dataclass
class LibraryCase:
    name: str
    run: Callable  # (import_fn, rng) -> (got, expected, rtol, atol)


def _rms_ref(x, gamma, eps):
    x = _f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(gamma).reshape(-1)


def _rmsnorm(load, rng):
    module = load("nkilib.core.subkernels.rmsnorm_tkg")
    nl, nisa = emulator.language, emulator.isa
    b, s, h, eps = 2, 3, 512, 1e-6
    x = rng.standard_normal((b, s, h)).astype(BF16)
    gamma = rng.standard_normal((1, h)).astype(BF16)

    @emulator.jit
    def driver(x, gamma):
        out_sb = nl.ndarray((128, b * s, h // 128), dtype=x.dtype, buffer=nl.sbuf)
        module.rmsnorm_tkg(x, gamma, out_sb, eps=eps)
        out = nl.ndarray((128, b * s, h // 128), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(out, out_sb)
        return out

    expected = _rms_ref(x, gamma, eps).reshape(b * s, 128, h // 128).transpose(1, 0, 2)
    return driver(x, gamma), expected, 2e-2, 2e-2


def _rope_ref(x, cos, sin):
    """x [d, B, n, S]; cos/sin [d/2, B, S]; contiguous halves: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    x, cos, sin = _f64(x), _f64(cos)[:, :, None, :], _f64(sin)[:, :, None, :]
    half = x.shape[0] // 2
    x1, x2 = x[:half], x[half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=0)


def _rope(load, rng):
    module = load("nkilib.core.embeddings.rope")
    d, b, n, s = 128, 2, 4, 5
    x = rng.standard_normal((d, b, n, s)).astype(BF16)
    angle = rng.uniform(0, 2 * np.pi, (d // 2, b, s))
    cos, sin = np.cos(angle).astype(BF16), np.sin(angle).astype(BF16)
    return module.RoPE(x, cos, sin), _rope_ref(x, cos, sin), 2e-2, 3e-2


def _cumsum(load, rng):
    module = load("nkilib.core.cumsum.cumsum")
    x = rng.standard_normal((130, 700)).astype(np.float32)
    return module.cumsum(x), np.cumsum(_f64(x), axis=-1), 1e-4, 1e-3


def _max(load, rng):
    module = load("nkilib.core.max.cascaded_max")
    x = rng.standard_normal((1, 1, 5000)).astype(np.float32)
    values, indices = module.cascaded_max(x)
    expected = (np.max(_f64(x), axis=-1, keepdims=True), np.argmax(x, axis=-1)[..., None].astype(np.float64))
    return (values, _f64(indices)), expected, 0, 0


CASES = [
    LibraryCase("RMSNorm (rmsnorm_tkg)", _rmsnorm),
    LibraryCase("RoPE", _rope),
    LibraryCase("cumsum", _cumsum),
    LibraryCase("max (cascaded_max)", _max),
]


def _compare(got, expected, rtol, atol):
    got = got if isinstance(got, (tuple, list)) else (got,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    if len(got) != len(expected):
        return f"{len(got)} outputs, expected {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        g = _f64(g)
        if g.shape != e.shape:
            return f"output {i} shape {g.shape}, expected {e.shape}"
        if not np.allclose(g, e, rtol=rtol, atol=atol):
            return f"output {i} differs: max |error| {np.nanmax(np.abs(g - e)):.3g}"
    return ""


def run_cases(checkout, cases=None, seed=0):
    """[(name, reason)] for each case: reason '' when it passes."""
    source = os.path.join(checkout, "src", "nkilib_src")
    if not os.path.isdir(os.path.join(source, "nkilib")):
        raise ValueError(f"--nki_library: {checkout!r} has no src/nkilib_src/nkilib folder")
    rng = np.random.default_rng(seed)
    results = []
    saved_path = list(sys.path)
    saved_modules = set(sys.modules)
    try:
        with emulator.as_nki():
            sys.path.insert(0, source)
            for case in cases or CASES:
                try:
                    got, expected, rtol, atol = case.run(importlib.import_module, rng)
                    results.append((case.name, _compare(got, expected, rtol, atol)))
                except Exception as error:  # noqa: BLE001 - every failure is reported with its place
                    frames = traceback.extract_tb(error.__traceback__)
                    frame = frames[-1]
                    results.append((case.name, f"{type(error).__name__}: {error} "
                                               f"(at {os.path.basename(frame.filename)}:{frame.lineno})"))
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if name == "nkilib" or name.startswith(("nkilib.", "nkilib_src")):
                del sys.modules[name]
    return results
