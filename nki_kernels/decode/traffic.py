"""The bytes a decode step cannot avoid moving between HBM and the core: the floor every composition is measured
against (a kernel at 100% of the peak DMA rate moves exactly these)."""

from __future__ import annotations

from nki_kernels.decode.contract import PROJECTIONS, DecodeSpec


def must_move_bytes(
    spec: DecodeSpec,
    batch: int,
    cache_len: int,
    *,
    layers_only: bool = False,
    tokens: int = 1,
    weight_itemsize: int = 2,
    logits_itemsize: int = 4,
) -> int:
    """Bytes one decode step of `spec` must move for `batch` rows of `tokens` new tokens over `cache_len` slots,
    weights and cache in a `weight_itemsize`-byte dtype, logits in a `logits_itemsize`-byte one.

    Weights read once (every projection: K·N dense or r·(K + N) factored, at each layer's rank; the norm weights,
    q/k norm weights with spec.qk_norm; with the head: final norm and head, H·V or r·(H + V)) + KV cache: 2 (k, v)
    · B · kv_heads · D per visible slot per layer, read (spec.window_slots of the layer's mask: the window in
    sliding-window layers, every slot in the others) + the step's T slots written + logits written, B·T·V.
    layers_only (the nkilib megakernel's scope): no final norm, head or logits, but the hidden state B·T·H written
    once. The step's small inputs (token embeddings, RoPE tables, mask, write index) are left out (under 0.1% of
    a real model's step).
    """
    weights = 0
    for layer in range(spec.num_layers):
        for name in PROJECTIONS:
            k, n, r = spec.in_features(name), spec.out_features(name), spec.rank(name, layer)
            weights += k * n if r is None else r * (k + n)
        weights += spec.num_norms * spec.hidden + (2 * spec.head_dim if spec.qk_norm else 0)
    slot = 2 * batch * spec.num_kv_heads * spec.head_dim  # k and v of one slot, every row
    visible = sum(spec.window_slots(mask, cache_len, tokens) for mask in spec.layer_mask)
    kv = slot * (visible + spec.num_layers * tokens)
    total = (weights + kv) * weight_itemsize
    if layers_only:
        return total + batch * tokens * spec.hidden * weight_itemsize
    head = spec.hidden * spec.vocab if spec.head_rank is None else spec.head_rank * (spec.hidden + spec.vocab)
    return total + (spec.hidden + head) * weight_itemsize + batch * tokens * spec.vocab * logits_itemsize
