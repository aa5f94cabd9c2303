"""Shared fixtures: fresh seeded randomness and a float64 scope for gradient checks."""

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
