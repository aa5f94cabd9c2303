"""The decode kernels' tensor-parallel collectives (a spec with tensor_parallel P > 1 is one rank's Megatron shard,
nki_kernels.decode.sharding; plain functions called inside @nki.jit kernels, every rank issuing the same ones in
the same order).

- o and down split their weight rows over the ranks, so each rank's product is a partial sum of the layer's
  output: `all_reduce_columns` sums it over the P ranks (nl.add, one replica group of all of them) in SBUF, as
  float32 column tiles, before it reaches the residual stream or a norm. A factored o or down sums its rank-r
  intermediate (x·u)ᵀ instead (u's rows are split, v is whole): r values a row instead of H.
- The LM head splits the vocabulary: `gather_vocabulary` all-gathers the ranks' logits slices along the
  vocabulary in rank order, so every rank returns the whole [R, V] logits.

Overlap: a collective waits only for the tiles it reads; the next weights' ring loads (nki_kernels.decode.ring)
depend on nothing but the matmuls that read the ring bytes they overwrite, so they stream in while the
collective runs (the emulator's cost model list-schedules them so, the collective on the CC cores' own queue).
"""

from __future__ import annotations

from nki_kernels.binding import nisa, nki, nl


def replica_group(ranks):
    """The `ranks` ranks of the step in rank order, as one rank-list."""
    return nki.collectives.ReplicaGroup([list(range(ranks))])


def all_reduce_columns(ranks):
    """A `reduce` for nki_kernels.decode.projections.projection over `ranks` ranks (spec.tensor_parallel): sums a
    float32 SBUF tensor [128, tiles, R] (column tiles) over them in place; None for one rank (nothing to sum)."""
    if ranks == 1:
        return None

    def reduce(cols):
        flat = cols.reshape((cols.shape[0], cols.shape[1] * cols.shape[2]))  # SBUF collectives take 2-D tensors
        nki.collectives.all_reduce([flat], [flat], replica_group(ranks), nl.add)

    return reduce


def gather_vocabulary(out_rows, local_rows, ranks):
    """out_rows [R, ranks·V] (HBM) ← every rank's local_rows [R, V] (HBM, its vocabulary slice) side by side in
    rank order: one all-gather along the rows into scratch [ranks·R, V], then one DMA per rank's slice."""
    rows, vocab = local_rows.shape
    stacked = nl.ndarray((ranks * rows, vocab), dtype=local_rows.dtype, buffer=nl.hbm, name="gathered_logits")
    nki.collectives.all_gather([local_rows], [stacked], replica_group(ranks), collective_dim=0)
    for r in range(ranks):
        nisa.dma_copy(dst=out_rows[0:rows, r * vocab : (r + 1) * vocab], src=stacked[r * rows : (r + 1) * rows, :])
