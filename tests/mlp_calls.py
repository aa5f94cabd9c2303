"""svd_mlp called with its factors given flat, for tests that build, vmap or differentiate them as a list."""

import jax_neuronmm as jn


def svd_mlp_of_factors(x, gate_u, gate_v, up_u, up_v, down_u, down_v, *scales, **kwargs):
    """jn.svd_mlp(x, Factored(gate_u, gate_v), Factored(up_u, up_v), Factored(down_u, down_v), **kwargs); with fp8
    factors `scales` are their six scales in the same order (gate.u_scale, gate.v_scale, ..., down.v_scale)."""
    factors = (gate_u, gate_v, up_u, up_v, down_u, down_v)
    scales = scales or (None,) * 6
    gate, up, down = (jn.Factored(*factors[i : i + 2], *scales[i : i + 2]) for i in (0, 2, 4))
    return jn.svd_mlp(x, gate, up, down, **kwargs)
