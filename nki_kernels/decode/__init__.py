"""One decode step over all decoder layers as NKI kernels, around one operand contract.

contract.py      DecodeSpec (what the kernels are specialized on), DecodeOperands (the named operands),
                 Factored(u, v[, u_scale, v_scale]), Quantized(w, scale) (fp8 weights) and Dense() (a dense weight
                 packed in the model's dtype), expected_shapes and
                 check (check_write_index, check_lengths: the value rules): the one description of the operands
tiles.py         the column-tile library: feature layouts and moving rows <-> column tiles in SBUF
ring.py          WeightRing: the SBUF ring weight blocks stream through (prefetch across layers)
projections.py   RMSNorm, projections (dense and factored), the gated MLP and the LM head on column tiles
attention.py     q/k norm, RoPE, the in-place KV-cache write and GQA attention over the cache
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
    DecodeSpec,
    Dense,
    Factored,
    Quantized,
    check,
    check_lengths,
    check_write_index,
    expected_shapes,
)

__all__ = [
    "PROJECTIONS",
    "WEIGHTS",
    "DecodeOperands",
    "DecodeSpec",
    "Dense",
    "Factored",
    "Quantized",
    "check",
    "check_lengths",
    "check_write_index",
    "expected_shapes",
]
