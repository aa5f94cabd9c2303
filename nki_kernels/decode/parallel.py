"""The decode kernels' tensor-parallel collectives (a spec with tensor_parallel P > 1 is one rank's Megatron shard,
nki_kernels.decode.sharding; plain functions called inside @nki.jit kernels, every rank issuing the same ones in
the same order).

- o and down split their weight rows over the ranks, so each rank's product is a partial sum of the layer's
  output: `all_reduce_columns` sums it over the P ranks (nl.add, one replica group of all of them) in SBUF, as
  float32 column tiles, before it reaches the residual stream or a norm. A factored o or down sums its rank-r
  intermediate (x·u)ᵀ instead (u's rows are split, v is whole): r values a row instead of H.
- The LM head splits the vocabulary: `gather_vocabulary` all-gathers the ranks' logits slices along the
  vocabulary in rank order, so every rank returns the whole [R, V] logits. It ends the step: one row gathers
  straight into the logits (rank-major slices are the row itself) in pieces of the slice, halves, quarters, ...
  down to GATHER_TAIL_COLUMNS (`gather_pieces`), each waiting only for the head's stores of its columns, so all
  but the last run while the head computes the rest; several rows gather into scratch and are copied into place
  in LOGIT_COPY_QUEUES pieces at once (an HBM-to-HBM copy runs on one DMA engine, so one copy per rank's slice
  would move the slice's bytes at one engine's rate).

Overlap: a collective waits only for the tiles it reads; the next weights' ring loads (nki_kernels.decode.ring)
depend on nothing but the matmuls that read the ring bytes they overwrite, so they stream in while the
collective runs (the emulator's cost model list-schedules them so, the collective on the CC cores' own queue).
"""

from __future__ import annotations

from nki_kernels.binding import nisa, nki, nl
from nki_kernels.svd_matmul import spans

# DMA engines a NeuronCore has (16 on trn1 and trn2, the DMA overview's per-generation table): the gathered logits
# are copied into place in this many pieces over all ranks' slices, so the pieces run on all engines at once.
LOGIT_COPY_QUEUES = 16
# Narrowest piece of a one-row logits gather but the last (at most twice as wide): each gather also pays the links'
# latency, so much narrower pieces cost more than they hide (512: 1.4 µs later on trn1 than 2048).
GATHER_TAIL_COLUMNS = 2048


def gather_pieces(vocab):
    """[(first column, columns)]: halves, quarters, ... of a vocabulary slice of `vocab` columns, the last at most
    2·GATHER_TAIL_COLUMNS wide (the whole slice when it is no wider)."""
    pieces, v0 = [], 0
    while vocab - v0 > 2 * GATHER_TAIL_COLUMNS:
        half = (vocab - v0) // 2
        pieces.append((v0, half))
        v0 += half
    return pieces + [(v0, vocab - v0)]


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
    rank order: all-gathers along the rows, straight into out_rows viewed as [ranks, V] a piece of the slice at a
    time (gather_pieces) when R = 1, else one into
    scratch [ranks·R, V] and then copied into place, each rank's slice in ceil(LOGIT_COPY_QUEUES / ranks) column
    pieces."""
    rows, vocab = local_rows.shape
    group = replica_group(ranks)
    if rows == 1:
        by_rank = out_rows.reshape((ranks, vocab))
        for v0, vc in gather_pieces(vocab):
            nki.collectives.all_gather(
                [local_rows[0:1, v0 : v0 + vc]], [by_rank[0:ranks, v0 : v0 + vc]], group, collective_dim=0
            )
        return
    stacked = nl.ndarray((ranks * rows, vocab), dtype=local_rows.dtype, buffer=nl.hbm, name="gathered_logits")
    nki.collectives.all_gather([local_rows], [stacked], group, collective_dim=0)
    width = -(-vocab // -(-LOGIT_COPY_QUEUES // ranks))
    for r in range(ranks):
        for v0, vc in spans(vocab, width):
            nisa.dma_copy(
                dst=out_rows[0:rows, r * vocab + v0 : r * vocab + v0 + vc],
                src=stacked[r * rows : (r + 1) * rows, v0 : v0 + vc],
            )
