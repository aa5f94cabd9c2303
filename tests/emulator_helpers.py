"""Kernels, inputs and checks shared by the emulator tests (a helper module, not a test file)."""

import os

import numpy as np
import pytest

from nki_kernels.binding import nisa, nki, nl
from nki_kernels.emulator import NkiHardwareError


def rand(shape, dtype=np.float32, seed=0):
    """Standard-normal values of `shape` in `dtype`, the same for the same seed."""
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def hardware_error_check(test_file):
    """raises(instruction, kernel, *args, **kwargs) -> message for kernels written in `test_file` (its __file__).

    raises() runs kernel(*args, **kwargs), which must raise NkiHardwareError naming `instruction` and a line of
    `test_file` (where the offending call is written), and returns the error message for further checks.
    """
    here = os.path.basename(test_file) + ":"

    def raises(instruction, kernel, *args, **kwargs):
        with pytest.raises(NkiHardwareError) as info:
            kernel(*args, **kwargs)
        message = str(info.value)
        assert instruction in message and here in message, message
        return message

    return raises


@nki.jit
def blocked_matmul(lhs_t, rhs):
    """out[M, N] = lhs_t[K, M].T @ rhs[K, N] in lhs_t's dtype, fp32 PSUM accumulation.

    The plainest tiling (nl.tile_size tiles, ragged edges by min(...) slicing): every (m, n) output tile loads
    its lhs_t and rhs strips once per k tile, accumulates them in one PSUM tile, and is evicted and stored
    once, so tests can count its instructions and DMA bytes by hand.
    """
    k_total, m_total = lhs_t.shape
    _, n_total = rhs.shape
    tk, tm, tn = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax
    out = nl.ndarray((m_total, n_total), lhs_t.dtype, buffer=nl.shared_hbm)
    for m in range(0, m_total, tm):
        mt = min(tm, m_total - m)
        for n in range(0, n_total, tn):
            nt = min(tn, n_total - n)
            acc = nl.ndarray((mt, nt), nl.float32, buffer=nl.psum)
            for k in range(0, k_total, tk):
                kt = min(tk, k_total - k)
                a = nl.ndarray((kt, mt), lhs_t.dtype, buffer=nl.sbuf)
                b = nl.ndarray((kt, nt), rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(a, lhs_t[k : k + kt, m : m + mt])
                nisa.dma_copy(b, rhs[k : k + kt, n : n + nt])
                nisa.nc_matmul(acc, a, b)
            result = nl.ndarray((mt, nt), out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(result, acc)
            nisa.dma_copy(out[m : m + mt, n : n + nt], result)
    return out


def run_tiles(body, inputs, outputs, target=None):
    """Run body(*input_tiles, *output_tiles) in a kernel on SBUF copies of `inputs` (numpy arrays, partition dim
    first) and return the `outputs` tiles ((shape, dtype) pairs, allocated in SBUF) as numpy arrays.

    A one-instruction test harness: the body issues the instructions under test; loads and stores are DMAs.
    """
    from nki_kernels import emulator

    @nki.jit
    def kernel(*arrays):
        tiles = []
        for array in arrays:
            tile = nl.ndarray(array.shape, array.dtype, buffer=nl.sbuf)
            nisa.dma_copy(tile, array)
            tiles.append(tile)
        results = [nl.ndarray(shape, dtype, buffer=nl.sbuf) for shape, dtype in outputs]
        body(*tiles, *results)
        stored = []
        for tile in results:
            out = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(out, tile)
            stored.append(out)
        return tuple(stored)

    if target is None:
        return kernel(*inputs)
    with emulator.use_target(target):
        return kernel(*inputs)


def sliding_window_case(rng, s, b, t, w, window):
    """(mask bias [B, T, S] float32, outside [S] bool) for a decode step writing slots w..w+T-1 of an S-slot cache:
    each query sees the `window` slots up to its own over left-padded rows (row b's first pad_b <= w slots hold no
    token, so rows sit at different positions); `outside` marks the slots a sliding-window kernel must not read
    (its span of min(S, window + T - 1) slots, clamped into the cache, is False)."""
    slot = np.arange(s)
    query = (w + np.arange(t))[None, :, None]
    pad = rng.integers(0, min(w, 3) + 1, size=(b, 1, 1))
    visible = (slot <= query) & (slot > query - window) & (slot >= pad)
    span = min(s, window + t - 1)
    start = min(max(w + t - span, 0), s - span)
    outside = np.ones(s, dtype=bool)
    outside[start : start + span] = False
    return np.where(visible, 0.0, np.finfo(np.float32).min).astype(np.float32), outside
