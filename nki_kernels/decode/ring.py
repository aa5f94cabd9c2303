"""The weight ring: a preallocated SBUF ring that the decode kernels' weight blocks stream through."""

from __future__ import annotations

from nki_kernels.binding import nisa, nl
from nki_kernels.svd_matmul import spans

# Largest weight block per partition, and the SBUF left beside the ring for the small tiles every kernel holds
# (activations, norm and attention constants, the step's input rows) unless the kernel sizes it from its shape (a
# decode-step kernel's step.reserved_bytes); what grows with the shape (attention's cache tiles, fp8 scales,
# the LM head's staged logits) is the ring's beside_bytes, computed by the kernel from the spec.
# Gemma 3 270M at batch 1 holds under 3 KiB of those small tiles (5 KiB at batch 8; Llama-3.1-8B 4-5 KiB, its
# input rows 16 KiB before any other tile): a 64 KiB reserve was one ring 48 KiB shallower (trn2, T = 4 dense:
# 481.6 -> 466.1 µs modeled with the head's staging sized separately).
RING_BLOCK_BYTES = 32 * 1024
SBUF_RESERVED_BYTES = 16 * 1024
# The small tiles' share of that reserve, at most (the rest holds a staged [R, hidden] float32 row block: a
# decode-step kernel reserves this and that row block, step.reserved_bytes).
SMALL_TILE_BYTES = 8 * 1024
# Partitions per weight DMA: a block is issued as one DMA per group of DMA engines (8 partitions each), so each
# engine takes its share as soon as it is free instead of waiting for a window free on all 16 at once (a small
# transfer on one engine, e.g. a logits row, would otherwise hold up the whole next block).
WEIGHT_DMA_PARTITIONS = 32


class WeightRing:
    """A preallocated SBUF ring of `ring_bytes` per partition that weight blocks (at most `block_bytes` per
    partition each) are loaded into one after another, round robin: a block takes the next free stretch, starting
    over at the front when the rest of the ring is too short. The cursor never resets, so it carries across
    layers and into the head: a load waits only for the matmuls that read the bytes it overwrites, i.e. the
    ring's whole size is prefetch, however small the blocks (a ring of fixed-size slots would hold as few small
    blocks as large ones).

    The ring is bytes; each block is a view of its stretch in its weight's dtype, so fp8 and bf16 weights share one
    ring (an fp8 block holds twice the elements of a bf16 one in the same bytes).
    """

    def __init__(self, block_bytes=None, ring_bytes=None, beside_bytes=0, reserved_bytes=SBUF_RESERVED_BYTES):
        """beside_bytes: SBUF per partition that other tiles hold beside reserved_bytes (the small tiles') while the
        ring is in use (attention's cache tiles); the default ring takes the rest."""
        block_bytes = RING_BLOCK_BYTES if block_bytes is None else block_bytes
        if ring_bytes is None:
            ring_bytes = nl.tile_size.sbuf_fmax_bytes - reserved_bytes - beside_bytes
        if not 0 < block_bytes <= ring_bytes:
            raise ValueError(
                f"WeightRing: block_bytes={block_bytes}, ring_bytes={ring_bytes}; expected "
                f"0 < block_bytes <= ring_bytes"
            )
        self.block_bytes = block_bytes
        self.ring_bytes = ring_bytes - ring_bytes % nl.float32.itemsize  # a row viewable in any weight dtype
        # Allocated at the first block, so that what a kernel stages before its first weight (the step's input
        # rows, every layer's fp8 scales: [R, F] float32 rows, 57 KiB a partition for Llama-3.1-8B's intermediate)
        # is freed before the ring takes the SBUF it leaves.
        self.ring = None
        self.cursor = 0  # bytes
        # [(start, end)] byte ranges later loads skip: blocks read after other blocks stream through the ring (a
        # layer's packed weights, nki_kernels.decode.packing.load_packed, until their last matmuls are issued).
        self.pinned = []

    def block_elements(self, dtype):
        """The largest block per partition, in elements of `dtype`."""
        return self.block_bytes // dtype.itemsize

    def ring_elements(self, dtype):
        """The ring's size per partition, in elements of `dtype`."""
        return self.ring_bytes // dtype.itemsize

    def load(self, src, partitions, per_partition, columns):
        """The next stretch of the ring as [partitions, per_partition, columns] in src's dtype, filled from the HBM
        view `src` (same shape; its bytes copied as they are)."""
        itemsize = src.dtype.itemsize
        size = per_partition * columns * itemsize
        if size > self.block_bytes:
            raise ValueError(
                f"WeightRing: a block of {per_partition}x{columns} elements per partition exceeds the "
                f"{self.block_elements(src.dtype)}-element block limit"
            )
        self.cursor += -self.cursor % itemsize
        if self.cursor + size > self.ring_bytes:
            self.cursor = 0
        for _ in range(len(self.pinned) + 1):
            clash = next((end for start, end in self.pinned if start < self.cursor + size and self.cursor < end), None)
            if clash is None:
                break
            self.cursor = clash + -clash % itemsize
            if self.cursor + size > self.ring_bytes:
                self.cursor = 0
        else:
            raise ValueError(
                f"WeightRing: no stretch of {size} bytes beside the pinned blocks {self.pinned} in a ring of "
                f"{self.ring_bytes} bytes (ring_bytes); expected a ring that holds a layer's packed weights and a block"
            )
        if self.ring is None:
            self.ring = nl.ndarray(
                (nl.tile_size.pmax, self.ring_bytes), dtype=nl.uint8, buffer=nl.sbuf, name="weight_ring"
            )
        stretch = self.ring[0:partitions, self.cursor : self.cursor + size].view(src.dtype)
        block = stretch.reshape((partitions, per_partition, columns))
        self.cursor += size
        for p0, ps in spans(partitions, WEIGHT_DMA_PARTITIONS):
            nisa.dma_copy(dst=block[p0 : p0 + ps], src=src[p0 : p0 + ps])
        return block
