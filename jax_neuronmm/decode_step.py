"""The `decode_step` primitive: one decode step over every decoder layer, then the final norm and the LM head.

    logits, k_cache, v_cache = decode_step(x, norms, qk_norms, q, k, v, o, gate, up, down, k_cache, v_cache,
                                           write_index, cos, sin, mask_bias, final_norm, head, spec=spec)

The operands are those of `nki_kernels.decode_step.decode_step_kernel` (layouts in the docstrings of
`nki_kernels.decode_step_kernels` and `nki_kernels.decode_spec`; `spec` is a `DecodeSpec`), with L = spec.num_layers:
  x [B, T, H] (embedded tokens), norms [L, 2 or 4, H], qk_norms [L, 2, D] or None,
  q, k, v, o, gate, up, down: each a dense [L, K, N] or a factored pair (u [L, K, Rmax], v [L, Rmax, N]), layer l
    using the first spec.ranks[...][l] columns / rows (the rest zeros),
  k_cache, v_cache [L, B, S, kv_heads, D] (this step's keys / values are written at slots
    [write_index, write_index + T)), write_index [1, 1] int32,
  cos, sin [NR, B, T, D] float32, rotate-half tables with duplicated halves (the kernel reads the first half; layer
    l reads table spec.layer_rope[l]), mask_bias [NM, B, T, S] float32
    (layer l reads spec.layer_mask[l]; with spec.mask_windows the kernels read only the window of slots ending at
    each query's slot, so the mask must hide every slot outside it), final_norm [H], head: dense [H, V] or a pair
    (u [H, r], v [r, V]).
Results: logits [B, T, V] float32 (final soft-cap applied), the updated k_cache and v_cache.

Backends: "xla" lowers to a `lax.scan` over the layers of `decoder_math.decoder_layer`, the same function the
models' layers call; "emulator" runs the looped NKI kernel (one launch per step) on the CPU emulator in a host
callback; "neuron" traces the same kernel call for Trainium. vmap over batch rows folds the rows into B (one
launch); a batched write_index or batched weights run as a `lax.map` of steps. Inference only: differentiating
it raises.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_neuronmm import decoder_math, lowering
from jax_neuronmm._compat import Primitive, ad, apply_primitive, batching
from jax_neuronmm.kernel_calls import KernelLaunches
from jax_neuronmm.svd_matmul import svd_matmul_ref
from jax_neuronmm.svd_mlp import svd_mlp_ref
from nki_kernels.decode_spec import PROJECTIONS, DecodeSpec
from nki_kernels.decode_step_kernels import OPERAND_NAMES, check_operands, decode_step_kernel

decode_step_p = Primitive("decode_step")
decode_step_p.multiple_results = True
decode_step_p.def_impl(functools.partial(apply_primitive, decode_step_p))

OP = "decode_step"
ROW_OPERANDS = {"x": 0, "k_cache": 1, "v_cache": 1, "cos": 1, "sin": 1, "mask_bias": 1}  # name -> its B axis


def decode_step(
    x,
    norms,
    qk_norms,
    q,
    k,
    v,
    o,
    gate,
    up,
    down,
    k_cache,
    v_cache,
    write_index,
    cos,
    sin,
    mask_bias,
    final_norm,
    head,
    *,
    spec: DecodeSpec,
):
    """One decode step over all layers; returns (logits [B, T, V] float32, k_cache, v_cache). See the module
    docstring for the operands; bad operands raise ValueError / TypeError naming the argument."""
    if not isinstance(spec, DecodeSpec):
        raise TypeError(f"{OP}: spec: got {type(spec).__name__}, expected a nki_kernels.decode_spec.DecodeSpec")
    named = {"x": x, "norms": norms}
    if spec.qk_norm:
        if qk_norms is None:
            raise ValueError(f"{OP}: qk_norms: got None, expected [L, 2, head_dim] since spec.qk_norm is set")
        named["qk_norms"] = qk_norms
    elif qk_norms is not None:
        raise ValueError(f"{OP}: qk_norms: expected None since spec.qk_norm is False")
    for name, weight in zip(PROJECTIONS, (q, k, v, o, gate, up, down)):
        named.update(_weight_operands(name, weight, spec.ranks[PROJECTIONS.index(name)] is not None))
    named.update(
        k_cache=k_cache,
        v_cache=v_cache,
        write_index=write_index,
        cos=cos,
        sin=sin,
        mask_bias=mask_bias,
        final_norm=final_norm,
    )
    named.update(_weight_operands("head", head, spec.head_rank is not None))
    operands = [jnp.asarray(a) for a in named.values()]
    named = _check_operands(operands, spec)
    try:  # a concrete write_index is checked here; a traced one when the step runs (check_write_index)
        index = np.asarray(named["write_index"])
    except jax.errors.TracerArrayConversionError:
        index = None
    if index is not None:
        check_write_index(index, slots=named["k_cache"].shape[2], tokens=named["x"].shape[1])
    return tuple(decode_step_p.bind(*operands, spec=spec))


def check_write_index(write_index, *, slots: int, tokens: int) -> None:
    """ValueError naming write_index unless this step's T tokens fit the S-slot cache at write_index.

    The XLA lowering and the emulator's launch call it when the step runs (as a host callback: the error reaches
    the caller wrapped in JAX's runtime error); `decode_step` calls it first on a concrete write_index.
    """
    index = int(np.asarray(write_index).reshape(-1)[0])
    if not 0 <= index <= slots - tokens:
        raise ValueError(
            f"{OP}: write_index: got {index}, expected 0 <= write_index <= S - T = {slots - tokens} (the step "
            f"writes its T = {tokens} tokens at cache slots [write_index, write_index + T) of S = {slots})"
        )


def _weight_operands(name, weight, factored):
    if factored:
        if not isinstance(weight, (tuple, list)) or len(weight) != 2:
            raise ValueError(
                f"{OP}: {name}: expected a factored pair (u, v) since the spec gives its ranks; got "
                f"{type(weight).__name__}"
            )
        return {f"{name}.u": weight[0], f"{name}.v": weight[1]}
    if isinstance(weight, (tuple, list)):
        raise ValueError(f"{OP}: {name}: got a pair, expected one dense array since the spec gives it no ranks")
    return {name: weight}


def operand_names(spec: DecodeSpec) -> tuple[str, ...]:
    """Names of the flat operands `decode_step_p` binds, in order (a factored projection gives two)."""
    names = ["x", "norms"] + (["qk_norms"] if spec.qk_norm else [])
    for name, ranks in zip(PROJECTIONS, spec.ranks):
        names += [f"{name}.u", f"{name}.v"] if ranks is not None else [name]
    names += ["k_cache", "v_cache", "write_index", "cos", "sin", "mask_bias", "final_norm"]
    names += ["head.u", "head.v"] if spec.head_rank is not None else ["head"]
    return tuple(names)


def expected_shapes(spec: DecodeSpec, batch: int, tokens: int, slots: int) -> dict:
    """{operand name: shape} for B = batch rows of T = tokens new tokens and S = slots cache slots."""
    s, L = spec, spec.num_layers
    shapes = {"x": (batch, tokens, s.hidden), "norms": (L, s.num_norms, s.hidden), "qk_norms": (L, 2, s.head_dim)}
    for name, ranks in zip(PROJECTIONS, s.ranks):
        k_in, n_out = s.in_features(name), s.out_features(name)
        if ranks is None:
            shapes[name] = (L, k_in, n_out)
        else:
            shapes[f"{name}.u"], shapes[f"{name}.v"] = (L, k_in, max(ranks)), (L, max(ranks), n_out)
    cache = (L, batch, slots, s.num_kv_heads, s.head_dim)
    shapes.update(
        k_cache=cache,
        v_cache=cache,
        write_index=(1, 1),
        cos=(s.num_rope_tables, batch, tokens, s.head_dim),
        sin=(s.num_rope_tables, batch, tokens, s.head_dim),
        mask_bias=(s.num_masks, batch, tokens, slots),
        final_norm=(s.hidden,),
    )
    if s.head_rank is None:
        shapes["head"] = (s.hidden, s.vocab)
    else:
        shapes["head.u"], shapes["head.v"] = (s.hidden, s.head_rank), (s.head_rank, s.vocab)
    return shapes


def _check_operands(operands, spec):
    """ValueError / TypeError naming the first operand whose shape or dtype the spec does not allow."""
    names = operand_names(spec)
    if len(operands) != len(names):
        raise TypeError(f"{OP}: got {len(operands)} operands, expected {len(names)}: {names}")
    named = dict(zip(names, operands))
    x, cache = named["x"], named["k_cache"]
    if x.ndim != 3 or cache.ndim != 5:
        bad = "x" if x.ndim != 3 else "k_cache"
        raise ValueError(
            f"{OP}: {bad}: got shape {tuple(named[bad].shape)}, expected "
            f"{'[B, T, hidden]' if bad == 'x' else '[L, B, S, kv_heads, head_dim]'}"
        )
    for bad, size, what in (
        ("x", x.shape[0], "B (rows)"),
        ("x", x.shape[1], "T (tokens)"),
        ("k_cache", cache.shape[2], "S (slots)"),
    ):
        if size < 1:
            raise ValueError(f"{OP}: {bad}: got shape {tuple(named[bad].shape)} with {what} = {size}, expected >= 1")
    if cache.shape[2] < x.shape[1]:
        raise ValueError(
            f"{OP}: k_cache: got {cache.shape[2]} slots, expected at least T = {x.shape[1]} (this step's tokens)"
        )
    want = expected_shapes(spec, x.shape[0], x.shape[1], cache.shape[2])
    dtype = np.dtype(x.dtype)
    if dtype not in (np.float16, np.float32, np.float64) and dtype.name != "bfloat16":
        raise TypeError(f"{OP}: x: got dtype {dtype.name}, expected a float dtype (the model's)")
    for name, a in named.items():
        if tuple(a.shape) != want[name]:
            raise ValueError(
                f"{OP}: {name}: got shape {tuple(a.shape)}, expected {want[name]} (from the spec and "
                f"x [B, T, H] = {tuple(x.shape)}, k_cache slots S = {cache.shape[2]})"
            )
        expected = {
            "write_index": np.dtype(np.int32),
            "cos": np.dtype(np.float32),
            "sin": np.dtype(np.float32),
            "mask_bias": np.dtype(np.float32),
        }.get(name, dtype)
        if np.dtype(a.dtype) != expected:
            raise TypeError(
                f"{OP}: {name}: got dtype {np.dtype(a.dtype).name}, expected {expected.name}"
                + ("" if name in ("write_index", "cos", "sin", "mask_bias") else " (x's dtype)")
            )
    return named


@decode_step_p.def_abstract_eval
def _abstract_eval(*operands, spec):
    named = _check_operands(operands, spec)
    x, k_cache, v_cache = named["x"], named["k_cache"], named["v_cache"]
    logits = x.update(shape=x.shape[:2] + (spec.vocab,), dtype=np.dtype(np.float32), weak_type=False)
    return [logits, k_cache.update(weak_type=False), v_cache.update(weak_type=False)]


def _jvp(primals, tangents, *, spec):
    del primals, tangents, spec
    raise TypeError(
        f"{OP} is inference only: it has no derivative (differentiate the model's own forward, which "
        "computes the same step, instead)"
    )


def _batch(args, dims, *, spec):
    """vmap: batched row operands (x, caches, tables, mask) fold into B; anything else batched runs a lax.map."""
    names = operand_names(spec)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if any(d is not None and name not in ROW_OPERANDS for name, d in zip(names, dims)):
        batched = [i for i, d in enumerate(dims) if d is not None]

        def one(sliced):
            full = list(args)
            for i, a in zip(batched, sliced):
                full[i] = a
            return decode_step_p.bind(*full, spec=spec)

        sliced = [jnp.moveaxis(args[i], dims[i], 0) for i in batched]
        return lax.map(one, sliced), [0, 0, 0]
    folded = []
    for name, a, d in zip(names, args, dims):
        if name not in ROW_OPERANDS:
            folded.append(a)
            continue
        axis = ROW_OPERANDS[name]
        a = batching.bdim_at_front(a, d, size)  # [n, ...]; an unbatched row operand is broadcast
        a = jnp.moveaxis(a, 0, axis)  # [..., n, B, ...]
        folded.append(a.reshape(a.shape[:axis] + (size * a.shape[axis + 1],) + a.shape[axis + 2 :]))
    logits, k_cache, v_cache = decode_step_p.bind(*folded, spec=spec)

    def unfold(a, axis):
        return a.reshape(a.shape[:axis] + (size, a.shape[axis] // size) + a.shape[axis + 1 :])

    return [unfold(logits, 0), unfold(k_cache, 1), unfold(v_cache, 1)], [0, 1, 1]


# --- Lowering: the XLA reference (a scan of the models' layer), the kernel launch -----------------------------


def _projection(weight):
    """x -> x·W for a dense [K, N] layer slice, or (x·u)·v for a factored (u, v) pair (as svd_matmul)."""
    if isinstance(weight, tuple):
        return lambda h: svd_matmul_ref(h, *weight)
    return lambda h: decoder_math.linear(h, weight)


def _grouped(named):
    """{projection or "head": array or (u, v)} from the flat named operands."""
    out = {}
    for name in PROJECTIONS + ("head",):
        out[name] = named[name] if name in named else (named[f"{name}.u"], named[f"{name}.v"])
    return out


def decode_step_ref(*operands, spec: DecodeSpec):
    """The decode step in jnp (the XLA lowering): `lax.scan` over layers of `decoder_math.decoder_layer`.

    Factored projections are (x·u)·v over the zero-padded stacked factors (exact: the padding adds zeros); an MLP
    factored in all three projections runs as `svd_mlp_ref`, the XLA lowering of the compressed models' SVDMLP.
    """
    named = dict(zip(operand_names(spec), operands))
    weights = _grouped(named)
    norm = functools.partial(decoder_math.rms_norm, eps=spec.norm_eps, unit_offset=spec.norm_unit_offset)
    write_index = named["write_index"][0, 0]
    slots, tokens = named["k_cache"].shape[2], named["x"].shape[1]
    # Out of range, dynamic_update_slice would clamp and write other slots: raise as the emulator's launch does.
    lax.cond(
        (write_index < 0) | (write_index > slots - tokens),
        lambda: jax.debug.callback(functools.partial(check_write_index, slots=slots, tokens=tokens), write_index),
        lambda: None,
    )
    layer_rope = jnp.asarray(spec.layer_rope, jnp.int32)
    layer_mask = jnp.asarray(spec.layer_mask, jnp.int32)
    per_layer = {name: weights[name] for name in PROJECTIONS}
    xs = (per_layer, named["norms"], named.get("qk_norms"), named["k_cache"], named["v_cache"], layer_rope, layer_mask)
    mlp_factored = all(spec.ranks[PROJECTIONS.index(name)] is not None for name in ("gate", "up", "down"))

    def layer(x, xs):
        projections, norms, qk_norms, k_cache, v_cache, rope, mask = xs
        proj = {name: _projection(w) for name, w in projections.items()}
        if mlp_factored:
            factors = [f for name in ("gate", "up", "down") for f in projections[name]]
            mlp = lambda h: svd_mlp_ref(h, *factors, activation=spec.activation)  # noqa: E731
        else:
            mlp = functools.partial(
                decoder_math.gated_mlp,
                gate_proj=proj["gate"],
                up_proj=proj["up"],
                down_proj=proj["down"],
                activation=spec.activation,
            )
        attention = functools.partial(
            decoder_math.self_attention,
            q_proj=proj["q"],
            k_proj=proj["k"],
            v_proj=proj["v"],
            o_proj=proj["o"],
            q_norm=None if qk_norms is None else functools.partial(norm, weight=qk_norms[0]),
            k_norm=None if qk_norms is None else functools.partial(norm, weight=qk_norms[1]),
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            scaling=spec.query_scaling,
            logit_softcap=spec.attn_logit_softcap,
            cos=named["cos"][rope],
            sin=named["sin"][rope],
            bias=named["mask_bias"][mask],
            kv=(k_cache, v_cache),
            write_index=write_index,
        )
        return decoder_math.decoder_layer(
            x,
            norms=[functools.partial(norm, weight=norms[i]) for i in range(spec.num_norms)],
            attention=attention,
            mlp=mlp,
            sandwich=spec.sandwich,
        )

    x, (k_cache, v_cache) = lax.scan(layer, named["x"], xs)
    logits = _projection(weights["head"])(norm(x, named["final_norm"]))
    return decoder_math.soft_cap(logits, spec.final_logit_softcap).astype(jnp.float32), k_cache, v_cache


def _kernel_operands(operands, spec):
    """The flat operands as decode_step_kernel takes them: qk_norms None when absent, factors as [u, v] lists."""
    named = {"qk_norms": None, **dict(zip(operand_names(spec), operands))}
    named.update({name: list(w) if isinstance(w, tuple) else w for name, w in _grouped(named).items()})
    return [named[name] for name in OPERAND_NAMES]


def _plan(*operands, target, spec):
    """The looped kernel, once its own operand checks pass (they also limit B·T to one partition tile)."""
    del target  # one kernel serves trn1 and trn2; the emulator reads its target when the kernel runs
    check_operands("decode_step_kernel", _kernel_operands(operands, spec), spec)
    return decode_step_kernel


def _run(kernel, *operands, spec):
    """One launch of the looped kernel for the whole step."""
    named = dict(zip(operand_names(spec), operands))
    check_write_index(named["write_index"], slots=named["k_cache"].shape[2], tokens=named["x"].shape[1])
    return kernel(*_kernel_operands(operands, spec), spec=spec)


ad.primitive_jvps[decode_step_p] = _jvp
batching.primitive_batchers[decode_step_p] = _batch
lowering.register_whole(decode_step_p, reference=decode_step_ref, kernels=KernelLaunches(OP, _plan, _run))
