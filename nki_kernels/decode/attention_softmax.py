"""Decode attention's scores, softmax and weighted values over a cache window read by attention_cache.

Scores are computed transposed, slots on partitions: scoresᵀ [np ≤ 128, G·T] = Kᵀ [D, np] stationary × q [D, G·T]
moving, accumulated over D tiles; query_scaling is folded into q, the tanh softcap applied before the mask. Softmax
over slots = over partitions and pieces: per-partition max over pieces, then a PE transpose and a free-axis max; -max
is spread back over the partitions by onesᵀ·diag(-max) (a matmul); exp on ScalarE; column sums by onesᵀ·(per-partition
sums), which also spreads them over the output's D partitions. The weights are already [slots, G·T], the moving
operand of attnᵀ [D, G·T] = V [np, D] stationary × weights, accumulated over pieces: the output lands
features-on-partitions (D < 128: head h is moved to its partitions (h·D) mod 128 by a shift matmul). All kv heads of a
row whose G·T columns fit 128 share one softmax pass.
"""

from __future__ import annotations

import dataclasses

from nki_kernels.binding import nisa, nl
from nki_kernels.decode.attention_cache import MASKED_SCORE
from nki_kernels.decode.attention_heads import head_tiles, kv_head_place
from nki_kernels.decode.tiles import fp32_per_psum_bank, natural_tiles, spread_across_partitions
from nki_kernels.svd_matmul import spans


def prepare_queries(q, spec, batch, dtype, constants):
    """qs [128, nd, B, kv, G, T] in `dtype`, times query_scaling: the query heads of kv head g of row b with
    their head dim on the same partitions as g's features in the keys' column tiles (partitions o..o+Dp-1,
    o = kv_head_place(g, D)[0]), so each (tile, b, g) is a stationary [Dp, G·T] contracting against Kᵀ."""
    d = spec.head_dim
    pmax = nl.tile_size.pmax
    dp, nd = head_tiles(d)
    heads, kv = spec.num_heads, spec.num_kv_heads
    g_size = heads // kv
    r = q.shape[2]
    t = r // batch
    qs = nl.ndarray((pmax, nd, batch, kv, g_size, t), dtype=dtype, buffer=nl.sbuf, name="attn_queries")
    if d >= pmax:
        source = q.reshape_dim(1, (kv, g_size, nd))
        for k in range(nd):
            nisa.activation(
                dst=qs[:, k].permute((0, 2, 3, 1, 4)),
                op=nl.copy,
                data=source[:, :, :, k, :].reshape_dim(3, (batch, t)),
                scale=float(spec.query_scaling),
            )
        return qs
    # Head h moves from partitions o_h.. of its tile to o_g..: a shift matmul whose output rows below o_g are 0.
    parts, _ = natural_tiles(heads * d)
    per_bank = max(1, fp32_per_psum_bank(r))
    for g in range(kv):
        o_g, _ = kv_head_place(g, d)
        by_head = qs[o_g : o_g + d, 0, :, g].permute((0, 2, 1, 3))  # [D, G, B, T]
        for j0, jn in spans(g_size, per_bank):
            moved = nl.ndarray((o_g + d, jn, r), dtype=nl.float32, buffer=nl.psum, name="queries_psum")
            for j in range(jn):
                h = g * g_size + j0 + j
                o_h, tile = (h * d) % pmax, h * d // pmax
                size = min(parts, heads * d - tile * pmax)  # a ragged last tile: only its features' partitions
                nisa.nc_matmul(
                    dst=moved[:, j, :],
                    moving=q[0:size, tile, 0:r],
                    stationary=constants.shift[0:size, pmax - o_g + o_h : pmax + o_h + d],
                )
            nisa.activation(
                dst=by_head[:, j0 : j0 + jn],
                op=nl.copy,
                data=moved[o_g : o_g + d].reshape_dim(2, (batch, t)),
                scale=float(spec.query_scaling),
            )
    return qs


@dataclasses.dataclass(frozen=True)
class AttentionOutput:
    """Where softmax_pass writes: attn, column tiles [128, ceil(heads·D/128), R] (written directly when D >= 128),
    and by_head [D, heads, R] fp32 (D < 128: each head on partitions 0..D-1, placed into attn by place_heads)."""

    attn: object
    by_head: object


def _piece_runs(window, new, per_bank):
    """[(partitions, first piece, pieces)]: runs of score pieces of one block, at most per_bank of them (one PSUM
    accumulator each), then the new tokens' piece (NewSlots) when there is one."""
    runs, piece0 = [], 0
    for _, np_, q in window.blocks:
        runs.extend((np_, piece0 + i0, ni) for i0, ni in spans(q, per_bank))
        piece0 += q
    if new is not None:
        runs.append((new.partitions, piece0, 1))
    return runs


def _piece_keys(n, b, rows, window, new):
    """(Kᵀ column tiles, their columns) of score piece n of row b: the window's, or the new tokens' piece."""
    if n < len(window.pieces):
        return rows[b].keys, window.key_columns[n]
    return new.keys, slice(0, new.partitions)


def _piece_values(n, b, rows, window, new):
    """V [np, F] of score piece n of row b (its slots on the partitions): the window's, or the new tokens'."""
    if n < len(window.pieces):
        index, i = window.pieces[n]
        return rows[b].values[index][0 : window.blocks[index][1], i, :]
    return new.values


def _masked_scores(units, qs, rows, window, spec, new):
    """scoresᵀ fp32 [128, pieces, units, G·T] of the (row b, kv head g) `units`: Kᵀ [D, np] stationary × q [D, G·T]
    moving per piece, accumulated over the head dim's tiles, softcapped (tanh) when the spec says so, plus the
    mask bias; the window's pieces, then the new tokens' (NewSlots, or None). Partitions a ragged piece leaves
    empty hold MASKED_SCORE."""
    pmax = nl.tile_size.pmax
    d = spec.head_dim
    dp, nd = head_tiles(d)
    g_size = spec.num_heads // spec.num_kv_heads
    t = rows[units[0][0]].mask.shape[2]
    gt = g_size * t
    row_ids = sorted({b for b, _ in units})
    row_units = {b: [u for u, (ub, _) in enumerate(units) if ub == b] for b in row_ids}  # consecutive per row
    runs = _piece_runs(window, new, max(1, fp32_per_psum_bank(len(units) * gt)))
    count = len(window.pieces) + (new is not None)
    scores = nl.ndarray((pmax, count, len(units), gt), dtype=nl.float32, buffer=nl.sbuf, name="scoresT")
    for np_, piece0, ni in runs:
        if np_ < pmax:  # partitions a ragged piece leaves empty must not win the max
            nisa.memset(dst=scores[:, piece0 : piece0 + ni], value=MASKED_SCORE)
        acc = nl.ndarray((np_, ni, len(units), gt), dtype=nl.float32, buffer=nl.psum, name="scoresT_psum")
        for k in range(nd):
            for j in range(ni):
                for u, (b, g) in enumerate(units):
                    keys, slots = _piece_keys(piece0 + j, b, rows, window, new)
                    o_g, tile_g = kv_head_place(g, d)
                    nisa.nc_matmul(
                        dst=acc[0:np_, j, u],
                        moving=qs[o_g : o_g + dp, k, b, g],
                        accumulate=k > 0,
                        stationary=keys[o_g : o_g + dp, tile_g + k, slots],
                    )
        for b in row_ids:
            u0, un = row_units[b][0], len(row_units[b])
            out = scores[0:np_, piece0 : piece0 + ni, u0 : u0 + un].reshape_dim(3, (g_size, t)).flatten_dims(2, 3)
            bias = rows[b].mask[0:np_, piece0 : piece0 + ni, :].expand_dim(2).broadcast(2, un * g_size)
            logits = acc[:, :, u0 : u0 + un].reshape_dim(3, (g_size, t)).flatten_dims(2, 3)  # [np, ni, un·G, T]
            if spec.attn_logit_softcap:
                cap = float(spec.attn_logit_softcap)
                nisa.activation(dst=out, op=nl.tanh, data=logits, scale=1.0 / cap)
                nisa.scalar_tensor_tensor(dst=out, data=out, op0=nl.multiply, operand0=cap, op1=nl.add, operand1=bias)
            else:
                nisa.tensor_tensor(dst=out, data1=logits, data2=bias, op=nl.add)
        del acc
    return scores


def _softmax_weights(units, qs, rows, window, spec, constants, new):
    """(weights [128, pieces, columns] in the cache dtype, scale [Dp, columns] fp32): exp(score - column max) of
    _masked_scores' scores (the new tokens' piece last when `new` is given), and 1 / the column sums of the
    weights (as rounded for the matmul) on every output partition. The column max: per partition over pieces, then
    across partitions by a PE transpose and a free-axis max, spread back by onesᵀ·diag(-max); the column sums by
    onesᵀ·(per-partition sums)."""
    pmax = nl.tile_size.pmax
    dp, _ = head_tiles(spec.head_dim)
    dtype = rows[units[0][0]].keys.dtype
    scores = _masked_scores(units, qs, rows, window, spec, new)
    flat = scores.flatten_dims(2, 3)  # [128, pieces, columns]
    pieces, columns = flat.shape[1], flat.shape[2]
    column_max = nl.ndarray((pmax, columns), dtype=nl.float32, buffer=nl.sbuf, name="scores_partition_max")
    nisa.tensor_reduce(dst=column_max, op=nl.maximum, data=flat.permute((0, 2, 1)), axis=2)
    turned = nl.ndarray((columns, pmax), dtype=nl.float32, buffer=nl.psum, name="scores_max_psum")
    nisa.nc_transpose(dst=turned, data=column_max)
    neg_max = nl.ndarray((columns, 1), dtype=nl.float32, buffer=nl.sbuf, name="scores_neg_max")
    nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=turned, axis=1, negate=True)
    del turned
    # PSUM [128, columns]: -max of each column on every partition.
    shift = spread_across_partitions(neg_max, pmax, constants.ones, constants.identity)
    nisa.tensor_tensor(dst=flat, data1=flat, data2=shift.expand_dim(1).broadcast(1, pieces), op=nl.add)
    del shift
    weights = nl.ndarray((pmax, pieces, columns), dtype=dtype, buffer=nl.sbuf, name="weightsT")
    nisa.activation(dst=weights, op=nl.exp, data=flat)
    del scores, flat
    partial = nl.ndarray((pmax, columns), dtype=nl.float32, buffer=nl.sbuf, name="weights_partition_sum")
    nisa.tensor_reduce(dst=partial, op=nl.add, data=weights.permute((0, 2, 1)), axis=2)
    total = nl.ndarray((dp, columns), dtype=nl.float32, buffer=nl.psum, name="weights_sum_psum")
    nisa.nc_matmul(dst=total, stationary=constants.ones[0:pmax, 0:dp], moving=partial)
    scale = nl.ndarray((dp, columns), dtype=nl.float32, buffer=nl.sbuf, name="weights_recip")
    nisa.reciprocal(dst=scale, data=total)
    del total
    return weights, scale


def _weighted_values(units, weights, scale, rows, window, out, spec, new):
    """out ← weights·V / column sums of each unit: attnᵀ [Dp, G·T] = V [np, Dp] stationary × weights moving,
    accumulated over the pieces (the new tokens' last, when `new` is given), per tile of the head dim; row b's
    columns of kv head g's query heads."""
    pmax = nl.tile_size.pmax
    d = spec.head_dim
    dp, nd = head_tiles(d)
    kv = spec.num_kv_heads
    g_size = spec.num_heads // kv
    t = rows[units[0][0]].mask.shape[2]
    gt = g_size * t
    nq_tiles = out.attn.shape[1]
    for u, (b, g) in enumerate(units):
        mine = slice(u * gt, (u + 1) * gt)
        for k in range(nd):
            acc = nl.ndarray((dp, gt), dtype=nl.float32, buffer=nl.psum, name="attnT_psum")
            f0 = g * d + k * pmax
            for n in range(weights.shape[1]):
                values = _piece_values(n, b, rows, window, new)
                np_ = values.shape[0]
                nisa.nc_matmul(
                    dst=acc,
                    stationary=values[0:np_, f0 : f0 + dp],
                    moving=weights[0:np_, n, mine],
                    accumulate=n > 0,
                )
            if out.by_head is None:
                heads = out.attn.reshape_dim(1, (kv, g_size, nq_tiles // (kv * g_size)))
                dst = heads[:, g, :, k, b * t : (b + 1) * t]
            else:
                dst = out.by_head[:, g * g_size : (g + 1) * g_size, b * t : (b + 1) * t]
            nisa.tensor_tensor(dst=dst, data1=acc, data2=scale[:, mine], op=nl.multiply)
            del acc


def softmax_pass(units, qs, rows, window, out, spec, constants, new=None):
    """Scores, softmax and weights·V of several (row b, kv head g) `units` together (their G·T query columns side
    by side, at most 128) into `out` (AttentionOutput). qs: prepare_queries' queries; rows: {b: RowCache} of the
    units' rows; window: the layer's CacheWindow; new: NewSlots when the window was read before this step's slots
    were written (their k and v then come from chip), else None."""
    weights, scale = _softmax_weights(units, qs, rows, window, spec, constants, new)
    _weighted_values(units, weights, scale, rows, window, out, spec, new)


def place_heads(out, spec, constants):
    """out.attn ← out.by_head (D < 128): head h's D outputs move from partitions 0..D-1 to (h·D) mod 128 of tile
    h·D / 128, by shift matmuls."""
    pmax = nl.tile_size.pmax
    d, heads = spec.head_dim, spec.num_heads
    q_parts, q_tiles = natural_tiles(heads * d)
    r = out.by_head.shape[2]
    heads_per_tile = pmax // d
    for i in range(q_tiles):
        placed = nl.ndarray((q_parts, r), dtype=nl.float32, buffer=nl.psum, name="attn_place_psum")
        members = range(i * heads_per_tile, min(heads, (i + 1) * heads_per_tile))
        for n, h in enumerate(members):
            offset = (h * d) % pmax
            nisa.nc_matmul(
                dst=placed,
                stationary=constants.shift[0:d, pmax - offset : pmax - offset + q_parts],
                moving=out.by_head[0:d, h, 0:r],
                accumulate=n > 0,
            )
        nisa.tensor_copy(dst=out.attn[0:q_parts, i, :], src=placed)
