"""Float64 numpy references shared by the Flax NNX and Linen wrapper tests (a helper module, not a test file)."""

import numpy as np


def rel_err(got, want):
    """‖got − want‖ / ‖want‖ in float64 (Frobenius norms)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def gated_mlp64(x, gate, up, down, activation):
    """(act(x·gate) * (x·up))·down in float64 on dense kernels [hidden, inter], [hidden, inter], [inter, hidden];
    act is SiLU for "silu", else tanh-approximated GELU."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    g = x @ gate
    if activation == "silu":
        act = g / (1 + np.exp(-g))
    else:
        act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
    return (act * (x @ up)) @ down
