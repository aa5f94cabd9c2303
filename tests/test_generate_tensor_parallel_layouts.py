"""generate on a sharded model in any layout JAX runs gives one device's tokens (issue 50): the tensor-parallel
decode step where the layout is Megatron's, KV heads that do not split over the ranks repeated on the ranks that
share them (Gemma 3 270M's single KV head on 4 ranks; only the MLP split, attention whole, on an Explicit mesh);
other layouts decode through the model's own forward, saying why (`decode.tensor_parallel_fallback_reason`).

Runs itself in a subprocess with 8 host devices (see spmd_helpers), like test_decode_step_tensor_parallel.py, whose
models, meshes and layouts it shares.
"""

import re

from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from spmd_helpers import Checks, check_test, run_checks
from test_decode_step_tensor_parallel import (
    MEGATRON,
    MLP_ONLY,
    _assert_generate_on_mesh,
    _model,
    _model_mesh,
    _shard_megatron,
)

from jax_neuronmm.models import decode

CHECKS = Checks()
check = CHECKS.check
EXPLICIT = (AxisType.Explicit, AxisType.Explicit)


@check
def generate_with_only_the_mlp_split_replicates_kv_heads_on_an_explicit_mesh():
    # The layout of issue 50: the MLP factors split over "model" (4 ranks), attention whole; the model's 1 KV head
    # (Gemma 3 270M's) does not split over 4 ranks, so the decode step gives each rank a copy of it.
    plan = _assert_generate_on_mesh("gemma3-1kv-compressed", _model_mesh(4, data=2, axis_types=EXPLICIT), MLP_ONLY)
    assert (plan.spec.num_heads, plan.spec.num_kv_heads) == (4, 4)


@check
def generate_replicates_one_kv_head_over_4_ranks():
    # Attention split too: each rank one query head and its copy of the KV head. On Explicit axes the prefill's
    # k / v projections (32 columns over 4 ranks) become whole before they split into heads.
    plan = _assert_generate_on_mesh("gemma3-1kv-compressed", _model_mesh(4, data=2, axis_types=EXPLICIT))
    assert plan.spec.num_kv_heads == 4 and decode.decode_plan(_model("gemma3-1kv-compressed")).spec.num_kv_heads == 1
    # 4 KV heads of 8 query heads on 8 ranks: each KV head on 2.
    plan = _assert_generate_on_mesh("llama-compressed", _model_mesh(8))
    assert (plan.spec.num_heads, plan.spec.num_kv_heads) == (8, 8)


@check
def generate_decodes_other_layouts_through_the_model_forward():
    # Layouts the Megatron step does not take still give one device's tokens, through the model's own forward:
    # down's v split along its output features (Megatron keeps it whole), and query heads that do not split (4
    # over 8 ranks).
    down_columns = ((r"mlp/down_proj/v$", P(None, "model")),)
    for name, mesh, layout in (
        ("llama-compressed", _model_mesh(4, data=2, axis_types=EXPLICIT), down_columns),
        ("gemma3-1kv-compressed", _model_mesh(8), MEGATRON),
    ):
        assert _assert_generate_on_mesh(name, mesh, layout, route="decode_model_forward") is None
        reason = decode.tensor_parallel_fallback_reason(_shard_megatron(_model(name), mesh, layout))
        assert re.search(r"down_proj/v is split along dim 1|spec\.num_heads = 4 does not split over 8", reason), reason


test_layouts = check_test(CHECKS)


if __name__ == "__main__":
    run_checks(CHECKS)
