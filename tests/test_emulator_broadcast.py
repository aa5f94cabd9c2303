"""nl.broadcast_to across partitions: a TensorE matmul with a ones row into PSUM (arch guide, TensorE
"Alternative Use Case"), with numerics checked against numpy and the recorded engine and buffers."""

import numpy as np
import pytest

from nki_kernels.binding import nisa, nki, nl
from nki_kernels.emulator import profile, trace


def _broadcast_kernel(partitions):
    @nki.jit
    def kernel(row):
        r = nl.load(row)  # [1, F]
        wide = nl.broadcast_to(r, (partitions, row.shape[1]))
        staged = nl.ndarray(wide.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(staged, wide)
        out = nl.ndarray(wide.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, staged)
        return out

    return kernel


def _records(kernel, *args):
    runs = []
    trace.add_listener(runs.append)
    try:
        with profile():
            got = kernel(*args)
    finally:
        trace.remove_listener(runs.append)
    return got, runs[0].records


@pytest.mark.parametrize("partitions, free", [(7, 1), (130 - 2, 130), (128, 512), (100, 1000)])
def test_partition_broadcast_is_a_tensor_engine_matmul(partitions, free):
    row = np.random.default_rng(free).standard_normal((1, free)).astype(np.float32)
    got, records = _records(_broadcast_kernel(partitions), row)
    np.testing.assert_array_equal(
        np.asarray(got, np.float64), np.broadcast_to(row.astype(np.float64), (partitions, free))
    )
    (broadcast,) = [r for r in records if r.engine == "tensor"]
    assert broadcast.opcode == "nc_matmul"
    assert (broadcast.matmul.contraction, broadcast.matmul.stationary_free, broadcast.matmul.moving_free) == (
        1,
        partitions,
        free,
    )
    # Into PSUM when the tile fits one 2 KiB bank per partition, else into SBUF.
    assert broadcast.writes[0].buffer == ("psum" if free * 4 <= 2048 else "sbuf")
    assert not [r for r in records if r.engine == "vector" and r.opcode == "tensor_copy" and r.reads[0].p_stop == 1]


def test_free_dim_broadcast_stays_a_vector_copy():
    @nki.jit
    def kernel(col):
        c = nl.load(col)  # [P, 1]
        wide = nl.broadcast_to(c, (col.shape[0], 130))
        out = nl.ndarray(wide.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, wide)
        return out

    col = np.random.default_rng(3).standard_normal((7, 1)).astype(np.float32)
    got, records = _records(kernel, col)
    np.testing.assert_array_equal(np.asarray(got, np.float64), np.broadcast_to(col.astype(np.float64), (7, 130)))
    assert [r.engine for r in records if r.opcode == "tensor_copy"] == ["vector"]
