"""One decode step over all decoder layers as NKI kernels, around one operand contract.

spec.py          DecodeSpec: what the kernels are specialized on, by concern (DecodeShapes, ModelVariant,
                 WeightStorage, tensor_parallel, block_size)
weights.py       Factored(u, v[, u_scale, v_scale]), Quantized(w, scale) (fp8 weights) and Dense() (a dense weight
                 packed in the model's dtype): how a weight is stored
contract.py      DecodeOperands (the named operands), expected_shapes and check (check_write_index, check_lengths:
                 the value rules): the one description of the operands; the spec's and weights' names too
tiles.py         the column-tile library: feature layouts and moving rows <-> column tiles in SBUF
ring.py          WeightRing: the SBUF ring weight blocks stream through (prefetch across layers)
projections.py   the dense math on column tiles, from its stages: norm.py (RMSNorm), matmul.py (projections of dense
                 and factored weights), mlp.py (the gated MLP), logits.py (the LM head)
attention.py     one layer's attention (q/k norm, RoPE, the in-place KV-cache write, GQA over the cache) and its
                 per-op kernels, from its stages: attention_heads.py (head layouts, q/k norm, RoPE),
                 attention_cache.py (the cache write, the window reads), attention_softmax.py (scores, softmax, ·V)
paged.py         a paged KV cache (DecodeSpec.block_size): each row's blocks gathered through its block table, its
                 new token scattered to its own position
step.py          decode_step_kernel: the whole step as one looped kernel (decoder_layer, the head), its plan
sharding.py      shard_operands: a whole model's operands cut into Megatron tensor-parallel shards, one per rank
parallel.py      the kernels' tensor-parallel collectives: o's and down's all-reduces, the logits' all-gather
runner.py        run_looped_step: the looped kernel on the emulator; run_sharded_looped_step: on T ranks
traffic.py       must_move_bytes: what a step cannot avoid moving (fp8 weights at one byte plus their scales)
reference.py     decode_step_f64: the step in float64, what the kernels are tested against
"""

from nki_kernels.decode.contract import (
    PROJECTIONS,
    WEIGHTS,
    DecodeOperands,
    DecodeShapes,
    DecodeSpec,
    Dense,
    Factored,
    ModelVariant,
    Quantized,
    WeightStorage,
    check,
    check_lengths,
    check_write_index,
    expected_shapes,
)

__all__ = [
    "PROJECTIONS",
    "WEIGHTS",
    "DecodeOperands",
    "DecodeShapes",
    "DecodeSpec",
    "Dense",
    "Factored",
    "ModelVariant",
    "Quantized",
    "WeightStorage",
    "check",
    "check_lengths",
    "check_write_index",
    "expected_shapes",
]
