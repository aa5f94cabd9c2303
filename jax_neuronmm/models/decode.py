"""A CausalLM's decode steps through the `decode_step` primitive (every layer, final norm and LM head in one op).

    plan = decode_plan(model)                  # None: the model is not covered (see `unsupported_reason`)
    weights = stack_weights(model, plan)       # once per generate call: [L, ...] stacks, head = embedding.T,
                                               # the packed fp8 attention factors (spec.packed_weights)
    logits, cache = decode(model, plan, weights, token_ids, positions, cache)   # per step, under jit

Sliding-window masks become the spec's `mask_windows` (the kernels read only the window's slots); generate widens
them by the pad slots among a row's tokens (`widen_windows(plan, pad_slots(token_mask))`).

Tensor-parallel models (Megatron layout over one mesh axis) decode one decode_step per rank
(`TensorParallel`, `tensor_parallel_fallback_reason` for layouts that keep the model's own forward).
`model_spec(model)` is the DecodeSpec of a covered model, raising what is not covered. What is covered and how the
tensor-parallel plan places weights and cache: docs/decode_step.md ("Models through the decode step").
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jax_neuronmm import decoder_math, explicit_sharding
from jax_neuronmm.decode_step import decode_step
from jax_neuronmm.decode_step_operands import operand_treedef
from jax_neuronmm.decode_step_parallel import (
    tensor_parallel_decode_step,
    tensor_parallel_partition_specs,
    tensor_parallel_spec,
)
from jax_neuronmm.models.decoder import CausalLM, KVCache
from jax_neuronmm.models.layers import GatedMLP, RopeConfig, attention_mask, rope_tables
from jax_neuronmm.nn.nnx import SVDMLP, Linear, SVDLinear
from jax_neuronmm.weights import WeightFormat
from nki_kernels.activations import FUSED_ACTIVATIONS, HF_ACTIVATIONS
from nki_kernels.decode.contract import (
    PROJECTIONS,
    SPLIT_ROWS,
    DecodeOperands,
    DecodeShapes,
    DecodeSpec,
    Factored,
    ModelVariant,
    Quantized,
    WeightStorage,
    dense_as_factors,
)
from nki_kernels.decode.packing import attention_packing, pack_weights

ATTENTION = ("q", "k", "v", "o")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Megatron shards of a model's decode weights: over mesh axis `axis` (a name, or a tuple of names) of
    `mesh`."""

    mesh: jax.sharding.Mesh
    axis: str | tuple[str, ...]

    @property
    def ranks(self) -> int:
        return math.prod(self.mesh.shape[name] for name in self._names)

    @property
    def _names(self) -> tuple[str, ...]:
        return self.axis if isinstance(self.axis, tuple) else (self.axis,)

    def batch_axis(self, rows: int) -> str | tuple[str, ...] | None:
        """The mesh's other axes (of size > 1), which split a decode step's `rows` rows when their sizes' product
        divides it (each group of ranks decodes its rows); None when there are none or they do not divide it."""
        others = tuple(name for name in self.mesh.axis_names if name not in self._names and self.mesh.shape[name] > 1)
        if not others or rows % math.prod(self.mesh.shape[name] for name in others):
            return None
        return others[0] if len(others) == 1 else others


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """What a model's decode step is specialized on (hashable: a static jit argument).

    ropes[i]: the RoPE config of table i (spec.layer_rope indexes it); windows[i]: the sliding window (None =
    full causal) of mask i (spec.layer_mask indexes it). spec is the whole model's (tensor_parallel 1; with
    tensor_parallel its packed_weights are () and its KV heads `megatron_spec`'s, maybe repeated); tensor_parallel:
    where its weights are Megatron shards (decode runs one decode_step per rank), or None.
    """

    spec: DecodeSpec
    ropes: tuple[RopeConfig, ...]
    windows: tuple[int | None, ...]
    tensor_parallel: TensorParallel | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeWeights:
    """A model's weights as `decode_step` takes them: norms [L, NN, H], qk_norms [L, 2, D] or None,
    projections (one per name in PROJECTIONS: dense [L, K, N] or (u [L, K, Rmax], v [L, Rmax, N]); fp8 ones a
    Quantized(w [L, K, N], scale [L, N]) or Factored(u, v, u_scale [L, Rmax], v_scale [L, N]); one named in
    spec.packed_weights a Factored(None, None, u_scale, v_scale)), final_norm [H], head dense [H, V],
    (u [H, r], v [r, V]), Quantized or Factored; packed [L, 128, E] float8_e4m3fn, the values of spec.packed_weights
    in the kernels' layout (`nki_kernels.decode.packing.pack_weights`), or None when the spec packs none."""

    norms: jax.Array
    qk_norms: jax.Array | None
    projections: tuple
    final_norm: jax.Array
    head: jax.Array | tuple
    packed: jax.Array | None


def _projection_modules(layer):
    attn, mlp = layer.self_attn, layer.mlp
    modules = {name: getattr(attn, f"{name}_proj") for name in ATTENTION}
    modules.update({name: getattr(mlp, f"{name}_proj") for name in ("gate", "up", "down")})
    return modules


def _activation(mlp):
    if isinstance(mlp, SVDMLP):
        return mlp.activation
    if isinstance(mlp, GatedMLP):
        return HF_ACTIVATIONS.get(mlp.activation)
    return None


def unsupported_reason(model: CausalLM) -> str | None:
    """Why `model`'s decode steps cannot run as one `decode_step`, or None when they can."""
    layers = list(model.layers)
    for index, layer in enumerate(layers):
        for name, module in _projection_modules(layer).items():
            if not isinstance(module, _PROJECTION_TYPES):
                return f"layer {index} {name}_proj is a {type(module).__name__}"
            if module.bias is not None:
                return f"layer {index} {name}_proj has a bias (the decode-step kernels have none)"
            if _fp8(module) != _fp8(_projection_modules(layers[0])[name]):
                fp8_layer, other = (0, index) if not _fp8(module) else (index, 0)
                return f"{name}_proj is fp8 in layer {fp8_layer} but not in layer {other} (fp8 in every layer or none)"
        if _activation(layer.mlp) not in FUSED_ACTIVATIONS:
            return f"layer {index}: MLP activation {getattr(layer.mlp, 'activation', None)!r} is not fused"
    norms = [norm for layer in layers for norm in layer.norms()] + [model.norm]
    norms += [n for layer in layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm) if n is not None]
    if len({(n.eps, n.unit_offset) for n in norms}) != 1:
        return "the norms differ in eps or unit offset"
    specs = model.attention_specs()
    if len({(s.num_heads, s.num_kv_heads, s.head_dim, s.scaling, s.logit_softcap) for s in specs}) != 1:
        return "the layers' attention differs in heads, head_dim, scaling or soft-capping"
    if len({layer.sandwich for layer in layers}) != 1 or len({_activation(layer.mlp) for layer in layers}) != 1:
        return "the layers differ in norm placement or activation"
    if len({(layer.self_attn.q_norm is None) for layer in layers}) != 1:
        return "some layers have QK-norm and some do not"
    if model.lm_head is not None and (
        not isinstance(model.lm_head, _PROJECTION_TYPES) or model.lm_head.bias is not None
    ):
        return "the LM head is not a bias-free linear layer"
    return None


def decode_plan(model: CausalLM) -> DecodePlan | None:
    """The `DecodePlan` of `model`, or None when `unsupported_reason(model)` names what the kernels lack, or when
    its parameters are split over a mesh in a layout the tensor-parallel step does not take
    (`tensor_parallel_fallback_reason`: generate then decodes through the model's own forward, which the SPMD
    partitioner runs in any layout). With parameters split in the Megatron layout it carries their mesh axis
    (`tensor_parallel_layout`), packs no weights, and repeats each KV head on the ranks that share it when the KV
    heads do not split over them (`megatron_spec`). Else its spec packs the weights `attention_packing` picks (fp8
    factored attention whose packed row of a layer fits one weight-ring block)."""
    if unsupported_reason(model) is not None:
        return None
    plan, _ = _plan_or_reason(model)
    return plan


def tensor_parallel_fallback_reason(model: CausalLM) -> str | None:
    """Why `model`, whose parameters are split over a mesh, decodes through its own forward and not the
    tensor-parallel decode step (a projection split along another dim than Megatron's, over several axes, or sizes
    that do not split over the ranks), or None when it does not (covered: see `decode_plan`)."""
    if unsupported_reason(model) is not None:
        return None
    return _plan_or_reason(model)[1]


def _plan_or_reason(model: CausalLM) -> tuple[DecodePlan | None, str | None]:
    """(plan, None), or (None, why) when the parameters are split in a layout the tensor-parallel step does not
    take; for a model `unsupported_reason` accepts."""
    specs, whole = model.attention_specs(), _spec(model)
    try:  # only the layout's checks: their ValueErrors name why the Megatron step does not take it
        layout = tensor_parallel_layout(model)
        spec = None if layout is None else megatron_spec(whole, layout.ranks)
    except ValueError as error:
        return None, str(error)
    if spec is None:
        spec = _one_device_spec(whole)
    return DecodePlan(spec, tuple(dict.fromkeys(s.rope for s in specs)), _windows(model), layout), None


def _one_device_spec(spec: DecodeSpec) -> DecodeSpec:
    """A model's `spec` on one device: the weights `attention_packing` picks packed."""
    return spec.replace(packed_weights=attention_packing(spec, fp8_only=True))


def megatron_spec(spec: DecodeSpec, ranks: int) -> DecodeSpec:
    """The whole-model spec whose Megatron shards over `ranks` ranks the tensor-parallel step runs: `spec` when its
    KV heads split over the ranks; when the ranks are a multiple of the KV heads that divides the query heads (Gemma
    3 270M: 1 KV head), each KV head repeated on the ranks that split its query heads (num_kv_heads = ranks: every
    rank holds one copy and its own cache of it, as NxD Inference does; GQA groups are consecutive, so query head h
    still reads a copy of its own KV head). ValueError naming the size that does not split (the vocabulary need
    not: tensor_parallel_decode_step pads the head)."""
    kv, heads = spec.num_kv_heads, spec.num_heads
    if kv % ranks and not ranks % kv and not heads % ranks:
        spec = spec.replace(num_kv_heads=ranks)
    try:
        tensor_parallel_spec(spec.replace(vocab=spec.vocab * ranks), ranks)
    except ValueError as error:
        raise ValueError(
            f"decode_plan: the model does not split into {ranks} Megatron shards (KV heads replicate only over a "
            f"multiple of them that divides the query heads): {error}"
        ) from None
    return spec


def _megatron_dims(module, name: str) -> tuple[tuple[str, int | None], ...]:
    """(parameter, the dim Megatron shards split or None for whole) of a projection module: o and down split their
    input rows (a kernel's dim 0, u's dim 0), the others their output columns (a kernel's dim 1, v's dim 1, and
    with fp8 the scales of those columns: kernel_scale, v_scale; u_scale goes with the rank, whole)."""
    rows = name in SPLIT_ROWS
    if isinstance(module, SVDLinear):
        dims = (("u", 0 if rows else None), ("v", None if rows else 1))
        return dims + ((("u_scale", None), ("v_scale", None if rows else 0)) if _fp8(module) else ())
    dims = (("kernel", 0 if rows else 1),)
    return dims + ((("kernel_scale", None if rows else 0),) if _fp8(module) else ())


def tensor_parallel_layout(model: CausalLM) -> TensorParallel | None:
    """Where `model`'s projections and untied LM head are split in the Megatron layout (q/k/v/gate/up and the head
    by output columns, o and down by input rows; any of them may be whole): their mesh and axis, or None when
    none is split (single device, or replicated). ValueError naming a parameter split along another dim, or over
    another mesh or axis than the rest."""
    modules = [
        (f"layers/{index}/{name}_proj", name, module)
        for index, layer in enumerate(model.layers)
        for name, module in _projection_modules(layer).items()
    ]
    if model.lm_head is not None:
        modules.append(("lm_head", "head", model.lm_head))
    found = {}  # (mesh, axes) -> the first parameter split so
    for where, name, module in modules:
        for part, dim in _megatron_dims(module, name):
            param = getattr(module, part)
            value = param.get_value() if isinstance(param, nnx.Variable) else param  # abstract (eval_shape) too
            sharding = getattr(value, "sharding", None)
            if not isinstance(sharding, NamedSharding):
                continue
            entries = tuple(sharding.spec) + (None,) * (len(value.shape) - len(sharding.spec))
            for d, axes in enumerate(entries):
                axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
                if not axes or math.prod(sharding.mesh.shape[a] for a in axes) == 1:
                    continue
                if d != dim:
                    expected = (
                        "whole"
                        if dim is None
                        else f"split along dim {dim} ({'rows' if name in SPLIT_ROWS else 'output columns'})"
                    )
                    raise ValueError(
                        f"decode_plan: {where}/{part} is split along dim {d} over mesh axes {axes} (spec "
                        f"{sharding.spec}); the tensor-parallel decode step takes Megatron shards, where it is "
                        f"{expected}"
                    )
                found.setdefault((sharding.mesh, axes), f"{where}/{part}")
    if not found:
        return None
    if len(found) > 1:
        listing = "; ".join(f"{where} over {axes} of mesh {dict(mesh.shape)}" for (mesh, axes), where in found.items())
        raise ValueError(
            f"decode_plan: the projections are split over different meshes or axes ({listing}); expected one "
            "tensor-parallel axis for all of them"
        )
    ((mesh, axes),) = found
    return TensorParallel(mesh, axes[0] if len(axes) == 1 else axes)


def model_spec(model: CausalLM) -> DecodeSpec:
    """The DecodeSpec of `model`'s decode step, `decode_plan(model).spec` (the weights `quantize_model` made fp8
    named in its fp8_weights, those `attention_packing` picks in its packed_weights unless the model is split in
    Megatron shards; one device's spec when they are split in another layout): what the decode step's modeled cost
    depends on (benchmarks/harness/comparison.py's measure_spec traces it). ValueError naming what the kernels lack
    (`unsupported_reason`), e.g. an fp8 weight in some layers only."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"model_spec: {reason}")
    plan = decode_plan(model)
    return _one_device_spec(_spec(model)) if plan is None else plan.spec


def _windows(model: CausalLM) -> tuple:
    return tuple(dict.fromkeys(s.sliding_window for s in model.attention_specs()))


def _spec(model: CausalLM) -> DecodeSpec:
    """The DecodeSpec of a model `unsupported_reason` accepts."""
    layers, specs, config = list(model.layers), model.attention_specs(), model.config
    ropes, windows = tuple(dict.fromkeys(s.rope for s in specs)), _windows(model)
    ranks, fp8_weights = [], []
    for name in PROJECTIONS:
        modules = [_projection_modules(layer)[name] for layer in layers]
        if any(isinstance(m, _FACTORED_TYPES) for m in modules):
            ranks.append(tuple(m.rank if isinstance(m, _FACTORED_TYPES) else None for m in modules))
        else:
            ranks.append(None)
        if _fp8(modules[0]):
            fp8_weights.append(name)
    if _fp8(model.lm_head):
        fp8_weights.append("head")
    first, attn = specs[0], layers[0].self_attn
    shapes = DecodeShapes(
        num_layers=len(layers),
        hidden=config.hidden_size,
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        intermediate=config.intermediate_size,
        vocab=config.vocab_size,
    )
    variant = ModelVariant(
        norm_eps=model.norm.eps,
        norm_unit_offset=model.norm.unit_offset,
        qk_norm=attn.q_norm is not None,
        sandwich=layers[0].sandwich,
        activation=_activation(layers[0].mlp),
        query_scaling=float(first.scaling),
        attn_logit_softcap=first.logit_softcap,
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
        layer_rope=tuple(ropes.index(s.rope) for s in specs),
        layer_mask=tuple(windows.index(s.sliding_window) for s in specs),
        # A row's cache slots hold consecutive positions (left padding, no padding): a window of W positions is
        # W slots (widen_windows when pad slots lie among a row's tokens).
        mask_windows=windows if any(w is not None for w in windows) else (),
    )
    storage = WeightStorage(
        ranks=tuple(ranks),
        head_rank=model.lm_head.rank if isinstance(model.lm_head, _FACTORED_TYPES) else None,
        fp8_weights=tuple(fp8_weights),
    )
    return DecodeSpec(shapes, variant, storage)


def preset_decode_spec(family: str, preset: str, **overrides) -> DecodeSpec:
    """The DecodeSpec of a preset's shape (`presets.from_preset(family, preset, **overrides)` built abstractly by
    nnx.eval_shape: no weights are allocated), dense, through `decode_plan`."""
    from jax_neuronmm.models.presets import from_preset

    model = nnx.eval_shape(lambda: from_preset(family, preset, dtype=jnp.bfloat16, **overrides))
    plan = decode_plan(model)
    if plan is None:
        raise ValueError(f"preset {family} {preset}: {unsupported_reason(model)}")
    return plan.spec


def pad_slots(token_mask) -> int:
    """The most pad slots lying after a row's first real token in a prompt's token_mask [B, T] (numpy bool, True =
    real): 0 for left padding or none, the pads between prompt and continuation for right padding."""
    after_first = np.cumsum(token_mask, axis=1) > 0
    return int((after_first & ~token_mask).sum(axis=1).max())


def widen_windows(plan: DecodePlan, pad_slots: int) -> DecodePlan:
    """`plan` for caches where up to pad_slots pad slots lie after a row's first real token (right padding: the
    pads between a prompt and its continuation): the kernels' sliding windows cover W + pad_slots slots, so every
    slot a window of W positions makes visible is still read."""
    if pad_slots < 0:
        raise ValueError(f"pad_slots: got {pad_slots}, expected >= 0")
    if not plan.spec.mask_windows or pad_slots == 0:
        return plan
    windows = tuple(None if w is None else w + pad_slots for w in plan.spec.mask_windows)
    return dataclasses.replace(plan, spec=plan.spec.replace(mask_windows=windows))


def _factors(name, module, dtype):
    """(u [K, r], v [r, N]) of projection `name`'s SVDLinear, or of a dense nnx.Linear exactly as a factored stack
    holds it (contract.dense_as_factors)."""
    if isinstance(module, SVDLinear):
        return module.u[...].astype(dtype), module.v[...].astype(dtype)
    return dense_as_factors(name, module.kernel[...].astype(dtype), jnp)


def _fp8_weight(name, module, factored: bool):
    """One fp8 module of projection `name` (or the head) as the contract stores it: Quantized(kernel,
    kernel_scale), or (factored) Factored(u, v, u_scale, v_scale) of an fp8 SVDLinear, or of an fp8 Linear exactly
    as a factored stack holds it (contract.dense_as_factors, u_scale ones and W's scales as v_scale: the identity
    and 1.0 are exact in fp8)."""
    if isinstance(module, SVDLinear):
        return Factored(module.u[...], module.v[...], module.u_scale[...], module.v_scale[...])
    kernel, scale = module.kernel[...], module.kernel_scale[...]
    if not factored:
        return Quantized(kernel, scale)
    u, v = dense_as_factors(name, kernel, jnp)
    return Factored(u, v, jnp.ones((u.shape[1],), scale.dtype), scale)


def _stack_fp8(name, modules, factored: bool):
    """The stacked fp8 weight of projection `name`'s modules: Quantized(w [L, K, N], scale [L, N]), or Factored
    with u [L, K, Rmax], v [L, Rmax, N], u_scale [L, Rmax], v_scale [L, N], zero padded to the widest layer."""
    weights = [_fp8_weight(name, m, factored) for m in modules]
    if not factored:
        return Quantized(jnp.stack([w.w for w in weights]), jnp.stack([w.scale for w in weights]))
    u, v = _stack_factors([(w.u, w.v) for w in weights])
    u_scale = jnp.stack([jnp.pad(w.u_scale, (0, u.shape[2] - w.u_scale.shape[0])) for w in weights])
    return Factored(u, v, u_scale, jnp.stack([w.v_scale for w in weights]))


def _stack_factors(pairs):
    """[(u [K, r_l], v [r_l, N])] -> (u [L, K, Rmax], v [L, Rmax, N]), zero padded to the widest layer."""
    rmax = max(u.shape[1] for u, _ in pairs)
    us = [jnp.pad(u, ((0, 0), (0, rmax - u.shape[1]))) for u, _ in pairs]
    vs = [jnp.pad(v, ((0, rmax - v.shape[0]), (0, 0))) for _, v in pairs]
    return jnp.stack(us), jnp.stack(vs)


def stack_weights(model: CausalLM, plan: DecodePlan) -> DecodeWeights:
    """The model's weights stacked over layers, in its dtype, the values of plan.spec.packed_weights moved into
    the packed operand (once per generate call, so the decode steps read them as they are; compiled once per model
    structure); with plan.tensor_parallel placed as the Megatron shards each decode step's ranks read, so a step
    moves no weights between devices."""
    weights = _stack_weights(model, plan)
    layout = plan.tensor_parallel
    if layout is None:
        return weights
    specs = jax.tree_util.tree_unflatten(
        operand_treedef(plan.spec), tensor_parallel_partition_specs(plan.spec, layout.axis)
    )

    def like(spec, weight):  # bf16 factors are a (u, v) tuple in DecodeWeights, fp8 ones a Factored
        return tuple(spec) if isinstance(weight, tuple) else spec

    shardings = DecodeWeights(
        norms=specs.norms,
        qk_norms=specs.qk_norms,
        projections=tuple(like(getattr(specs, n), w) for n, w in zip(PROJECTIONS, weights.projections)),
        final_norm=specs.final_norm,
        head=like(specs.head, weights.head),
        packed=None,  # Megatron shards pack no weights (decode_plan)
    )
    if plan.spec.vocab % layout.ranks:  # tensor_parallel_decode_step pads the head on every step, then splits it
        shardings.head = jax.tree_util.tree_map(lambda _: PartitionSpec(), shardings.head)
    shardings = jax.tree_util.tree_map(lambda spec: NamedSharding(layout.mesh, spec), shardings)
    return jax.device_put(weights, shardings)


def place_cache(plan: DecodePlan, cache: KVCache) -> KVCache:
    """With plan.tensor_parallel: the cache's keys and values split over their KV heads (and their rows over the
    mesh's other axes, `TensorParallel.batch_axis`) as the decode steps' ranks hold them (the rest replicated on the
    mesh), so every step gets and returns the same layout; else the cache unchanged."""
    layout = plan.tensor_parallel
    if layout is None:
        return cache
    copies = plan.spec.num_kv_heads // cache.keys.shape[3]
    if copies > 1:  # megatron_spec's replicated KV heads: a copy of each for every rank sharing it
        cache = dataclasses.replace(
            cache,
            keys=_repeat_kv_heads(cache.keys, copies, layout.mesh),
            values=_repeat_kv_heads(cache.values, copies, layout.mesh),
        )
    heads = NamedSharding(layout.mesh, PartitionSpec(None, layout.batch_axis(cache.keys.shape[1]), None, layout.axis))
    whole = NamedSharding(layout.mesh, PartitionSpec())
    return jax.device_put(cache, KVCache(heads, heads, whole, whole, whole))


@nnx.jit(static_argnums=(1,))
def _stack_weights(model: CausalLM, plan: DecodePlan) -> DecodeWeights:
    dtype, spec, layers = model.dtype, plan.spec, list(model.layers)
    projections = []
    for name, ranks in zip(PROJECTIONS, spec.ranks):
        modules = [_projection_modules(layer)[name] for layer in layers]
        if spec.fp8(name):
            projections.append(_stack_fp8(name, modules, factored=ranks is not None))
        elif ranks is None:
            projections.append(jnp.stack([m.kernel[...].astype(dtype) for m in modules]))
        else:
            projections.append(_stack_factors([_factors(name, m, dtype) for m in modules]))
    norms = jnp.stack([jnp.stack([n.weight[...].astype(dtype) for n in layer.norms()]) for layer in layers])
    qk_norms = None
    if spec.qk_norm:
        qk_norms = jnp.stack(
            [jnp.stack([layer.self_attn.q_norm.weight[...], layer.self_attn.k_norm.weight[...]]) for layer in layers]
        ).astype(dtype)
    if model.lm_head is None:
        head = model.embed_tokens.embedding[...].astype(dtype).T  # tied: transposed once per generate call
    elif spec.fp8("head"):
        head = _fp8_weight("head", model.lm_head, factored=spec.head_rank is not None)
    elif isinstance(model.lm_head, SVDLinear):
        head = (model.lm_head.u[...].astype(dtype), model.lm_head.v[...].astype(dtype))
    else:
        head = model.lm_head.kernel[...].astype(dtype)
    copies = spec.num_kv_heads // model.attention_specs()[0].num_kv_heads
    if copies > 1:  # megatron_spec's replicated KV heads: k's and v's columns of each head repeated
        for name in ("k", "v"):
            index = PROJECTIONS.index(name)
            projections[index] = _repeat_kv_columns(
                projections[index], copies, spec.head_dim, plan.tensor_parallel.mesh
            )
    packed = None
    if spec.packed_weights:  # their fp8 Factored stacks -> scales only, values in packed [L, 128, E]
        ops = pack_weights(DecodeOperands(**dict(zip(PROJECTIONS, projections))), spec, jnp)
        projections, packed = [getattr(ops, name) for name in PROJECTIONS], ops.packed
    return DecodeWeights(
        norms=norms,
        qk_norms=qk_norms,
        projections=tuple(projections),
        final_norm=model.norm.weight[...].astype(dtype),
        head=head,
        packed=packed,
    )


def _replicated(a, mesh):
    """`a` whole on every device of `mesh` where axes are Explicit (a reshape may not cut a split dim there)."""
    return explicit_sharding.typed_as(a, NamedSharding(mesh, PartitionSpec()))


def _repeat_kv_columns(weight, copies: int, head_dim: int, mesh):
    """A stacked k or v weight with each KV head's head_dim output columns repeated `copies` times in place
    (values, and an fp8 weight's column scales; u and u_scale unchanged)."""

    def repeat(a):
        a = _replicated(a, mesh)
        heads = a.reshape(a.shape[:-1] + (a.shape[-1] // head_dim, head_dim))
        return jnp.repeat(heads, copies, axis=-2).reshape(a.shape[:-1] + (a.shape[-1] * copies,))

    if isinstance(weight, tuple):
        return weight[0], repeat(weight[1])
    if isinstance(weight, Quantized):
        return Quantized(repeat(weight.w), repeat(weight.scale))
    if isinstance(weight, Factored):
        return dataclasses.replace(weight, v=repeat(weight.v), v_scale=repeat(weight.v_scale))
    return repeat(weight)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _repeat_kv_heads(cache, copies: int, mesh):
    """A cache [L, B, S, kv, D] with each KV head repeated `copies` times in place: [L, B, S, kv·copies, D]."""
    return jnp.repeat(_replicated(cache, mesh), copies, axis=3)


def step_tables(plan: DecodePlan, positions, key_positions, key_valid):
    """(cos, sin [NR, B, T, D] float32, mask_bias [NM, B, T, S] float32) of queries at positions [B, T] over the
    cache's key slots (key_positions, key_valid [B, S]), as `CausalLM.__call__` builds them."""
    head_dim = plan.spec.head_dim
    tables = [rope_tables(positions, rope, head_dim) for rope in plan.ropes]
    masks = [
        decoder_math.mask_bias(attention_mask(positions, key_positions, key_valid, window)) for window in plan.windows
    ]
    return jnp.stack([c for c, _ in tables]), jnp.stack([s for _, s in tables]), jnp.stack(masks)


def decode(model: CausalLM, plan: DecodePlan, weights: DecodeWeights, token_ids, positions, cache: KVCache):
    """`model(token_ids, positions=positions, cache=cache)` as one `decode_step`: (logits [B, T, V] float32,
    updated cache); token_ids, positions [B, T], all tokens real (decode steps have no padding). With
    plan.tensor_parallel: `tensor_parallel_decode_step` over its mesh axis (one decode_step per rank)."""
    layout = plan.tensor_parallel
    token_mask = jnp.ones(token_ids.shape, bool)
    key_valid, key_positions = cache.key_slots(positions, token_mask)
    cos, sin, bias = step_tables(plan, positions, key_positions, key_valid)
    step = (
        decode_step
        if layout is None
        else functools.partial(
            tensor_parallel_decode_step,
            mesh=layout.mesh,
            axis_name=layout.axis,
            batch_axis=layout.batch_axis(token_ids.shape[0]),
        )
    )
    logits, keys, values = step(
        x=model.embed(token_ids),
        norms=weights.norms,
        qk_norms=weights.qk_norms,
        **dict(zip(PROJECTIONS, weights.projections)),
        k_cache=cache.keys,
        v_cache=cache.values,
        write_index=jnp.reshape(cache.length, (1, 1)).astype(jnp.int32),
        cos=cos,
        sin=sin,
        mask_bias=bias,
        final_norm=weights.final_norm,
        head=weights.head,
        packed=weights.packed,
        spec=plan.spec,
    )
    if layout is not None:
        # Under Explicit mesh axes, logits typed split over the rows would carry that split into sampling and the
        # next step's embedding lookup: they leave whole (B x V floats), as without tensor parallelism.
        logits = explicit_sharding.typed_as(logits, NamedSharding(layout.mesh, PartitionSpec()))
    cache = KVCache(
        keys=keys,
        values=values,
        slot_valid=key_valid,
        slot_positions=key_positions,
        length=cache.length + token_ids.shape[1],
    )
    return logits, cache


def decode_weight_bytes(model, bytes_per_weight: int = 2) -> int:
    """Bytes of the weights one decode step reads (bf16 by default): every projection, dense or factored, and the
    LM head (the tied embedding's transpose when there is none). fp8 projections (`quantize_model`) count as stored:
    one byte per weight plus their float32 scales. The embedding lookup reads one row per token and the norms are
    small, so neither is counted."""
    total = 0
    for layer in model.layers:
        for module in (layer.self_attn, layer.mlp):
            for projection in vars(module).values():
                if isinstance(projection, _PROJECTION_TYPES):
                    total += _projection_bytes(projection, bytes_per_weight)
    head = model.lm_head
    if head is None:
        total += bytes_per_weight * model.embed_tokens.embedding[...].size
    else:
        total += _projection_bytes(head, bytes_per_weight)
    return total


_PROJECTION_TYPES = (nnx.Linear, SVDLinear, Linear)
_FACTORED_TYPES = (SVDLinear,)


def _fp8(module) -> bool:
    return isinstance(module, (Linear, SVDLinear)) and module.format is WeightFormat.FP8_E4M3


def _projection_bytes(projection, bytes_per_weight: int) -> int:
    factored = isinstance(projection, SVDLinear)
    if _fp8(projection):
        parts = ("u", "v", "u_scale", "v_scale") if factored else ("kernel", "kernel_scale")
        return sum(getattr(projection, part)[...].nbytes for part in parts)
    weights = (projection.u, projection.v) if factored else (projection.kernel,)
    return bytes_per_weight * sum(p[...].size for p in weights)
