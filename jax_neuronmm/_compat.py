"""Every import of JAX internals lives here, so a JAX upgrade touches one file.

Supported: JAX 0.10.x and 0.11.x.
"""

from jax._src.dispatch import apply_primitive  # eager execution of a primitive
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["Primitive", "ad", "apply_primitive", "batching", "mlir", "register_lowering", "lower_fun"]


def register_lowering(primitive, rule, platform=None):
    """Registers `rule` for `primitive`, for every platform or for one."""
    mlir.register_lowering(primitive, rule, platform=platform)


def lower_fun(fun, multiple_results):
    """Turns a jnp-level function into an MLIR lowering rule."""
    return mlir.lower_fun(fun, multiple_results=multiple_results)
