"""tensor_parallel_decode_step on a paged KV cache (spec.block_size): the pools split over their KV heads like a
contiguous cache's, every row at its own position; on 2 ranks of a mesh axis the XLA backend (Megatron shards, psums
inside shard_map) and the emulator backend (every rank's looped kernel in one emulated launch) equal the float64
reference; splitting a paged step's rows over a batch axis is refused.

Runs itself in a subprocess with 8 host devices, like test_sharding_spmd.py (see spmd_helpers).
"""

import jax
import numpy as np
from decode_operands import LLAMA, paged_operands, relative_error
from spmd_helpers import Checks, check_test, run_checks
from spmd_helpers import rng as _rng
from test_decode_step_paged import _jax_operands
from test_decode_step_tensor_parallel import _model_mesh

import jax_neuronmm as jn
from jax_neuronmm.decode_step_parallel import tensor_parallel_decode_step
from nki_kernels.decode import reference

CHECKS = Checks()
check = CHECKS.check
SPEC = LLAMA.replace(block_size=5)  # 2 KV heads: one a rank
LENGTHS = [13, 10, -1, 4]  # row 1 opens a block, row 2 inactive


@check
def paged_step_on_two_ranks_equals_float64_on_both_backends():
    operands, _ = paged_operands(_rng("paged_tp"), SPEC, LENGTHS, 4, 20, np.float32, shared=1)
    want_logits, want_k, want_v = reference.decode_step_f64(operands, SPEC)
    active = [row for row, p in enumerate(LENGTHS) if p >= 0]
    step = jax.jit(lambda *ops: tensor_parallel_decode_step(*ops, spec=SPEC, mesh=_model_mesh(2), axis_name="model"))
    for backend in ("xla", "emulator"):
        with jn.use_backend(backend):
            logits, k_pool, v_pool = jax.block_until_ready(step(*_jax_operands(operands, SPEC)))
        assert relative_error(np.asarray(logits)[active], want_logits[active]) < 1e-5, backend
        assert relative_error(k_pool, want_k) < 1e-6 and relative_error(v_pool, want_v) < 1e-6, backend


@check
def a_paged_steps_rows_do_not_split_over_a_batch_axis():
    operands, _ = paged_operands(_rng("paged_tp_batch"), SPEC, LENGTHS, 4, 20, np.float32)
    try:
        tensor_parallel_decode_step(
            *_jax_operands(operands, SPEC), spec=SPEC, mesh=_model_mesh(2, 2), axis_name="model", batch_axis="data"
        )
    except ValueError as error:
        assert "batch_axis: got 'data' with a paged cache" in str(error), error
    else:
        raise AssertionError("a batch axis over a paged step's rows was accepted")


test_tensor_parallel = check_test(CHECKS)


if __name__ == "__main__":
    run_checks(CHECKS)
