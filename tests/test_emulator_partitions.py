"""Partition placement of compute-engine operands (architecture guide, "Accessing SBUF/PSUM tensors using compute
engines" and "Cross-Partition Connectivity"): a tile occupies consecutive partitions and starts at 0 (over 64
partitions), 0 or 64 (33 to 64) or 0, 32, 64 or 96 (1 to 32); source and destination may sit in different
quadrants or halves. Each rule has violating kernels (the error names the instruction and this file's line) and
conforming ones checked against numpy. DMA is not bound by these rules."""

import numpy as np
import pytest
from emulator_helpers import hardware_error_check, rand

from nki_kernels.binding import nisa, nki, nl

_raises = hardware_error_check(__file__)


@nki.jit
def _copy_partitions(x, src_start, dst_start, count):
    """out = x[src_start:src_start + count], moved on chip by a VectorE tensor_copy into partitions
    [dst_start, dst_start + count) of a second tile."""
    free = x.shape[1]
    whole = nl.ndarray((128, free), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(whole, x)
    moved = nl.ndarray((128, free), x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(moved[dst_start : dst_start + count], whole[src_start : src_start + count])
    out = nl.ndarray((count, free), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, moved[dst_start : dst_start + count])
    return out


@pytest.mark.parametrize(
    "src_start, dst_start, count, operand, allowed",
    [
        (16, 0, 16, "src", "0, 32, 64 or 96"),  # 1..32 partitions off a quadrant boundary
        (0, 5, 1, "dst", "0, 32, 64 or 96"),  # even a single partition
        (32, 0, 64, "src", "0 or 64"),  # 33..64 partitions off a half boundary
        (0, 32, 33, "dst", "0 or 64"),
        (1, 0, 100, "src", "0"),  # over 64 partitions start at 0
    ],
)
def test_start_partition_depends_on_partition_count(src_start, dst_start, count, operand, allowed):
    x = rand((128, 24))
    message = _raises("tensor_copy", _copy_partitions, x, src_start, dst_start, count)
    start = src_start if operand == "src" else dst_start
    assert f"{operand} " in message and f"starts at partition {start};" in message, message
    assert f"a tile of {count} partitions must start at partition {allowed}" in message, message


@pytest.mark.parametrize(
    "src_start, dst_start, count",
    [
        (0, 0, 128),
        (0, 0, 65),
        (64, 64, 64),
        (0, 0, 37),
        (96, 96, 32),
        (32, 32, 7),
        (0, 96, 32),  # cross-quadrant movement: one-to-one, a different quadrant
        (64, 0, 64),  # cross-half movement
        (96, 32, 1),
    ],
)
def test_conforming_placements_and_cross_partition_moves(src_start, dst_start, count):
    x = rand((128, 24), seed=1)
    np.testing.assert_array_equal(_copy_partitions(x, src_start, dst_start, count), x[src_start : src_start + count])


@nki.jit
def _every_other_partition(x, by_dma):
    """out = x[0::2]: the even partitions of an SBUF tile, gathered by DMA or by a VectorE copy."""
    free = x.shape[1]
    whole = nl.ndarray((128, free), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(whole, x)
    even = nl.ndarray((64, free), x.dtype, buffer=nl.sbuf)
    if by_dma:
        nisa.dma_copy(even, whole[0:128:2])
    else:
        nisa.tensor_copy(even, whole[0:128:2])
    out = nl.ndarray((64, free), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, even)
    return out


def test_no_striding_along_the_partition_dimension():
    x = rand((128, 16), seed=2)
    message = _raises("tensor_copy", _every_other_partition, x, False)
    assert "no striding along the partition dimension" in message and "src" in message, message
    np.testing.assert_array_equal(_every_other_partition(x, True), x[0::2])


@nki.jit
def _matmul_from_partitions(lhs_t, rhs, start):
    """lhs_t.T @ rhs with both operands' contraction rows placed at partitions [start, start + K) of SBUF tiles."""
    k, m = lhs_t.shape
    n = rhs.shape[1]
    a = nl.ndarray((128, m), lhs_t.dtype, buffer=nl.sbuf)
    b = nl.ndarray((128, n), rhs.dtype, buffer=nl.sbuf)
    nisa.dma_copy(a[start : start + k], lhs_t)
    nisa.dma_copy(b[start : start + k], rhs)
    acc = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(acc, a[start : start + k], b[start : start + k])
    result = nl.ndarray((m, n), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(result, acc)
    out = nl.ndarray((m, n), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(out, result)
    return out


def test_tensor_engine_operands_follow_the_placement_rule():
    lhs_t, rhs = rand((32, 20), seed=3), rand((32, 40), seed=4)
    message = _raises("nc_matmul", _matmul_from_partitions, lhs_t, rhs, 16)
    assert "stationary" in message and "starts at partition 16" in message, message
    expected = lhs_t.astype(np.float64).T @ rhs.astype(np.float64)
    np.testing.assert_allclose(_matmul_from_partitions(lhs_t, rhs, 64), expected, rtol=1e-5, atol=1e-4)


@nki.jit
def _activation_with_bias_at(x, bias, bias_start):
    """out = exp(x + bias), bias a [P, 1] vector held at partitions [bias_start, bias_start + P) (ScalarE)."""
    p, free = x.shape
    data = nl.ndarray((p, free), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(data, x)
    vectors = nl.ndarray((128, 1), bias.dtype, buffer=nl.sbuf)
    nisa.dma_copy(vectors[bias_start : bias_start + p], bias)
    result = nl.ndarray((p, free), x.dtype, buffer=nl.sbuf)
    nisa.activation(result, nl.exp, data, bias=vectors[bias_start : bias_start + p])
    out = nl.ndarray((p, free), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, result)
    return out


def test_vector_operands_follow_the_placement_rule():
    x, bias = rand((32, 8), seed=5), rand((32, 1), seed=6)
    message = _raises("activation", _activation_with_bias_at, x, bias, 3)
    assert "bias" in message and "starts at partition 3" in message, message
    expected = np.exp(x.astype(np.float64) + bias)
    np.testing.assert_allclose(_activation_with_bias_at(x, bias, 96), expected, rtol=1e-5)


@nki.jit
def _language_add(x, y, start):
    """out = x + y through nl.add on tiles placed at partitions [start, start + P)."""
    p, free = x.shape
    a = nl.ndarray((128, free), x.dtype, buffer=nl.sbuf)
    b = nl.ndarray((128, free), y.dtype, buffer=nl.sbuf)
    nisa.dma_copy(a[start : start + p], x)
    nisa.dma_copy(b[start : start + p], y)
    total = nl.add(a[start : start + p], b[start : start + p])
    out = nl.ndarray((p, free), x.dtype, buffer=nl.shared_hbm)
    nl.store(out, total)
    return out


def test_language_ops_follow_the_placement_rule():
    x, y = rand((20, 12), seed=7), rand((20, 12), seed=8)
    assert "starts at partition 40" in _raises("nl.add", _language_add, x, y, 40)
    np.testing.assert_allclose(_language_add(x, y, 32), x.astype(np.float64) + y, rtol=1e-6)
