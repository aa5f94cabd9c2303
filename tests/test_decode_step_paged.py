"""decode_step on a paged KV cache (spec.block_size): the XLA lowering and the emulator's looped kernel compute the
float64 reference's logits and pools, each row at its own position, over consecutive steps that feed each step's
pools to the next; fp8 weights; concrete and traced lengths / block tables out of range are rejected on both
backends.

Operands as tests/decode_operands.py's paged_operands makes them (ragged rows, scattered and shared blocks, an
inactive row), given to JAX as jnp arrays, fp8 values as float8_e4m3fn.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from decode_operands import BF16, GEMMA3, GEMMA3_8, LLAMA, WINDOW, fp8_weight, paged_operands, relative_error

import jax_neuronmm
from jax_neuronmm import decode_step
from nki_kernels.decode import Factored, Quantized, reference
from nki_kernels.decode.contract import WEIGHTS

WEIGHT_INDEX = {name: 3 + i for i, name in enumerate(WEIGHTS[:-1])} | {"head": 17}


def _jax_operands(operands, spec):
    """Kernel-test operands as decode_step takes them: jnp arrays, stored weights as Factored (stacked to the
    largest rank) / Quantized, fp8 values as float8_e4m3fn."""
    names = {i: name for name, i in WEIGHT_INDEX.items()}
    out = []
    for i, op in enumerate(operands):
        if isinstance(op, list):
            parts = [jnp.asarray(p.view(ml_dtypes.float8_e4m3fn) if p.dtype.itemsize == 1 else p) for p in op]
            if spec.factored(names[i]):
                rank = spec.stacked_rank(names[i])
                u, v, *scales = parts
                scales = [scales[0][..., :rank], scales[1]] if scales else [None, None]
                op = Factored(u[..., :rank], v[..., :rank, :], *scales)
            else:
                op = Quantized(*parts)
        elif op is not None:
            op = jnp.asarray(op)
        out.append(op)
    return out


def _step(spec):
    return jax.jit(lambda *operands: decode_step(*operands, spec=spec))


def _advance(operands, lengths, rng, spec):
    """The next step's operands: fresh x and RoPE tables, each active row one position further, the masks moved."""
    nxt = list(operands)
    b = len(lengths)
    nxt[0] = rng.standard_normal(operands[0].shape).astype(operands[0].dtype)
    angles = rng.uniform(0, 2 * np.pi, operands[13].shape[:-1] + (spec.head_dim // 2,))
    angles = np.concatenate([angles, angles], axis=-1)
    nxt[13], nxt[14] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    lengths = np.where(lengths >= 0, lengths + 1, -1).astype(np.int32)
    slots = np.arange(operands[15].shape[-1])
    position = np.maximum(lengths, 0)[:, None]
    masks = np.broadcast_to((slots[None, :] <= position)[None, :, None, :], (spec.num_masks, b, 1, slots.size)).copy()
    if spec.num_masks > 1:
        masks[1] &= (slots[None, :] > position - WINDOW)[:, None, :]
    nxt[15] = np.where(masks, 0.0, np.finfo(np.float32).min).astype(np.float32)
    nxt[20] = lengths
    return nxt


def test_both_backends_equal_the_float64_reference_over_steps(rng):
    """Three steps of a Gemma-3-like model with sliding windows, 5-slot blocks: rows at different positions (one
    opening a block at the second step), two sharing a prefix block, one inactive; each backend's pools go on to its
    next step, and every step's logits and pools equal the reference's from the same pools."""
    spec = GEMMA3.replace(block_size=5, mask_windows=(None, WINDOW))
    operands, _ = paged_operands(rng, spec, [13, 9, -1, 30], 8, 40, np.float32, shared=1)
    step = _step(spec)
    pools = {"xla": operands[10:12], "emulator": operands[10:12]}
    active = [0, 1, 3]
    for _ in range(3):
        for backend in pools:
            ops = operands[:10] + list(pools[backend]) + operands[12:]
            want_logits, *want_pools = reference.decode_step_f64(ops, spec)
            with jax_neuronmm.use_backend(backend):
                logits, *got = jax.block_until_ready(step(*_jax_operands(ops, spec)))
            assert relative_error(np.asarray(logits)[active], want_logits[active]) < 1e-5
            for pool, want in zip(got, want_pools):
                assert relative_error(pool, want) < 1e-6
            pools[backend] = [np.asarray(pool) for pool in got]
        operands = _advance(operands, operands[20], rng, spec)


def test_fp8_weights_on_both_backends(rng):
    spec = GEMMA3_8.replace(block_size=12, mask_windows=(None, WINDOW))
    operands, _ = paged_operands(rng, spec, [25, 12, 3], 4, 16, BF16, shared=1)
    for name in spec.fp8_weights:
        ranks = spec.ranks[WEIGHTS.index(name)] if name != "head" else None
        operands[WEIGHT_INDEX[name]] = fp8_weight(rng, operands[WEIGHT_INDEX[name]], ranks, name)
    want_logits, *want_pools = reference.decode_step_f64(operands, spec)
    for backend in ("xla", "emulator"):
        with jax_neuronmm.use_backend(backend):
            logits, *pools = jax.block_until_ready(_step(spec)(*_jax_operands(operands, spec)))
        assert relative_error(logits, want_logits) < 3e-2
        for pool, want in zip(pools, want_pools):
            assert relative_error(np.asarray(pool).astype(np.float32), want) < 2e-2


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda ops: ops[20].__setitem__(0, 20), r"lengths: got lengths\[0\] = 20"),
        (lambda ops: ops[19].__setitem__((1, 2), 12), r"block_table: got block_table\[1, 2\] = 12"),
    ],
)
@pytest.mark.parametrize("backend", ["xla", "emulator"])
def test_out_of_range_values_are_rejected_on_both_backends(rng, change, message, backend):
    spec = LLAMA.replace(block_size=5)
    operands, _ = paged_operands(rng, spec, [3, 7, 0], 4, 12, np.float32)
    change(operands)
    args = _jax_operands(operands, spec)
    with jax_neuronmm.use_backend(backend):
        with pytest.raises(ValueError, match=message):  # concrete: at the call
            decode_step(*args, spec=spec)
        with pytest.raises(Exception, match=message):  # traced: when the step runs
            jax.block_until_ready(_step(spec)(*args))
