"""The static description of one decode step over all decoder layers, shared by the NKI kernels and JAX.

A decode step runs every decoder layer on a few new tokens per row and ends with the final norm and the LM head.
`DecodeSpec` holds what the kernels are specialized on (sizes, the family's norm and attention variants, which
projections are factored and at what rank per layer); everything that changes per step (tokens, positions, the
cache) is an operand. Both families fit one spec: Llama has no unit-offset norms, QK-norm, sandwich norms or
soft-capping; Gemma 3 has all of them and alternates RoPE tables and masks per layer (`layer_rope`,
`layer_mask` index the step's tables).
"""

from __future__ import annotations

import dataclasses
import math

from nki_kernels.activations import check_fused_activation

# The projections of one decoder layer, in operand order.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Sizes and variants of a decode step; hashable (a static kernel argument).

    ranks: one entry per name in PROJECTIONS: None when that projection is dense in every layer, else a tuple of
    the L per-layer ranks of its factors (stacked to the largest rank; layer l uses the first ranks[l]).
    head_rank: None for a dense LM head, else the rank of its factors.
    mask_windows: () (no windows), or one entry per mask table: None when mask i may make any slot visible, else
    a count W of slots such that mask i makes visible to the query written at slot j (write_index + t) only slots
    in [j - W + 1, j] (a sliding window of W positions over a cache whose slots hold consecutive positions). The
    kernels then read only the window_slots(i, S, T) slots a row's T queries can see, from a slot derived from
    write_index at run time, so one compiled kernel serves every step.
    """

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
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
    ranks: tuple[tuple[int, ...] | None, ...] = (None,) * len(PROJECTIONS)
    head_rank: int | None = None
    mask_windows: tuple[int | None, ...] = ()

    def __post_init__(self):
        for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeSpec.{name}: got {value!r}, expected a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecodeSpec.num_heads: got {self.num_heads}, expected a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name in ("norm_eps", "query_scaling"):  # NaN would pass a plain "> 0" test's negation silently
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"DecodeSpec.{name}: got {value!r}, expected a finite positive float")
        check_fused_activation(self.activation, "DecodeSpec.activation")
        for name in ("layer_rope", "layer_mask"):
            value = getattr(self, name)
            if len(value) != self.num_layers or any(not isinstance(i, int) or i < 0 for i in value):
                raise ValueError(f"DecodeSpec.{name}: got {value!r}, expected {self.num_layers} table indices >= 0")
        for name in ("attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"DecodeSpec.{name}: got {value!r}, expected None or a finite positive float")
        if len(self.ranks) != len(PROJECTIONS):
            raise ValueError(
                f"DecodeSpec.ranks: got {len(self.ranks)} entries, expected one per projection {PROJECTIONS}"
            )
        for name, ranks in zip(PROJECTIONS, self.ranks):
            if ranks is None:
                continue
            limit = min(self.in_features(name), self.out_features(name))
            if len(ranks) != self.num_layers or any(not isinstance(r, int) or not 1 <= r <= limit for r in ranks):
                raise ValueError(
                    f"DecodeSpec.ranks[{name!r}]: got {ranks!r}, expected {self.num_layers} ranks in [1, {limit}]"
                )
        if self.head_rank is not None and not (
            isinstance(self.head_rank, int) and 1 <= self.head_rank <= min(self.hidden, self.vocab)
        ):
            raise ValueError(
                f"DecodeSpec.head_rank: got {self.head_rank!r}, expected None or a rank in "
                f"[1, {min(self.hidden, self.vocab)}]"
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

    def rank(self, projection: str, layer: int) -> int | None:
        """The rank of `projection` in `layer`, or None when it is dense."""
        ranks = self.ranks[PROJECTIONS.index(projection)]
        return None if ranks is None else ranks[layer]
