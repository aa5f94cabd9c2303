"""A stand-in "neuron" platform for lowering tests without the Neuron plugin.

Test-only, so it reaches into JAX internals itself instead of through jax_neuronmm/_compat.py (which holds
what the library needs).
"""

import contextlib

from jax._src import xla_bridge


@contextlib.contextmanager
def stand_in_platform(platform):
    """Makes JAX know `platform` (as a PJRT plugin would) without any device, for lowering only; forgotten on
    exit."""
    registered = platform in xla_bridge._backend_factories
    if not registered:
        xla_bridge._backend_factories[platform] = xla_bridge.BackendRegistration(lambda: None, -1000, True)
    try:
        yield
    finally:
        if not registered:
            del xla_bridge._backend_factories[platform]
