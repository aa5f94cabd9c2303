"""Every activation the project knows, in one table that the kernels, both references and the models read.

Each entry is keyed by the name `svd_mlp(activation=...)` takes and says what the name means everywhere:
  hf_name     the `hidden_act` / `hidden_activation` spelling of an HF config.json
  nl_op       the ScalarE function (`nl.<nl_op>`) the fused MLP kernels apply while evicting PSUM; None: the
              kernels do not apply it, and a model with it is compressed projection by projection
  jax_nn      (function of jax.nn, keyword arguments): how JAX code computes it
  reference   the float64 numpy function tests compare against (None: no kernel applies it)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

_SQRT_2_OVER_PI = np.sqrt(2.0 / np.pi)


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def silu_f64(z) -> np.ndarray:
    z = _f64(z)
    return z / (1.0 + np.exp(-z))


def gelu_tanh_f64(z) -> np.ndarray:
    """GELU with the tanh approximation (what Gemma's `gelu_pytorch_tanh` computes)."""
    z = _f64(z)
    return 0.5 * z * (1.0 + np.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z**3)))


@dataclasses.dataclass(frozen=True)
class Activation:
    hf_name: str
    nl_op: str | None
    jax_nn: tuple[str, dict]
    reference: Callable | None


ACTIVATIONS = {
    "silu": Activation("silu", "silu", ("silu", {}), silu_f64),
    "gelu_tanh": Activation("gelu_pytorch_tanh", "gelu_apprx_tanh", ("gelu", {"approximate": True}), gelu_tanh_f64),
    "gelu": Activation("gelu", None, ("gelu", {"approximate": False}), None),
}

FUSED_ACTIVATIONS = tuple(name for name, a in ACTIVATIONS.items() if a.nl_op is not None)  # what svd_mlp accepts
HF_ACTIVATIONS = {a.hf_name: name for name, a in ACTIVATIONS.items()}  # config.json spelling -> name


def check_fused_activation(activation, what="activation"):
    """ValueError naming `what` unless the fused MLP kernels apply `activation`."""
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"{what}: got {activation!r}, expected one of {FUSED_ACTIVATIONS}")
