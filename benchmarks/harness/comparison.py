"""The decode step's compositions compared on the emulator's cost model: how a case is traced (count-only,
`measure_spec`) and what is measured of it, how a deep model is extrapolated from shallow traces, the bytes a step
must move, and the targets the looped kernel is held to (benchmarks/decode_compositions.py and
benchmarks/frontier.py trace their cases with these and write their reports).

A `DecodeModel` is a model's name, where its shapes come from and its dense DecodeSpec at full depth
(`published_decode_models` builds them from the presets through `decode_plan`); `decode_spec`
cuts it to fewer layers, factors it at keep KEEP and stores its weights in fp8 on request; `operand_specs` gives
count-only placeholders of the operands in the contract's order.

Tensor parallel: `tp_spec` is one rank's spec of a model split over T ranks (nki_kernels.decode.sharding);
`measure_spec` runs it on T ranks and measures rank 0; beside each looped row the reports give the physical bound
(`tensor_parallel_bound_us`). The reports' tables built from these measurements: harness.tables.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from harness.compositions import COMPOSITIONS
from harness.runner import run_decode_step, run_sharded_decode_step
from jax_neuronmm.models.decode import preset_decode_spec
from jax_neuronmm.models.presets import PUBLISHED
from nki_kernels import emulator, hardware, ranks
from nki_kernels.decode import traffic
from nki_kernels.decode.contract import (
    PROJECTIONS,
    WEIGHTS,
    DecodeSpec,
    StoredWeight,
    expected_dtypes,
    expected_shapes,
)
from nki_kernels.decode.packing import attention_packing, unpacked_spec
from nki_kernels.decode.sharding import shard_spec
from nki_kernels.emulator import collective_costs, launch, speed_bands, trace
from nki_kernels.emulator.cost_model import collective_links, fitted_terms, roofline_us
from nki_kernels.emulator.kernel import Spec

__all__ = ["COMPOSITIONS", "roofline_us"]

TARGETS = hardware.TARGETS
BF16 = np.dtype(ml_dtypes.bfloat16)
KEEP = 0.8
# The looped kernel's targets (modeled, batch 1).
PEAK_FRACTION = 0.90
OVER_PER_OP = 1.5
OVER_PER_LAYER = 1.15
COMPRESSED_OVER_DENSE = 1.2
WITHIN_NKILIB = 1.05
# nki-library's attention_block_tkg holds the head dimension on partitions (at most 128) and one KV head per call.
NKILIB_MAX_HEAD_DIM = 128
LABELS = {
    "per_op": "(i) per_op",
    "per_layer": "(ii) per_layer",
    "looped": "(iii) looped",
    "per_op_svd_mlp": "per_op + svd_mlp",
}


@dataclasses.dataclass(frozen=True)
class DecodeModel:
    """A model as the comparison traces it: `spec` is its DecodeSpec with every layer (dense for the published
    models; `decode_spec` sets the ranks and fp8 weights of a case, `measure_model` traces the spec as it is);
    `source` says where its shapes come from (a published config.json)."""

    name: str
    source: str
    spec: DecodeSpec

    num_layers = property(lambda self: self.spec.num_layers)
    hidden = property(lambda self: self.spec.hidden)
    num_heads = property(lambda self: self.spec.num_heads)
    num_kv_heads = property(lambda self: self.spec.num_kv_heads)
    head_dim = property(lambda self: self.spec.head_dim)
    intermediate = property(lambda self: self.spec.intermediate)
    vocab = property(lambda self: self.spec.vocab)
    norm_eps = property(lambda self: self.spec.norm_eps)

    @property
    def gemma3(self) -> bool:
        """Gemma 3's layer variants: QK-norm and sandwich norms (with unit-offset norms)."""
        return self.spec.qk_norm and self.spec.sandwich

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding-window layers, or None when every layer sees the whole cache."""
        return next((w for w in self.spec.mask_windows if w is not None), None)

    @property
    def layer_period(self) -> int:
        """Layers after which the layer pattern (RoPE table, mask) repeats: what layer-count extrapolation must
        step by."""
        pattern = list(zip(self.spec.layer_rope, self.spec.layer_mask))
        return next(
            p for p in range(1, len(pattern) + 1) if all(pattern[i] == pattern[i % p] for i in range(len(pattern)))
        )

    def is_local(self, layer: int) -> bool:
        """Whether `layer` reads only a sliding window of the cache."""
        windows = self.spec.mask_windows
        return bool(windows) and windows[self.spec.layer_mask[layer]] is not None


def published_decode_models(names=None) -> dict:
    """{name: DecodeModel} of the published models (`presets.PUBLISHED`; `names` picks some), their specs from
    jax_neuronmm.models.decode.preset_decode_spec."""
    names = list(PUBLISHED) if names is None else list(names)
    unknown = [name for name in names if name not in PUBLISHED]
    if unknown:
        raise ValueError(f"unknown models {unknown}, expected some of {list(PUBLISHED)}")
    return {name: DecodeModel(name, PUBLISHED[name][2], preset_decode_spec(*PUBLISHED[name][:2])) for name in names}


def cut_layers(spec: DecodeSpec, num_layers: int) -> DecodeSpec:
    """`spec` cut to its first num_layers layers: their RoPE tables, masks and ranks; head and fp8 weights kept."""
    layer_mask = spec.layer_mask[:num_layers]
    return spec.replace(
        num_layers=num_layers,
        layer_rope=spec.layer_rope[:num_layers],
        layer_mask=layer_mask,
        mask_windows=spec.mask_windows[: max(layer_mask) + 1] if spec.mask_windows else (),
        ranks=tuple(None if r is None else r[:num_layers] for r in spec.ranks),
    )


def decode_spec(model: DecodeModel, num_layers: int, compressed: bool, fp8: bool = False) -> DecodeSpec:
    """`model`'s dense DecodeSpec cut to its first num_layers layers; compressed: every projection and the head
    factored at the block-aligned rank keeping KEEP of its parameters (the same rank in every layer); fp8: every
    weight (each projection and the head, dense or factored) stored as fp8 values with float32 scales, the
    attention's factors packed where `packing.attention_packing` packs them."""
    full = model.spec
    layer_ranks, head_rank = (None,) * len(PROJECTIONS), None
    if compressed:
        layer_ranks = tuple(
            (ranks.block_aligned_rank(full.in_features(p), full.out_features(p), KEEP),) * num_layers
            for p in PROJECTIONS
        )
        head_rank = ranks.block_aligned_rank(full.hidden, full.vocab, KEEP)
    spec = cut_layers(full.replace(ranks=(None,) * len(PROJECTIONS)), num_layers).replace(
        ranks=layer_ranks, head_rank=head_rank, fp8_weights=WEIGHTS if fp8 else ()
    )
    return spec.replace(packed_weights=attention_packing(spec))


def operand_specs(spec: DecodeSpec, batch: int, cache_len: int, tokens: int = 1) -> tuple:
    """Shape/dtype placeholders (emulator Specs) of the operands in the contract's order (bf16 model dtype), from
    expected_shapes and expected_dtypes; a stored weight (Factored, Quantized) is one of them. A paged spec's pools
    hold every row's cache_len slots (batch·cache_len / block_size blocks)."""
    blocks = batch * (cache_len // spec.block_size) if spec.paged else 1
    shapes, dtypes = expected_shapes(spec, batch, tokens, cache_len, num_blocks=blocks), expected_dtypes(spec, BF16)
    values = []
    for shape, dtype in zip(shapes.values(), dtypes.values()):
        if isinstance(shape, StoredWeight):
            parts = {part: Spec(sub, getattr(dtype, part)) for part, sub in shape.parts().items()}
            values.append(type(shape)(**parts))
        else:
            values.append(None if shape is None else Spec(shape, dtype))
    return tuple(values)


def must_move_bytes(
    model: DecodeModel,
    compressed: bool,
    batch: int,
    cache_len: int,
    layers_only: bool = False,
    tokens: int = 1,
    fp8: bool = False,
) -> int:
    """traffic.must_move_bytes of `model`'s whole step (bf16 model dtype and cache, fp32 logits), dense or at keep
    KEEP, its weights in bf16 or (fp8) fp8 with float32 scales."""
    spec = decode_spec(model, model.num_layers, compressed, fp8)
    return traffic.must_move_bytes(
        spec, batch, cache_len, layers_only=layers_only, tokens=tokens, itemsize=BF16.itemsize
    )


def tp_spec(model: DecodeModel, num_layers: int, compressed: bool, ranks: int, batch: int = 1) -> DecodeSpec:
    """One rank's spec of `model` cut to num_layers layers (dense or at keep KEEP, bf16) split over `ranks` ranks
    (sharding.shard_spec: a ValueError when they do not divide the model), for steps of `batch` rows. On several
    ranks at batch 1 its attention is packed where `packing.attention_packing` packs the rank's shard, dense
    projections included (dense=True: a rank's small dense shards, read alone, are short DMA runs, and a batch-1
    step is bound by its bytes); otherwise, and on one rank, decode_spec's packing (the T = 1 cases share the
    single-core report's traces). At batch 8 the dense packing measured slower: those steps are bound by their
    dependency chain, which then waits for a layer's whole packed block before q's first matmul (Llama-3.2-1B,
    T = 8: 1335.5 -> 1424.0 µs on trn1, 1376.6 -> 1495.5 on trn2)."""
    spec = decode_spec(model, num_layers, compressed)
    if ranks == 1:
        return shard_spec(spec, 1)
    if batch != 1:
        return shard_spec(spec, ranks)
    rank_spec = shard_spec(unpacked_spec(spec), ranks)
    return rank_spec.replace(packed_weights=attention_packing(rank_spec, dense=True))


def collective_floor_us(spec: DecodeSpec, batch: int, target: str) -> float:
    """µs the links need for one rank's collectives of a step of `spec` (one rank's shard; 0 on one rank): per
    layer the all-reduces of o's and down's float32 partial products (B·H, or B·r for a factored one), then the
    all-gather of its logits slice, each priced by the emulator's link model (collective_costs, the default hop
    latency) and run one after another, as the layers' data dependencies order them."""
    ranks = spec.tensor_parallel
    if ranks == 1:
        return 0.0
    links = collective_links(target)
    size = traffic.COLLECTIVE_ITEMSIZE
    total = 0.0
    for layer in range(spec.num_layers):
        for name in ("o", "down"):
            rank = spec.rank(name, layer)
            nbytes = batch * (spec.hidden if rank is None else rank) * size
            total += collective_costs.collective_us("all_reduce", nbytes, ranks, links)
    return total + collective_costs.collective_us("all_gather", batch * spec.vocab * size, ranks, links)


def tensor_parallel_bound_us(spec: DecodeSpec, batch: int, cache_len: int, target: str) -> float:
    """The physical bound of one rank's step (µs): its must-move bytes at the core's peak DMA rate, or its
    collectives on the links (collective_floor_us) where those take longer; the weights can stream in while a
    collective runs, so the two overlap at best."""
    need = traffic.must_move_bytes(spec, batch, cache_len, itemsize=BF16.itemsize)
    return max(roofline_us(0, need, target), collective_floor_us(spec, batch, target))


TP_COMPOSITIONS = ("per_op", "per_layer", "looped")


def peak_fraction(nbytes: float, latency_us: float, target: str) -> float:
    """nbytes ÷ latency ÷ the core's peak DMA-to-HBM rate (min of its HBM share and its 16 DMA engines)."""
    return roofline_us(0, nbytes, target) / latency_us


@dataclasses.dataclass
class Measured:
    """One composition at one shape: modeled µs of its launches per target (overhead excluded), launches, HBM
    bytes the kernels moved. `extrapolated` names the layer counts traced when not traced at full depth."""

    kernel_us: dict  # target -> sum of launch latencies (µs); a target missing: did not run there
    launches: float
    hbm_bytes: float
    head_us: dict = dataclasses.field(default_factory=dict)  # target -> µs of the LM-head launch (per_layer only)
    extrapolated: tuple = ()
    note: str = ""
    collective_us: dict = dataclasses.field(default_factory=dict)  # target -> µs in collectives (tensor parallel)
    # target -> µs of the same launches with unlimited DMA and link bandwidth (cost_model.dependency_floor_us;
    # looped cases of measure_spec only, else empty)
    floor_us: dict = dataclasses.field(default_factory=dict)
    # target -> speed_bands.band_latencies of the step (µs at the fitted cost terms and at the band's corners, the
    # fixed step cost included once; measure_spec(..., bands=True) only, else empty)
    band_us: dict = dataclasses.field(default_factory=dict)
    # target -> band_latencies of the LM-head launch alone, without the fixed step cost (cases with one, of
    # measure_spec(..., bands=True) only: the nkilib peer's step adds per_layer's to its own band)
    head_band_us: dict = dataclasses.field(default_factory=dict)

    def has_bands(self) -> bool:
        """Whether every target it ran on has its band (and, where it has an LM-head launch, that launch's)."""
        return set(self.kernel_us) <= set(self.band_us) and set(self.head_us) <= set(self.head_band_us)

    def latency_us(self, target: str, overhead_us: float) -> float | None:
        """Modeled µs with overhead_us per launch; None when it did not run on `target`."""
        if target not in self.kernel_us:
            return None
        return self.kernel_us[target] + self.launches * launch.check_launch_overhead(overhead_us)

    @classmethod
    def from_runs(
        cls,
        runs_by_target: dict,
        note: str = "",
        floor: bool = False,
        bands: dict | None = None,
        head_bands: dict | None = None,
    ) -> Measured:
        """floor: the runs were profiled with their dependency floor (profiled(..., dependency_floor=True)); bands,
        head_bands: the band_us and head_band_us fields."""
        first = next(iter(runs_by_target.values()))
        head = {
            t: sum(r.latency_us[t] for r in runs if r.name == "lm_head_kernel") for t, runs in runs_by_target.items()
        }
        return cls(
            {t: launch.composition_latency_us(runs, t, 0.0) for t, runs in runs_by_target.items()},
            len(first),
            sum(r.hbm_bytes_read + r.hbm_bytes_written for r in first),
            {t: us for t, us in head.items() if us},
            note=note,
            collective_us={t: sum(r.collective_us[t] for r in runs) for t, runs in runs_by_target.items()},
            floor_us={t: sum(r.dependency_floor_us[t] for r in runs) for t, runs in runs_by_target.items()}
            if floor
            else {},
            band_us=bands or {},
            head_band_us=head_bands or {},
        )


def extrapolate(m1: Measured, l1: int, m2: Measured, l2: int, layers: int) -> Measured:
    """Linear in L through (l1, m1) and (l2, m2), evaluated at `layers`."""

    def at(a, b):
        return a + (b - a) * (layers - l1) / (l2 - l1)

    return Measured(
        {t: at(m1.kernel_us[t], m2.kernel_us[t]) for t in m1.kernel_us if t in m2.kernel_us},
        at(m1.launches, m2.launches),
        at(m1.hbm_bytes, m2.hbm_bytes),
        {t: m2.head_us[t] for t in m2.head_us},
        extrapolated=(l1, l2),
        note="; ".join(dict.fromkeys(n for n in (m1.note, m2.note) if n)),
        collective_us={
            t: at(m1.collective_us[t], m2.collective_us[t]) for t in m1.collective_us if t in m2.collective_us
        },
        floor_us={t: at(m1.floor_us[t], m2.floor_us[t]) for t in m1.floor_us if t in m2.floor_us},
        band_us={
            t: {
                "fitted": at(m1.band_us[t]["fitted"], m2.band_us[t]["fitted"]),
                "corners": [at(a, b) for a, b in zip(m1.band_us[t]["corners"], m2.band_us[t]["corners"])],
            }
            for t in m1.band_us
            if t in m2.band_us
        },
        head_band_us=dict(m2.head_band_us),
    )


def profiled(fn, target: str, dependency_floor: bool = False, records: list | None = None) -> list:
    """The profiled runs of fn() on the emulator in count-only mode on `target` (with each run's dependency floor
    when dependency_floor is set); `records`, when given, receives rank 0's kernel runs with their instruction
    records (to schedule again at other cost terms)."""

    def keep(run):
        if run.rank == 0:
            records.append(run)

    if records is not None:
        trace.add_listener(keep)
    try:
        with emulator.use_target(target), emulator.count_only(), emulator.profile(dependency_floor) as prof:
            fn()
    finally:
        if records is not None:
            trace.remove_listener(keep)
    return prof.runs


def describe_error(error: Exception) -> str:
    """A one-line description of why a case did not run, for the reports' notes."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:150]}"


def measure_spec(spec: DecodeSpec, composition: str, batch: int, cache_len: int, bands: bool = False) -> Measured:
    """One composition of our kernels at `spec`'s depth, count-only, on each target (a target where it fails is
    named in the note). A tensor-parallel spec (one rank's shard) runs on spec.tensor_parallel ranks at once
    (collectives priced by the cost model's link model) and is measured on rank 0 (every rank runs the same
    shapes): one rank's latency, HBM bytes and time in collectives. A looped case also has its dependency floor
    (Measured.floor_us); with `bands`, the step at the fitted cost terms and the band's corners (Measured.band_us,
    nki_kernels.emulator.speed_bands)."""
    if composition.startswith("per_op"):  # they read each weight on its own: packed weights are not their layout
        spec = unpacked_spec(spec)
    operands = operand_specs(spec, batch, cache_len)
    floor = composition == "looped"

    def step():
        if spec.tensor_parallel == 1:
            run_decode_step(composition, operands, spec, numerics=False)
        else:
            run_sharded_decode_step(composition, [operands] * spec.tensor_parallel, spec, numerics=False)

    runs, failures, band_us, head_band_us = {}, [], {}, {}
    for t in TARGETS:
        records = [] if bands else None
        try:
            runs[t] = [run for run in profiled(step, t, floor, records) if run.rank == 0]
        except Exception as error:  # noqa: BLE001 - a limit of this target or shape: reported, the rest stands
            failures.append(f"{t}: {describe_error(error)}")
            continue
        if bands:
            band_us[t] = speed_bands.band_latencies(
                lambda terms, t=t, records=records: speed_bands.step_us(records, t, terms), fitted_terms(t)
            )
            head = [run for run in records if run.name == "lm_head_kernel"]
            if head:
                head_band_us[t] = speed_bands.band_latencies(
                    lambda terms, t=t, head=head: speed_bands.step_us(head, t, terms) - terms.step_fixed_us,
                    fitted_terms(t),
                )
    note = "did not run on " + "; ".join(failures) if failures else ""
    if not runs:
        return Measured({}, 0, 0.0, note=note)
    return Measured.from_runs(runs, note=note, floor=floor, bands=band_us, head_bands=head_band_us)


def traced_layers(model: DecodeModel, extrapolated: bool) -> tuple[int, ...]:
    """The layer counts to trace: all of them, or one and two repeats of the layer pattern to extrapolate from."""
    if not extrapolated or 2 * model.layer_period >= model.num_layers:
        return (model.num_layers,)
    return (model.layer_period, 2 * model.layer_period)


def measure_depths(measure, model: DecodeModel, depths: tuple[int, ...]) -> Measured:
    """measure(layers) at full depth, or extrapolated linearly from the two traced depths."""
    if depths == (model.num_layers,):
        return measure(model.num_layers)
    (l1, l2) = depths
    return extrapolate(measure(l1), l1, measure(l2), l2, model.num_layers)


def measure_model(
    model: DecodeModel, composition: str, batch: int, cache_len: int, extrapolated: bool, bands: bool = False
) -> Measured:
    """One composition at `model`'s spec as it is (its ranks, head rank and fp8 weights), at full depth or
    (extrapolated) from traces of one and two repeats of its layer pattern (`bands`: as measure_spec)."""
    return measure_depths(
        lambda layers: measure_spec(cut_layers(model.spec, layers), composition, batch, cache_len, bands),
        model,
        traced_layers(model, extrapolated),
    )


def nkilib_shards(model: DecodeModel) -> tuple[int, int, int]:
    """(calls, head_dim, intermediate per call) for nkilib's transformer_tkg at `model`'s shape: one call per KV
    head (the kernel takes one), as tensor-parallel shards run back to back on one core; a head dimension above 128
    is split into 128-wide heads (the same weight and cache bytes and matmul flops; more softmax rows)."""
    split = max(1, model.head_dim // NKILIB_MAX_HEAD_DIM)
    if model.head_dim % split or model.head_dim // split > NKILIB_MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {model.head_dim}: nkilib needs a head dim <= {NKILIB_MAX_HEAD_DIM} or a multiple of it"
        )
    calls = model.num_kv_heads * split
    if model.intermediate % calls:
        raise ValueError(f"intermediate {model.intermediate} does not split over {calls} nkilib calls")
    return calls, model.head_dim // split, model.intermediate // calls


@dataclasses.dataclass
class Results:
    ours: dict  # (model, compressed, batch, cache_len, composition) -> Measured
    nkilib: dict  # (model, batch, cache_len) -> Measured (layers only)
    nkilib_status: str  # which checkout ran, or why the peer is missing
    extrapolation_check: list  # (composition, compressed, batch, S, full Measured, extrapolated Measured)
    models: list
    nkilib_one_call: list = dataclasses.field(default_factory=list)  # (model, b, S, one call, one-layer calls)

    def nkilib_step_us(self, model, batch, cache_len, target, overhead_us) -> float | None:
        """The peer's whole step: its layers + our dense LM-head launch (the same head time as ours), or None."""
        peer = self.nkilib.get((model, batch, cache_len))
        ours = self.ours.get((model, False, batch, cache_len, "per_layer"))
        if peer is None or target not in peer.kernel_us or ours is None or target not in ours.head_us:
            return None
        return peer.latency_us(target, overhead_us) + ours.head_us[target] + launch.check_launch_overhead(overhead_us)

    def nkilib_step_band(self, model, batch, cache_len, target) -> dict | None:
        """nkilib_step_us's step as band_latencies (its layers' band, the fixed step cost once, + our LM-head
        launch's band, corner by corner), or None where either has no band on `target`."""
        peer = self.nkilib.get((model, batch, cache_len))
        ours = self.ours.get((model, False, batch, cache_len, "per_layer"))
        if peer is None or ours is None or target not in peer.band_us or target not in ours.head_band_us:
            return None
        layers, head = peer.band_us[target], ours.head_band_us[target]
        return {
            "fitted": layers["fitted"] + head["fitted"],
            "corners": [a + b for a, b in zip(layers["corners"], head["corners"])],
        }


def where(compressed: bool) -> str:
    """A target cell's name for the model variant."""
    return "compressed" if compressed else "dense"


def bound_cells(res: Results, t: str, batch: int = 1) -> dict:
    """{target key: text} of the physical upper bound at 0 µs per launch of each ratio target on `t`, at the shape
    where it is lowest: other ÷ looped ≤ other's latency ÷ latency at peak (must-move bytes at the peak rate: a
    looped kernel at 100% of peak), and compressed ÷ dense looped ≤ dense ÷ compressed must-move bytes (both at
    peak). A bound under the goal means no looped kernel can meet the target at that shape."""
    model_of = {m.name: m for m in res.models}
    shapes = sorted({(k[0], k[3]) for k in res.ours if k[2] == batch})
    gemma = [(m, s) for m, s in shapes if model_of[m].gemma3]

    def text(bounds, goal, describe):
        if not bounds:
            return "–"
        b = min(bounds)
        return f"≤ {b[0]:.3f}x ({describe(b)}){': unreachable' if b[0] < goal else ''}"

    cells = {}
    for other, goal in (("per_op", OVER_PER_OP), ("per_layer", OVER_PER_LAYER)):
        bounds = []
        for m, s in gemma:
            for c in (False, True):
                us = res.ours[(m, c, batch, s, other)].latency_us(t, 0.0)
                if us is not None:
                    bounds.append((us / roofline_us(0, must_move_bytes(model_of[m], c, batch, s), t), s, c))
        cells[other] = text(bounds, goal, lambda b: f"S {b[1]}, {where(b[2])}")
    bounds = [
        (must_move_bytes(model_of[m], False, batch, s) / must_move_bytes(model_of[m], True, batch, s), m, s)
        for m, s in shapes
    ]
    cells["compressed"] = text(bounds, COMPRESSED_OVER_DENSE, lambda b: f"{b[1]}, S {b[2]}")
    return cells


def target_rows(res: Results, batch: int = 1) -> list[tuple[str, str, dict, str]]:
    """(target, hardware, {overhead: (met, worst value text)}, bound text) for each of the looped kernel's targets
    on batch-1 shapes; the bound (bound_cells) only for ratio targets, else "–".
    """
    rows = []
    keys = [k for k in res.ours if k[2] == batch]
    shapes = sorted({(k[0], k[3]) for k in keys}, key=lambda x: (x[0], x[1]))
    model_of = {m.name: m for m in res.models}
    for t in TARGETS:
        cells = {name: {} for name in ("peak", "per_op", "per_layer", "compressed", "nkilib_c", "nkilib_d")}
        for o in launch.LAUNCH_OVERHEAD_SWEEP_US:

            def lat(m, c, s, comp):
                return res.ours[(m, c, batch, s, comp)].latency_us(t, o)

            def worst(name, values, met, text):
                """The smallest of values [(value, *where)] (None values: a composition that did not run)."""
                ran = [v for v in values if v[0] is not None]
                if ran:
                    w = min(ran)
                    missing = len(values) - len(ran)
                    status = (
                        "NOT met"
                        if not met(w[0])
                        else f"met where it ran ({missing} shape(s) did not)"
                        if missing
                        else "met"
                    )
                    cells[name][o] = (status, text(w))

            def ratio(slow, fast):
                return None if slow is None or fast is None else slow / fast

            worst(
                "peak",
                [
                    (
                        None
                        if lat(m, c, s, "looped") is None
                        else peak_fraction(must_move_bytes(model_of[m], c, batch, s), lat(m, c, s, "looped"), t),
                        m,
                        s,
                        c,
                    )
                    for m, s in shapes
                    for c in (False, True)
                ],
                lambda v: v >= PEAK_FRACTION,
                lambda w: f"{100 * w[0]:.0f}% ({w[1]}, S {w[2]}, {where(w[3])})",
            )
            gemma = [(m, s) for m, s in shapes if model_of[m].gemma3]
            for other, goal in (("per_op", OVER_PER_OP), ("per_layer", OVER_PER_LAYER)):
                worst(
                    other,
                    [
                        (ratio(lat(m, c, s, other), lat(m, c, s, "looped")), s, c)
                        for m, s in gemma
                        for c in (False, True)
                    ],
                    lambda v, goal=goal: v >= goal,
                    lambda w: f"{w[0]:.3f}x (S {w[1]}, {where(w[2])})",
                )
            worst(
                "compressed",
                [(ratio(lat(m, False, s, "looped"), lat(m, True, s, "looped")), m, s) for m, s in shapes],
                lambda v: v >= COMPRESSED_OVER_DENSE,
                lambda w: f"{w[0]:.3f}x ({w[1]}, S {w[2]})",
            )
            peer = [(res.nkilib_step_us(m, batch, s, t, o), m, s) for m, s in shapes]
            if any(us is not None for us, _, _ in peer):
                worst(
                    "nkilib_c",
                    [(ratio(us, lat(m, True, s, "looped")), m, s) for us, m, s in peer],
                    lambda v: v > 1.0,
                    lambda w: f"{w[0]:.2f}x ({w[1]}, S {w[2]})",
                )
                worst(
                    "nkilib_d",
                    [(ratio(us, lat(m, False, s, "looped")), m, s) for us, m, s in peer],
                    lambda v: v >= 1 / WITHIN_NKILIB,
                    lambda w: f"{w[0]:.2f}x ({w[1]}, S {w[2]})",
                )
        bounds = bound_cells(res, t, batch)
        rows += [
            (f"looped ≥ {PEAK_FRACTION:.0%} of peak bandwidth (worst batch-1 shape)", t, cells["peak"], "–"),
            (
                f"looped ≥ {OVER_PER_OP}x faster than per_op on Gemma 3 270M (worst S)",
                t,
                cells["per_op"],
                bounds["per_op"],
            ),
            (
                f"looped ≥ {OVER_PER_LAYER}x faster than per_layer on Gemma 3 270M (worst S)",
                t,
                cells["per_layer"],
                bounds["per_layer"],
            ),
            (
                f"compressed looped ≥ {COMPRESSED_OVER_DENSE}x faster than dense looped (worst shape)",
                t,
                cells["compressed"],
                bounds["compressed"],
            ),
            (
                "compressed looped faster than the nkilib megakernel at every shape (peer ÷ ours, worst)",
                t,
                cells["nkilib_c"],
                "–",
            ),
            (
                f"dense looped within {WITHIN_NKILIB - 1:.0%} of the nkilib megakernel or faster (peer ÷ ours ≥ "
                f"{1 / WITHIN_NKILIB:.3f}, worst)",
                t,
                cells["nkilib_d"],
                "–",
            ),
        ]
    return rows


def targets_table(res: Results) -> list[str]:
    sweep = launch.LAUNCH_OVERHEAD_SWEEP_US
    lines = [
        "| target (batch 1) | hw | bound at 0 µs/launch (looped at 100% of peak; lowest shape) "
        + "".join(f"| {o:g} µs/launch " for o in sweep)
        + "|",
        "|---|---|---|" + "---|" * len(sweep),
    ]
    for name, t, cells, bound in target_rows(res):
        if not cells:
            why = "| not evaluated (no peer figure) "
            lines.append(f"| {name} | {t} | {bound} " + why * len(sweep) + "|")
            continue
        lines.append(f"| {name} | {t} | {bound} " + "".join(f"| {cells[o][0]}: {cells[o][1]} " for o in sweep) + "|")
    return lines
