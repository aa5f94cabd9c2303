"""DecodeSpec: what the decode kernels are specialized on (a hashable, static kernel argument).

Sizes, the family's norm and attention variants, which projections are factored and at what rank per layer, which
weights are fp8 or packed, the tensor-parallel degree and the paged cache's block size; everything that changes per
step (tokens, positions, the cache) is an operand (nki_kernels.decode.contract). One spec fits both families: Llama has
no unit-offset norms, q/k norms, sandwich norms or soft-capping; Gemma 3 has all of them and alternates RoPE tables and
masks per layer (`layer_rope`, `layer_mask` index the step's tables).
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from nki_kernels.activations import check_fused_activation

# The projections of one decoder layer, in operand order; the weights of a step: those, then the LM head.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
WEIGHTS = (*PROJECTIONS, "head")
# Projections whose weight rows (K) are split over tensor-parallel ranks; the others split their columns (N).
SPLIT_ROWS = ("o", "down")
# fp8 weight values as the kernels take them: Trainium's float8_e4m3 (±240). JAX holds the same bits as
# float8_e4m3fn (jax_neuronmm.compress.quantize), so `check` takes the fp8 dtype its caller holds.
FP8 = np.dtype(ml_dtypes.float8_e4m3)
SCALE = np.dtype(np.float32)


def _check_names(field: str, names, allowed: tuple) -> None:
    """ValueError naming DecodeSpec.<field> unless names is a tuple of distinct entries of allowed."""
    if not isinstance(names, tuple) or any(name not in allowed for name in names) or len(set(names)) != len(names):
        raise ValueError(f"DecodeSpec.{field}: got {names!r}, expected a tuple of distinct names of {allowed}")


@dataclasses.dataclass(frozen=True)
class DecodeShapes:
    """A decode step's sizes: layers, the hidden size, query and KV heads of head_dim features, the MLP's
    intermediate size and the vocabulary (with tensor_parallel > 1, this rank's heads, KV heads, intermediate and
    vocabulary: see DecodeSpec)."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


@dataclasses.dataclass(frozen=True)
class ModelVariant:
    """What a model family's layers do beyond the shapes: the norms (eps, 1 + w weights with norm_unit_offset, q/k
    head norms, sandwich norms around attention and the MLP), the MLP's activation, the query scaling, the logit
    softcaps (None: none), and per layer the RoPE table and mask table it reads (layer_rope, layer_mask: indices
    into the step's tables).

    mask_windows: () (no windows), or one entry per mask table: None when mask i may make any slot visible, else
    a count W of slots such that mask i makes visible to the query written at slot j (write_index + t) only slots
    in [j - W + 1, j] (a sliding window of W positions over a cache whose slots hold consecutive positions). The
    kernels then read only the window_slots(i, S, T) slots a row's T queries can see, from a slot derived from
    write_index at run time, so one compiled kernel serves every step.
    """

    norm_eps: float
    norm_unit_offset: bool
    qk_norm: bool
    sandwich: bool
    activation: str
    query_scaling: float
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    layer_rope: tuple[int, ...]
    layer_mask: tuple[int, ...]
    mask_windows: tuple[int | None, ...] = ()


@dataclasses.dataclass(frozen=True)
class WeightStorage:
    """How the step's weights are stored: factored (at what ranks), fp8, packed.

    ranks: one entry per name in PROJECTIONS: None when that projection is dense in every layer, else a tuple of
    the L per-layer ranks of its factors (stacked to the largest rank; layer l uses the first ranks[l]), where None
    marks a layer whose weight W [K, N] stays dense: the stack holds it as exact factors (`dense_in_stack`) and the
    kernels read W alone.
    head_rank: None for a dense LM head, else the rank of its factors.
    fp8_weights: names of WEIGHTS stored as fp8 values with float32 per-output-column scales (a dense one as
    Quantized, a factored one as Factored with u_scale and v_scale), in any order; () for none.
    packed_weights: names of PROJECTIONS whose values every layer stores in the one `packed` operand in the
    kernels' layout (nki_kernels.decode.layouts: one DMA reads a layer's bytes of all of them per partition)
    instead of in their own stored weights, which keep only their scales (fp8) or nothing (in the model's dtype:
    an empty Factored, or for a dense weight an empty Dense); () for none. All of them fp8 (the operand is fp8),
    or all in the model's dtype, factored or dense (the operand is in the model's dtype). With tensor_parallel > 1
    the packed operand is this rank's: the layout of its shard's values.
    """

    ranks: tuple[tuple[int, ...] | None, ...] = (None,) * len(PROJECTIONS)
    head_rank: int | None = None
    fp8_weights: tuple[str, ...] = ()
    packed_weights: tuple[str, ...] = ()


# DecodeSpec's parts whose fields it reads as its own (spec.num_heads is spec.shapes.num_heads).
PARTS = {"shapes": DecodeShapes, "variant": ModelVariant, "storage": WeightStorage}


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """What the decode kernels are specialized on, by concern; hashable (a static kernel argument). The fields of
    its parts read as its own (spec.num_heads, spec.fp8_weights, ...), and `replace` changes any of them.

    shapes: DecodeShapes; variant: ModelVariant; storage: WeightStorage.
    tensor_parallel (parallelism): how many ranks (NeuronCores) the model is split over in the Megatron layout; the
    spec then describes one rank's shard: num_heads, num_kv_heads, intermediate and vocab count this rank's query
    heads, KV heads, MLP features and vocabulary entries, while hidden, head_dim and the factor ranks are whole (a
    factor's rank is replicated: q/k/v/gate/up and the head split v's columns, o and down split u's rows). Each
    layer then all-reduces over the ranks the output of o and of down (for a factored o or down, its rank-r product
    x·u); the logits are gathered over the ranks' vocabulary slices in rank order. 1: one rank, no collectives.
    block_size (the cache): None (a contiguous cache per row, written at write_index), or the slots per block of a
    paged cache: k_cache and v_cache are then pools of blocks [L, num_blocks, block_size, kv_heads, D] that every
    row shares, read and written through the operands block_table [B, MB] and lengths [B] (one new token per row,
    T = 1, at its own position lengths[b]; see DecodeOperands). The logical slots of a row are S = MB·block_size.
    """

    shapes: DecodeShapes
    variant: ModelVariant
    storage: WeightStorage = WeightStorage()
    tensor_parallel: int = 1
    block_size: int | None = None

    def replace(self, **changes) -> DecodeSpec:
        """This spec with `changes` (names of its own fields or of its parts' fields) applied, checked anew."""
        own = {name: changes.pop(name) for name in list(changes) if name not in _PART_OF}
        for part in PARTS:
            mine = {name: changes[name] for name in changes if _PART_OF[name] == part}
            if mine and part in own:
                raise ValueError(f"DecodeSpec.replace: got {part}= and {sorted(mine)}, expected one or the other")
            if mine:
                own[part] = dataclasses.replace(getattr(self, part), **mine)
        return dataclasses.replace(self, **own)

    def __post_init__(self):
        for part, kind in PARTS.items():
            if not isinstance(getattr(self, part), kind):
                raise TypeError(
                    f"DecodeSpec.{part}: got {type(getattr(self, part)).__name__}, expected a {kind.__name__}"
                )
        for name in (
            "tensor_parallel",
            "num_layers",
            "hidden",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate",
            "vocab",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeSpec.{name}: got {value!r}, expected a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecodeSpec.num_heads: got {self.num_heads}, expected a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name in ("norm_eps", "query_scaling"):
            value = getattr(self, name)
            if not _finite_positive(value):
                raise ValueError(f"DecodeSpec.{name}: got {value!r}, expected a finite positive float")
        check_fused_activation(self.activation, "DecodeSpec.activation")
        for name in ("layer_rope", "layer_mask"):
            value = getattr(self, name)
            if len(value) != self.num_layers or any(not isinstance(i, int) or i < 0 for i in value):
                raise ValueError(f"DecodeSpec.{name}: got {value!r}, expected {self.num_layers} table indices >= 0")
        for name in ("attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not _finite_positive(value):
                raise ValueError(f"DecodeSpec.{name}: got {value!r}, expected None or a finite positive float")
        if len(self.ranks) != len(PROJECTIONS):
            raise ValueError(
                f"DecodeSpec.ranks: got {len(self.ranks)} entries, expected one per projection {PROJECTIONS}"
            )
        for name, ranks in zip(PROJECTIONS, self.ranks):
            if ranks is None:
                continue
            limit = min(self.whole_features(name))
            if (
                len(ranks) != self.num_layers
                or any(r is not None and (not isinstance(r, int) or not 1 <= r <= limit) for r in ranks)
                or all(r is None for r in ranks)
            ):
                raise ValueError(
                    f"DecodeSpec.ranks[{name!r}]: got {ranks!r}, expected {self.num_layers} entries, each a rank in "
                    f"[1, {limit}] or None (that layer dense), at least one a rank (else None for the whole entry)"
                )
        if self.head_rank is not None and not (
            isinstance(self.head_rank, int) and 1 <= self.head_rank <= min(self.hidden, self.whole_vocab)
        ):
            raise ValueError(
                f"DecodeSpec.head_rank: got {self.head_rank!r}, expected None or a rank in "
                f"[1, {min(self.hidden, self.whole_vocab)}]"
            )
        if self.block_size is not None and (
            isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1
        ):
            raise ValueError(f"DecodeSpec.block_size: got {self.block_size!r}, expected None or a positive int")
        _check_names("fp8_weights", self.fp8_weights, WEIGHTS)
        _check_names("packed_weights", self.packed_weights, PROJECTIONS)
        fp8 = [name for name in self.packed_weights if self.fp8(name)]
        if fp8 and len(fp8) != len(self.packed_weights):
            raise ValueError(
                f"DecodeSpec.packed_weights: got {self.packed_weights!r}, but fp8_weights names only {fp8} of them: "
                "packed weights share one dtype (all fp8, or all in the model's dtype)"
            )
        if self.mask_windows and (
            len(self.mask_windows) != self.num_masks
            or any(w is not None and (not isinstance(w, int) or w < 1) for w in self.mask_windows)
        ):
            raise ValueError(
                f"DecodeSpec.mask_windows: got {self.mask_windows!r}, expected () or {self.num_masks} "
                f"entries (one per mask table), each None or a window of slots >= 1"
            )

    @property
    def paged(self) -> bool:
        """Whether the cache is a pool of blocks read through a block table (block_size set)."""
        return self.block_size is not None

    @property
    def contiguous(self) -> bool:
        """Whether each row has its own contiguous cache written at write_index (no block_size)."""
        return self.block_size is None

    @property
    def num_norms(self) -> int:
        """Per-layer hidden-size norms: input and post-attention, plus pre/post-feedforward with sandwich."""
        return 4 if self.sandwich else 2

    @property
    def num_rope_tables(self) -> int:
        return max(self.layer_rope) + 1

    @property
    def num_masks(self) -> int:
        return max(self.layer_mask) + 1

    def window_slots(self, mask: int, slots: int, tokens: int) -> int:
        """How many consecutive cache slots (of `slots`) mask table `mask` can make visible to a row's `tokens`
        queries: all of them without a window, else min(slots, W + tokens - 1)."""
        window = self.mask_windows[mask] if self.mask_windows else None
        return slots if window is None else min(slots, window + tokens - 1)

    def in_features(self, projection: str) -> int:
        """K of a projection's [K, N] weight."""
        return {
            "q": self.hidden,
            "k": self.hidden,
            "v": self.hidden,
            "o": self.num_heads * self.head_dim,
            "gate": self.hidden,
            "up": self.hidden,
            "down": self.intermediate,
        }[projection]

    def out_features(self, projection: str) -> int:
        """N of a projection's [K, N] weight."""
        return {
            "q": self.num_heads * self.head_dim,
            "k": self.num_kv_heads * self.head_dim,
            "v": self.num_kv_heads * self.head_dim,
            "o": self.hidden,
            "gate": self.intermediate,
            "up": self.intermediate,
            "down": self.hidden,
        }[projection]

    def whole_features(self, projection: str) -> tuple[int, int]:
        """(K, N) of the whole model's weight of a projection, which this rank holds a 1/tensor_parallel slice of:
        o and down split K (their rows), the others N (their columns)."""
        k, n = self.in_features(projection), self.out_features(projection)
        if projection in SPLIT_ROWS:
            return k * self.tensor_parallel, n
        return k, n * self.tensor_parallel

    @property
    def whole_vocab(self) -> int:
        return self.vocab * self.tensor_parallel

    def rank(self, projection: str, layer: int) -> int | None:
        """The rank of `projection` in `layer`, or None when it is dense there (in every layer, or in this one)."""
        ranks = self.ranks[PROJECTIONS.index(projection)]
        return None if ranks is None else ranks[layer]

    def stacked_rank(self, weight: str) -> int:
        """The width a factored weight's factors are stacked to at least: its largest per-layer rank, or where a
        layer stays dense, the width that holds its W (`dense_factor`); the LM head's rank."""
        if weight == "head":
            return self.head_rank
        dense_width = self.dense_factor(weight)[1]
        return max(dense_width if r is None else r for r in self.ranks[PROJECTIONS.index(weight)])

    def dense_factor(self, projection: str) -> tuple[str, int]:
        """(factor, width): where a factored stack holds the W [K, N] of a layer it leaves dense (`dense_in_stack`):
        ("v", K), W in v's first K rows, for a projection whose columns tensor-parallel ranks split; ("u", N), W in
        u's first N columns, for SPLIT_ROWS (o, down). Either way a rank's shard of the factor is its shard of W."""
        if projection in SPLIT_ROWS:
            return "u", self.out_features(projection)
        return "v", self.in_features(projection)

    def factored(self, weight: str) -> bool:
        """Whether `weight` (a name of WEIGHTS) is stored as factors."""
        return (self.head_rank if weight == "head" else self.ranks[PROJECTIONS.index(weight)]) is not None

    def fp8(self, weight: str) -> bool:
        """Whether `weight` (a name of WEIGHTS) is stored as fp8 values with scales."""
        return weight in self.fp8_weights

    def has_part(self, weight: str, part: dataclasses.Field) -> bool:
        """Whether `weight`'s stored weight holds `part` (a field of Factored / Quantized): scales for fp8 weights
        only, values unless the weight is packed (its values are in the `packed` operand)."""
        if part.metadata["dtype"] is SCALE:
            return self.fp8(weight)
        return weight not in self.packed_weights

    @property
    def packed_fp8(self) -> bool:
        """Whether the packed operand holds fp8 values (else the model's dtype)."""
        return bool(self.packed_weights) and self.fp8(self.packed_weights[0])


def _finite_positive(value) -> bool:
    """A real number (not a bool, a string or an array), finite and > 0: NaN would pass a negated "> 0" test."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float, np.integer, np.floating))
        and math.isfinite(value)
        and value > 0
    )


# Each part's field name -> the part that holds it.
_PART_OF = {field.name: part for part, kind in PARTS.items() for field in dataclasses.fields(kind)}


def _read_part(part: str, name: str) -> property:
    """A read-only property giving a DecodeSpec's part's field `name`."""
    return property(lambda spec: getattr(getattr(spec, part), name), doc=f"{part}.{name}")


def _read_parts_as_own(cls):
    """Give `cls` (DecodeSpec) a property per field of its parts, so kernels read one spec."""
    for name, part in _PART_OF.items():
        setattr(cls, name, _read_part(part, name))


_read_parts_as_own(DecodeSpec)
