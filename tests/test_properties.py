"""Property tests (hypothesis) of shapes and ranks: svd_matmul's output shape and values over random layouts,
block_aligned_rank's guarantees, and save_compressed / load_compressed round trips of random trees."""

import os
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_neuronmm as jn
from jax_neuronmm.compress import block_aligned_rank, load_compressed, save_compressed
from jax_neuronmm.compress import tree as compress_tree

dims = st.integers(1, 300)


@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), max_size=2),
    k=dims,
    r=dims,
    n=dims,
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
)
def test_svd_matmul_output_shape(lead, k, r, n, dtype):
    x = jax.ShapeDtypeStruct((*lead, k), dtype)
    out = jax.eval_shape(jn.svd_matmul, x, jax.ShapeDtypeStruct((k, r), dtype), jax.ShapeDtypeStruct((r, n), dtype))
    assert out.shape == (*lead, n) and out.dtype == dtype


@settings(max_examples=40, deadline=None)
@given(k=dims, r=dims, n=dims, wrong=st.integers(1, 300))
def test_svd_matmul_rejects_mismatched_factors_at_trace_time(k, r, n, wrong):
    x = jax.ShapeDtypeStruct((3, k), jnp.float32)
    if wrong != k:
        try:
            jax.eval_shape(
                jn.svd_matmul,
                x,
                jax.ShapeDtypeStruct((wrong, r), jnp.float32),
                jax.ShapeDtypeStruct((r, n), jnp.float32),
            )
        except ValueError as error:
            assert "svd_matmul: u has shape" in str(error)
        else:
            raise AssertionError("mismatched K accepted")
    if wrong != r:
        try:
            jax.eval_shape(
                jn.svd_matmul,
                x,
                jax.ShapeDtypeStruct((k, r), jnp.float32),
                jax.ShapeDtypeStruct((wrong, n), jnp.float32),
            )
        except ValueError as error:
            assert "svd_matmul: v has shape" in str(error)
        else:
            raise AssertionError("mismatched rank accepted")


@settings(max_examples=12, deadline=None)
@given(
    tokens=st.sampled_from([1, 7, 130]),
    k=st.sampled_from([100, 200]),
    r=st.sampled_from([1, 13, 130]),
    n=st.sampled_from([9, 1000]),
    seed=st.integers(0, 2**31 - 1),
)
def test_svd_matmul_values_match_float64(tokens, k, r, n, seed):
    rng = np.random.default_rng(seed)
    x, u, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((tokens, k), (k, r), (r, n)))
    got = np.asarray(jax.jit(jn.svd_matmul)(x, u, v), np.float64)
    want = (x.astype(np.float64) @ u.astype(np.float64)) @ v.astype(np.float64)
    assert got.shape == (tokens, n)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k * r))


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 20000), n=st.integers(1, 20000), keep=st.floats(1e-3, 1.0), block=st.sampled_from([1, 16, 128]))
def test_block_aligned_rank_guarantees(k, n, keep, block):
    rank = block_aligned_rank(k, n, keep, block)
    assert isinstance(rank, int) and 1 <= rank <= min(k, n)
    break_even = k * n / (k + n)
    if break_even >= 1:  # some rank saves parameters: the factors never hold more than the dense kernel
        assert rank * (k + n) <= k * n
    budget = k * n * keep / (k + n)
    if budget >= block and break_even >= block:  # aligned to the PE tiles, within one block of the budget
        assert rank % block == 0 and abs(rank - budget) <= block


_dtypes = st.sampled_from([np.float32, ml_dtypes.bfloat16, np.int32, np.float16])
_names = st.text("abcdefgh_", min_size=1, max_size=6)


@st.composite
def _trees(draw):
    """{name: array or {"u": [.., K, r], "v": [.., r, N]} or nested dict} with random shapes and dtypes."""
    tree, ranks = {}, {}
    for name in draw(st.lists(_names, min_size=1, max_size=4, unique=True)):
        kind = draw(st.sampled_from(["leaf", "factors", "nested"]))
        rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
        if kind == "leaf":  # 0-d included: they used to come back as shape (1,)
            shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
            tree[name] = np.asarray(rng.standard_normal(shape) * 10).astype(draw(_dtypes))
        elif kind == "factors":
            lead = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
            k, r, n = (draw(st.integers(1, 9)) for _ in range(3))
            dtype = draw(_dtypes)
            tree[name] = {
                "u": rng.standard_normal((*lead, k, r)).astype(dtype),
                "v": rng.standard_normal((*lead, r, n)).astype(dtype),
            }
            ranks[name] = r
        else:
            tree[name] = {
                "layers": [
                    rng.standard_normal(draw(st.integers(1, 4))).astype(np.float32)
                    for _ in range(draw(st.integers(1, 3)))
                ]
            }
    return tree, ranks


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_trees())
def test_checkpoint_round_trip(case):
    tree, ranks = case
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.safetensors")
        save_compressed(path, tree)
        loaded, info = load_compressed(path)
        assert os.listdir(directory) == ["model.safetensors"]
    assert info.ranks == ranks and info.method == "none"
    flat_saved, flat_loaded = dict(compress_tree.iter_leaves(tree)), dict(compress_tree.iter_leaves(loaded))
    assert flat_saved.keys() == flat_loaded.keys()
    for key, array in flat_saved.items():
        assert flat_loaded[key].dtype == array.dtype and flat_loaded[key].shape == array.shape
        np.testing.assert_array_equal(flat_loaded[key], array)
