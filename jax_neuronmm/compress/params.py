"""Compress the dense projections of a Flax parameter tree into SVD factors.

A Flax dense layer stores `kernel` [K, N] (in_features × out_features, so y = x·kernel). `compress_params` walks a
parameter tree — a Linen variables dict (nested dicts / FrozenDict) or an NNX `State` — and, for every `kernel`
whose path matches `include`, replaces it by `u` [K, r] and `v` [r, N] in the same sub-tree, keeping every other
entry (bias, norms, embeddings) as it was. That is the layout of `jax_neuronmm.nn`'s SVDLinear / SVDDense / SVDMLP,
so the result loads straight into those modules. Kernels with more than two dims are treated as stacks of layers
over their leading dims (scanned models: [L, K, N] → u [L, K, r], v [L, r, N]).

Paths are the tree's keys joined by "/", e.g. "params/layers_0/mlp/gate_proj/kernel" (Linen) or
"layers/0/mlp/gate_proj/kernel" (NNX); a layer is named by its module path, the kernel path without "/kernel".
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import numpy as np
from tqdm.auto import tqdm

from jax_neuronmm.compress import svd, tree

# The MLP projections, as the NeuronMM paper compresses them: any path component containing "mlp" (mlp, MlpBlock_0,
# SVDMLP_0), the Llama/Gemma projection names, feed-forward blocks, and fc/fc1/fc2/c_fc layers. Case-insensitive.
DEFAULT_INCLUDE = (
    r"(?i)(?:^|/)"
    r"(?:[^/]*mlp[^/]*|ffn|feed_forward|gate_proj|up_proj|down_proj|gate|up|down|fc\d*|c_fc)"
    r"(?:/|$)"
)

METHODS = ("svd", "whitened")
# NNX Variable metadata naming a kernel's mesh axes (the key differs across Flax versions).
SHARDING_METADATA = ("out_sharding", "sharding_names", "sharding")


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """What happened to one kernel.

    relative_error is ‖W − u·v‖_F / ‖W‖_F over the whole (possibly stacked) kernel. output_error is
    ‖X·W − X·u·v‖_F / ‖X·W‖_F on the calibration activations (method="whitened" only, else None). damping is the
    relative damping that had to be added to XᵀX (0.0 when none was needed or method="svd"). rank None: a
    projection rank allocation left dense (params_after = params_before, no error).
    """

    path: str
    shape: tuple[int, ...]
    rank: int | None
    params_before: int
    params_after: int
    relative_error: float
    output_error: float | None = None
    damping: float = 0.0


@dataclasses.dataclass(frozen=True)
class CompressionReport:
    """Per-layer results of `compress_params`, in tree order."""

    method: str
    keep: float | None
    rank: int | None
    layers: tuple[LayerReport, ...]

    @property
    def params_before(self) -> int:
        return sum(layer.params_before for layer in self.layers)

    @property
    def params_after(self) -> int:
        return sum(layer.params_after for layer in self.layers)

    @property
    def ranks(self) -> dict[str, int | None]:
        return {layer.path: layer.rank for layer in self.layers}

    def to_dict(self) -> dict:
        """A JSON-serializable form (used for checkpoint metadata)."""
        return {
            "method": self.method,
            "keep": self.keep,
            "rank": self.rank,
            "layers": [dataclasses.asdict(layer) | {"shape": list(layer.shape)} for layer in self.layers],
        }

    def __str__(self) -> str:
        width = max([len("layer")] + [len(layer.path) for layer in self.layers])
        lines = [f"{'layer':<{width}}  {'shape':>18}  {'rank':>5}  {'params':>23}  {'rel.err':>8}  {'out.err':>8}"]
        for layer in self.layers:
            shape = "×".join(map(str, layer.shape))
            params = f"{layer.params_before:,} → {layer.params_after:,}"
            output = "-" if layer.output_error is None else f"{layer.output_error:.4f}"
            damped = f"  (damping {layer.damping:.2g})" if layer.damping else ""
            rank = "dense" if layer.rank is None else layer.rank
            lines.append(
                f"{layer.path:<{width}}  {shape:>18}  {rank:>5}  {params:>23}  "
                f"{layer.relative_error:8.4f}  {output:>8}{damped}"
            )
        ratio = self.params_after / self.params_before if self.params_before else float("nan")
        lines.append(
            f"{len(self.layers)} layers, method={self.method}: {self.params_before:,} → {self.params_after:,} "
            f"parameters ({ratio:.1%})"
        )
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Target:
    keys: tuple  # tree keys of the module holding the kernel
    path: str  # module path, "/"-joined
    kernel: np.ndarray
    rank: int
    activations: np.ndarray | None


def compress_params(
    params,
    *,
    keep: float | None = None,
    rank: int | None = None,
    method: str = "svd",
    include: str = DEFAULT_INCLUDE,
    calibration: Mapping | None = None,
    block: int = 128,
    damping: float = svd.DEFAULT_DAMPING,
    progress: bool = True,
):
    """Replace each matching `kernel` [..., K, N] by SVD factors `u` [..., K, r], `v` [..., r, N].

    Args:
      params: Linen variables (nested dicts / FrozenDict) or an NNX `State`; lists and tuples are walked too.
      keep: fraction of each kernel's parameters to keep, in (0, 1]; the rank is
        `block_aligned_rank(K, N, keep, block)`. Exactly one of keep / rank.
      rank: the same rank for every matching kernel (must be ≤ min(K, N) for each).
      method: "svd" (Eckart–Young truncation) or "whitened" (SVD-LLM whitening; needs calibration).
      include: regex searched (re.search) in each kernel's path; default `DEFAULT_INCLUDE` (MLP projections).
      calibration: for method="whitened", maps each layer's module path (or its kernel path) to the
        activations that layer sees, [n, K] (or [L, n, K] for a stacked kernel [L, K, N]).
      block: rank alignment used with keep.
      damping: relative damping for indefinite XᵀX (see `whitened_svd`).
      progress: show a tqdm progress bar.

    Returns:
      (new_params, report): a tree of the same type with u/v in place of each compressed kernel (same dtype,
      numpy leaves stay numpy, JAX leaves become JAX arrays, NNX variables keep their type and metadata, a
      kernel's mesh-axis names [K-axis, N-axis] become u [K-axis, None], v [None, N-axis]; an NNX State comes
      back with the structure `nnx.state` gives for the factored model), and a `CompressionReport`.
      Deterministic: the same input gives bit-identical factors.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if (keep is None) == (rank is None):
        raise ValueError(f"give exactly one of keep= or rank=, got keep={keep!r}, rank={rank!r}")
    if keep is not None:
        svd.check_keep(keep)
    if method == "svd" and calibration is not None:
        raise ValueError("calibration is only used by method='whitened'; got calibration with method='svd'")
    if method == "whitened" and calibration is None:
        raise ValueError("method='whitened' needs calibration={layer path: activations [n, in_features]}")
    pattern = re.compile(include)

    kernels = [(keys[:-1], leaf) for keys, leaf in tree.iter_leaves(params) if keys and keys[-1] == "kernel"]
    matched = [(keys, leaf) for keys, leaf in kernels if pattern.search(tree.join(keys + ("kernel",)))]
    if not matched:
        found = ", ".join(tree.join(keys + ("kernel",)) for keys, _ in kernels[:8]) or "none"
        raise ValueError(f"include={include!r} matched no kernel in params; kernels found: {found}")

    calibration = dict(calibration or {})
    targets = []
    for keys, leaf in matched:
        path = tree.join(keys)
        kernel = np.asarray(tree.unwrap(leaf))
        if kernel.ndim < 2:
            raise ValueError(f"{path}/kernel must be at least 2-D [..., K, N], got shape {kernel.shape}")
        k, n = kernel.shape[-2:]
        if rank is not None:
            try:
                svd.check_rank(rank, kernel.shape)
            except ValueError as error:
                raise ValueError(f"{path}/kernel: {error}") from None
            layer_rank = rank
        else:
            layer_rank = svd.block_aligned_rank(k, n, keep, block)
        activations = None
        if method == "whitened":
            by_module, by_kernel = calibration.pop(path, None), calibration.pop(path + "/kernel", None)
            activations = by_module if by_module is not None else by_kernel
            if activations is None:
                raise ValueError(f"calibration has no activations for layer {path!r} (method='whitened')")
        targets.append(_Target(keys, path, kernel, layer_rank, activations))
    if calibration:
        raise ValueError(f"calibration names layers that are not compressed: {sorted(calibration)}")

    replacements, layer_reports = {}, []
    with svd.damping_summary():  # one warning for the whole tree, not one per projection
        for target in tqdm(targets, desc=f"compress ({method})", unit="layer", disable=not progress):
            u, v, layer_report = _compress_one(target, method, damping)
            replacements[target.keys] = (u, v)
            layer_reports.append(layer_report)
    report = CompressionReport(method=method, keep=keep, rank=rank, layers=tuple(layer_reports))
    return tree.rebuild(params, _replace_kernels(replacements)), report


def _compress_one(target: _Target, method: str, damping: float):
    kernel = target.kernel
    damping_added, output_error = 0.0, None
    try:
        if method == "svd":
            u, v = svd.truncated_svd(kernel, target.rank)
        else:
            factors = svd.whitened_svd_with_info(kernel, target.activations, target.rank, damping=damping)
            u, v, damping_added = factors.u, factors.v, factors.damping_added
            output_error = _relative_output_error(kernel, u, v, target.activations)
    except ValueError as error:
        raise ValueError(f"{target.path}/kernel: {error}") from None
    stack = int(np.prod(kernel.shape[:-2], dtype=np.int64))
    k, n = kernel.shape[-2:]
    report = LayerReport(
        path=target.path,
        shape=tuple(kernel.shape),
        rank=target.rank,
        params_before=int(kernel.size),
        params_after=stack * target.rank * (k + n),
        relative_error=_relative_error(kernel, u, v),
        output_error=output_error,
        damping=damping_added,
    )
    return u, v, report


def _relative_error(kernel, u, v) -> float:
    w = kernel.astype(np.float64)
    approx = np.matmul(u.astype(np.float64), v.astype(np.float64))
    return float(np.linalg.norm(w - approx) / max(np.linalg.norm(w), np.finfo(np.float64).tiny))


def _relative_output_error(kernel, u, v, activations) -> float:
    x = np.asarray(activations, np.float64)
    exact = np.matmul(x, kernel.astype(np.float64))
    approx = np.matmul(np.matmul(x, u.astype(np.float64)), v.astype(np.float64))
    return float(np.linalg.norm(exact - approx) / max(np.linalg.norm(exact), np.finfo(np.float64).tiny))


def _replace_kernels(replacements: dict):
    """A `tree.rebuild` callback putting u, v in place of each replaced kernel."""

    def replace(keys, leaf):
        if keys and keys[-1] == "kernel" and keys[:-1] in replacements:
            u, v = replacements[keys[:-1]]
            return [("u", _factor_variable(leaf, u, "u")), ("v", _factor_variable(leaf, v, "v"))]
        return [(keys[-1] if keys else None, leaf)]

    return replace


def _factor_variable(kernel_leaf, factor: np.ndarray, name: str):
    """factor in kernel_leaf's container. An NNX kernel's axis names [..., K, N] map to u [..., K, None] and
    v [..., None, N] (the Megatron layout: the rank axis is never split)."""
    wrapped = tree.wrap_like(kernel_leaf, factor)
    if not hasattr(kernel_leaf, "get_metadata"):
        return wrapped
    metadata = kernel_leaf.get_metadata()
    updates = {}
    for key in SHARDING_METADATA:
        names = metadata.get(key)
        if isinstance(names, (tuple, list)) and len(names) == factor.ndim:
            names = tuple(names)
            updates[key] = names[:-1] + (None,) if name == "u" else names[:-2] + (None, names[-1])
    return wrapped.replace(wrapped.get_value(), **updates) if updates else wrapped
