"""Local reconstruction fine-tuning of one factored gated MLP: its outputs are fitted to the dense MLP's.

Cheap compared with end-to-end training: no LM head, no other layer, one small jitted step (compiled once per
set of ranks). The loss is the squared output error relative to the targets' energy, so one learning rate fits
every layer.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_neuronmm.reference import jnp_activation
from nki_kernels.activations import ACTIVATIONS

FACTOR_NAMES = ("gate_u", "gate_v", "up_u", "up_v", "down_u", "down_v")


def check_adam_options(options, rates=("learning_rate",)) -> None:
    """ValueError naming the field unless options.steps and options.batch are positive ints and each of `rates`
    (options' step-size fields) is a finite positive number (the fine-tuning options of local_finetune and distill)."""
    kind = type(options).__name__
    for name in ("steps", "batch"):
        value = getattr(options, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{kind}.{name}: got {value!r}, expected a positive int")
    for name in rates:
        rate = getattr(options, name)
        # An infinite rate gives NaN factors (or, in distill, steps the loss check silently undoes).
        numeric = not isinstance(rate, bool) and isinstance(rate, (int, float, np.integer, np.floating))
        if not (numeric and math.isfinite(rate) and rate > 0):
            raise ValueError(f"{kind}.{name}: got {rate!r}, expected a finite positive number")


@dataclasses.dataclass(frozen=True)
class LocalFinetuneOptions:
    """steps: Adam steps per MLP; batch: calibration tokens per step; learning_rate: Adam's, relative to each
    factor's RMS (factors of different layers differ in scale by orders of magnitude); seed: minibatch order."""

    steps: int = 100
    batch: int = 1024
    learning_rate: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        check_adam_options(self)


def gated_mlp_output(factors: dict, x, activation: str):
    """act(x·Ug·Vg) * (x·Uu·Vu) · Ud·Vd for x [n, K] with factors named as FACTOR_NAMES (jnp, float32)."""
    act = jnp_activation(activation)
    hidden = act(x @ factors["gate_u"] @ factors["gate_v"]) * (x @ factors["up_u"] @ factors["up_v"])
    return hidden @ factors["down_u"] @ factors["down_v"]


def relative_error(factors: dict, x, y, activation: str) -> float:
    """‖mlp(x) − y‖² / ‖y‖² over all rows (float)."""
    out = gated_mlp_output({k: jnp.asarray(v, jnp.float32) for k, v in factors.items()}, jnp.asarray(x), activation)
    y = jnp.asarray(y, jnp.float32)
    return float(jnp.sum((out - y) ** 2) / jnp.sum(y**2))


def _optimizer(learning_rate: float):
    return optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(learning_rate))


@functools.partial(jax.jit, static_argnames=("activation", "learning_rate"))
def _adam_step(params, state, scales, energy, xb, yb, *, activation, learning_rate):
    """One Adam step; module-level so every MLP with the same ranks reuses one compilation."""

    def loss(p):
        return jnp.mean(jnp.sum((gated_mlp_output(p, xb, activation) - yb) ** 2, axis=1)) / energy

    grads = jax.grad(loss)(params)
    updates, state = _optimizer(learning_rate).update(grads, state, params)
    updates = {k: u * scales[k] for k, u in updates.items()}
    return optax.apply_updates(params, updates), state


def finetune_mlp(
    factors: dict, inputs, targets, activation: str, options: LocalFinetuneOptions = LocalFinetuneOptions()
) -> dict:
    """Factors (same names and shapes, numpy float32) after `options.steps` Adam steps on
    ‖mlp(inputs) − targets‖² / ‖targets‖², inputs [n, K] and targets [n, N] as numpy arrays.

    Returns the input factors unchanged when training does not lower the loss on the whole set (a guard against
    a learning rate too large for some layer)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: got {activation!r}, expected one of {sorted(ACTIVATIONS)}")
    if set(factors) != set(FACTOR_NAMES):
        raise ValueError(f"factors: got keys {sorted(factors)}, expected {sorted(FACTOR_NAMES)}")
    x = np.asarray(inputs, np.float32)
    y = np.asarray(targets, np.float32)
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"inputs [n, K] and targets [n, N]: got shapes {x.shape} and {y.shape}")
    params = {k: jnp.asarray(v, jnp.float32) for k, v in factors.items()}
    # Per-factor step sizes: Adam's update is ~lr in every entry, so scale it to each factor's RMS.
    scales = {k: jnp.sqrt(jnp.mean(v**2)) for k, v in params.items()}
    state = _optimizer(options.learning_rate).init(params)
    energy = jnp.float32(np.mean(np.sum(y.astype(np.float64) ** 2, axis=1)))
    rng = np.random.default_rng(options.seed)
    batch = min(options.batch, x.shape[0])
    for _ in range(options.steps):
        rows = rng.choice(x.shape[0], batch, replace=False)
        params, state = _adam_step(
            params, state, scales, energy, x[rows], y[rows], activation=activation, learning_rate=options.learning_rate
        )
    trained = {k: np.asarray(v) for k, v in params.items()}
    if relative_error(trained, x, y, activation) >= relative_error(factors, x, y, activation):
        return {k: np.asarray(v, np.float32) for k, v in factors.items()}
    return trained
