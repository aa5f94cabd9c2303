"""End-to-end sensitivity of a CausalLM's next-token distribution to each projection's rank (rank allocation's input).

A projection's cost at rank r is measured, not predicted from its own error: in a copy of the dense model, that
projection alone is replaced by its whitened rank-r truncation u·v (whitened by the dense model's activations on
the calibration windows, as compression factors it) and the KL divergence from the dense model's to this model's
next-token distribution is averaged over every position of a few probe windows. Projections' costs at one rank
differ widely, which a projection's own whitened truncation error does not show.

The KL runs over the vocabulary rows that are among the dense model's `top_k` most likely tokens at some probe
position (both distributions renormalized over them), which hold nearly all of the teacher's mass there, so a
measurement costs a forward pass from the projection's layer on.

Once the "fisher" step has weighted each truncation's output side, the cost can be predicted instead
(`fisher_losses`): the Fisher-weighted truncation error is the same second-order model of the KL, read off the
singular values the decompositions already hold, with no probe passes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jax_neuronmm.compress import svd
from jax_neuronmm.compress.projections import ATTENTION_GROUPS, MLP_PROJECTIONS, layer_projections
from jax_neuronmm.decoder_math import soft_cap
from jax_neuronmm.pipeline import distill, sequential


@dataclasses.dataclass(frozen=True)
class KLProbes:
    """How `kl_sensitivity` measures a KL: on the last `windows` calibration windows, over the vocabulary rows among
    the dense model's `top_k` most likely tokens at some probe position, the LM head `vocab_chunk` rows at a time."""

    windows: int = 2
    top_k: int = 64
    vocab_chunk: int = 16384

    def __post_init__(self):
        for name in ("windows", "top_k", "vocab_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KLProbes.{name}: got {value!r}, expected a positive int")


def kl_sensitivity(
    dense,
    calibration_ids,
    include,
    probe_ranks: dict,
    *,
    probes: KLProbes = KLProbes(),
    damping: float = svd.DEFAULT_DAMPING,
    output_chols: dict | None = None,
    decompositions: dict | None = None,
    progress: bool = True,
) -> dict:
    """{(layer_index, projection_name): {rank: KL}} for every projection `include` ("mlp", "attention") selects and
    every rank in probe_ranks[(layer_index, projection_name)] (ranks in [1, min(K, N)]).

    calibration_ids [B, T]: whitening uses all B windows; the KL is measured on the last `probes.windows` of them
    (at most B), as `probes` says. `dense` is not modified (a copy is perturbed and restored projection by projection).
    output_chols {(layer_index, projection_name): L}: each truncation's output weighting, as compression applies it
    (`sequential.compress_layers`). decompositions: a dict filled with {(layer_index, projection_name): (S, SVD, L)},
    each projection's whitening factor, `svd.whitened_decomposition` and output weighting (None when unweighted), so
    that compression at the chosen ranks reuses them instead of a second calibration pass and SVD.
    """
    output_chols = output_chols or {}
    ids = np.asarray(calibration_ids, np.int32)
    if probes.windows > len(ids):
        raise ValueError(f"probes.windows: got {probes.windows!r}, expected at most {len(ids)} (calibration windows)")
    model = nnx.clone(dense)
    probe = ids[-probes.windows :]
    x, positions, masks = sequential.calibration_batch(model, probe)
    layer_inputs = [x]  # the residual stream entering each layer on the probe windows, then the last layer's output
    for layer in model.layers:
        layer_inputs.append(sequential.record_inputs(layer, layer_inputs[-1], positions, masks[_window(layer)], [])[0])
    table = distill.unembedding(model)
    cap = getattr(model.config, "final_logit_softcapping", None)
    teacher = model.norm(layer_inputs[-1]).reshape(-1, table.shape[1])
    rows = np.unique(np.asarray(_top_rows(teacher, table, cap, min(probes.top_k, table.shape[0]))))
    table = table[jnp.asarray(rows)]

    def kl_from(index):
        hidden = layer_inputs[index]
        for layer in model.layers[index:]:
            hidden = sequential.record_inputs(layer, hidden, positions, masks[_window(layer)], [])[0]
        student = model.norm(hidden).reshape(-1, table.shape[1])
        return float(_mean_kl(student, teacher, table, cap, probes.vocab_chunk))

    measured = {}
    for index, name, chol, decomposition, out_chol in _decompositions(
        dense, ids, include, damping, output_chols, decompositions, "rank sensitivity", progress
    ):
        layer = model.layers[index]
        kernel = getattr(layer.mlp if name in MLP_PROJECTIONS else layer.self_attn, name).kernel
        weight = np.asarray(kernel[...], np.float32)
        costs = {}
        for rank in sorted(set(probe_ranks[(index, name)])):
            svd.check_rank(rank, weight.shape)
            u, v = svd.whitened_factors(weight, chol, rank, decomposition, out_chol)
            kernel[...] = jnp.asarray(u @ v, kernel[...].dtype)
            costs[rank] = kl_from(index)
        kernel[...] = jnp.asarray(weight, kernel[...].dtype)
        measured[(index, name)] = costs
    return measured


def fisher_losses(
    dense,
    calibration_ids,
    include,
    output_chols: dict,
    *,
    damping: float = svd.DEFAULT_DAMPING,
    decompositions: dict | None = None,
    progress: bool = True,
) -> dict:
    """{(layer_index, projection_name): loss [min(K, N) + 1]}: each projection's predicted end-to-end cost at every
    rank, without measuring it: the Fisher-weighted truncation error tr(ΔWᵀ·XᵀX·ΔW·G) that the "fisher" step's
    truncation minimizes, the second-order model of the KL divergence (`pipeline.fisher`), which is the tail sum
    Σ_{i≥r} σ_i² of the singular values of Sᵀ·W·L. Losses share one unit (up to one factor common to every
    projection, all that rank allocation compares).

    output_chols {(layer_index, projection_name): L}: the output weighting of every projection `include` selects
    (a ValueError names the missing ones: without it the tail sums are output errors in each projection's own units,
    not comparable across projections). decompositions: as in `kl_sensitivity`. The ranks these losses allocate
    measure as well as the probed KL's, without the probe passes (benchmarks/results/accuracy_report.md).
    """
    wanted = {(index, name) for index, _, name in layer_projections(len(dense.layers), include)}
    missing = sorted(wanted - set(output_chols or {}))
    if missing:
        raise ValueError(
            f"output_chols: no output weighting for {missing[:4]}{' ...' if len(missing) > 4 else ''}; the Fisher "
            "losses need the 'fisher' step's weighting of every projection"
        )
    ids = np.asarray(calibration_ids, np.int32)
    losses = {}
    for index, name, _, (_, sigma, _), _ in _decompositions(
        dense, ids, include, damping, output_chols, decompositions, "Fisher losses", progress
    ):
        energies = np.asarray(sigma, np.float64) ** 2
        losses[(index, name)] = np.concatenate([np.cumsum(energies[::-1])[::-1], [0.0]])
    return losses


def _groups(include) -> list:
    """The projections `include` selects in groups that share their input, in the order calibration taps them."""
    groups = list(ATTENTION_GROUPS) if "attention" in include else []
    return groups + ([("gate_proj", "up_proj"), ("down_proj",)] if "mlp" in include else [])


def _decompositions(dense, ids, include, damping, output_chols, decompositions, desc, progress):
    """Yields (layer_index, projection_name, S, (U, σ, Vᵀ), L) for every projection `include` selects, layer by
    layer: S the whitening factor of its inputs in the dense model on ids, L its output weighting (None when
    output_chols has none), the SVD of Sᵀ·W·L (`svd.whitened_decomposition`); recorded in `decompositions` when a
    dict."""
    groups = _groups(include)
    x, positions, masks = sequential.calibration_batch(dense, ids)
    passes = sequential.dense_calibration(dense.layers, x, positions, masks, sequential.calibration_taps(include))
    bar = tqdm(total=len(dense.layers), desc=desc, disable=not progress, unit="layer")
    with bar, svd.single_threaded_blas():
        for index, (layer, inputs) in enumerate(zip(dense.layers, passes)):
            for group, group_inputs in zip(groups, inputs):
                chol = svd.whitening(group_inputs, damping=damping)[0]
                parent = layer.mlp if group[0] in MLP_PROJECTIONS else layer.self_attn
                for name in group:
                    weight = np.asarray(getattr(parent, name).kernel[...], np.float32)
                    out_chol = output_chols.get((index, name))
                    decomposition = svd.whitened_decomposition(weight, chol, out_chol)
                    if decompositions is not None:
                        decompositions[(index, name)] = (chol, decomposition, out_chol)
                    yield index, name, chol, decomposition, out_chol
            bar.update()


def _window(layer):
    return layer.self_attn.spec.sliding_window


@functools.partial(jax.jit, static_argnums=(2, 3))
def _top_rows(hidden, table, cap, k):
    """The ids of the k largest logits at each row of hidden [n, hidden] (logits = soft_cap(hidden·Eᵀ, cap))."""
    return jax.lax.top_k(soft_cap(hidden @ table.T, cap), k)[1]


@functools.partial(jax.jit, static_argnums=(3, 4))
def _mean_kl(student, teacher, table, cap, chunk):
    return jnp.mean(distill.vocab_kl(student, teacher, table, cap, chunk))
