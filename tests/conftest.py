"""Shared fixtures: fresh seeded randomness, a float64 scope for gradient checks, the 8-device sharding checks'
results."""

import zlib

import jax
import numpy as np
import pytest


@pytest.fixture
def rng(request):
    # A different, reproducible stream per test.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module")
def check_results(request):
    """{check name: None or the failure} of the requesting sharding test module's checks (spmd_helpers), from one
    8-device subprocess per module."""
    from spmd_helpers import checks_in_subprocess

    return checks_in_subprocess(request.module.__file__)


@pytest.fixture(autouse=True, scope="session")
def _cache_in_a_temporary_directory(tmp_path_factory):
    """Caches the package writes by default (pipeline.self_distillation's generated text) go to a temporary
    directory, not the user's ~/.cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv("JAX_NEURONMM_CACHE", str(tmp_path_factory.mktemp("jax_neuronmm_cache")))
    yield
    patch.undo()
