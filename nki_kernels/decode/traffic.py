"""The bytes a decode step cannot avoid moving between HBM and the core: the floor every composition is measured
against (a kernel at 100% of the peak DMA rate moves exactly these); and, for a tensor-parallel step, the bytes
each rank sends into its collectives.

A spec with tensor_parallel P > 1 is one rank's shard (nki_kernels.decode.sharding): its counts are one rank's
(its 1/P of the weights and of the KV cache, the replicated norms, and the whole logits, which every rank returns).
"""

from __future__ import annotations

from nki_kernels.decode.contract import FP8, PROJECTIONS, SCALE, SPLIT_ROWS, DecodeSpec

# Bytes of a value the collectives carry: float32 partial sums and logits.
COLLECTIVE_ITEMSIZE = 4


def _weight_bytes(spec: DecodeSpec, name: str, k: int, n: int, rank: int | None, itemsize: int) -> int:
    """Bytes of one [K, N] weight read once: K·N values dense or r·(K + N) factored, in the model's `itemsize`;
    fp8 (spec.fp8_weights): one byte a value plus a float32 scale per output column (N dense; r + N factored)."""
    values = k * n if rank is None else rank * (k + n)
    if not spec.fp8(name):
        return values * itemsize
    scales = n if rank is None else rank + n
    return values * FP8.itemsize + scales * SCALE.itemsize


def weight_bytes(spec: DecodeSpec, itemsize: int = 2, *, head: bool = True) -> int:
    """Bytes of the projections of every layer (K·N dense or r·(K + N) factored at each layer's rank; an fp8 one at
    one byte a value plus its float32 scales) and (head) the LM head, H·V or r·(H + V), read once: what
    jax_neuronmm.models.decode.decode_weight_bytes counts of a model. Norm weights are not included."""
    total = 0
    for layer in range(spec.num_layers):
        for name in PROJECTIONS:
            k, n = spec.in_features(name), spec.out_features(name)
            total += _weight_bytes(spec, name, k, n, spec.rank(name, layer), itemsize)
    if head:
        total += _weight_bytes(spec, "head", spec.hidden, spec.vocab, spec.head_rank, itemsize)
    return total


def must_move_bytes(
    spec: DecodeSpec,
    batch: int,
    cache_len: int,
    *,
    layers_only: bool = False,
    tokens: int = 1,
    itemsize: int = 2,
    logits_itemsize: int = 4,
) -> int:
    """Bytes one decode step of `spec` must move for `batch` rows of `tokens` new tokens over `cache_len` slots,
    the model dtype (weights not in spec.fp8_weights, norms, cache) of `itemsize` bytes, logits of
    `logits_itemsize`.

    Weights read once (every projection: K·N dense or r·(K + N) factored, at each layer's rank, an fp8 one at one
    byte a value plus its float32 scales; the norm weights, q/k norm weights with spec.qk_norm; with the head:
    final norm and head, H·V or r·(H + V)) + KV cache: 2 (k, v) · B · kv_heads · D per visible slot per layer, read
    (spec.window_slots of the layer's mask: the window in sliding-window layers, every slot in the others) + the
    step's T slots written + logits written, B·T·V (the whole vocabulary's, with tensor parallel). layers_only (the
    nkilib megakernel's scope): no final norm, head or logits, but the hidden state B·T·H written once. The step's
    small inputs (token embeddings, RoPE tables, mask, write index) are left out (under 0.1% of a real model's
    step).
    """
    norms = spec.num_layers * (spec.num_norms * spec.hidden + (2 * spec.head_dim if spec.qk_norm else 0)) * itemsize
    weights = weight_bytes(spec, itemsize, head=False) + norms
    slot = 2 * batch * spec.num_kv_heads * spec.head_dim  # k and v of one slot, every row
    visible = sum(spec.window_slots(mask, cache_len, tokens) for mask in spec.layer_mask)
    kv = slot * (visible + spec.num_layers * tokens) * itemsize
    if layers_only:
        return weights + kv + batch * tokens * spec.hidden * itemsize
    head = _weight_bytes(spec, "head", spec.hidden, spec.vocab, spec.head_rank, itemsize)
    return weights + kv + spec.hidden * itemsize + head + batch * tokens * spec.whole_vocab * logits_itemsize


def collective_bytes(spec: DecodeSpec, batch: int, *, tokens: int = 1, layers_only: bool = False) -> int:
    """Bytes one rank of a tensor-parallel step (spec.tensor_parallel > 1) sends into its collectives, float32 as
    the kernels sum and gather them (nki_kernels.decode.parallel): per layer, the partial products of o and of
    down, B·T·H each, or B·T·r of a factored one's x·u; then (unless layers_only) its logits slice, B·T·V for the
    gather. 0 on one rank."""
    if spec.tensor_parallel == 1:
        return 0
    rows = batch * tokens
    total = 0
    for layer in range(spec.num_layers):
        for name in SPLIT_ROWS:
            rank = spec.rank(name, layer)
            total += rows * (spec.hidden if rank is None else rank) * COLLECTIVE_ITEMSIZE
    if not layers_only:
        total += rows * spec.vocab * COLLECTIVE_ITEMSIZE
    return total
