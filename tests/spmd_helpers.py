"""Shared by the 8-device sharding tests: the check registry and subprocess harness, the 2 x 4 mesh, collectives in
compiled HLO, operands.

The device count must be fixed before JAX starts, so a sharding test module runs itself once in a subprocess
with `--xla_force_host_platform_device_count=8`: the subprocess runs every check of the module (`run_checks`)
and prints one JSON line {check name: null or the failure}; the pytest side (`checks_in_subprocess`, through
conftest.py's module-scoped `check_results` fixture) reads it, and `check_test` gives one test per check.
"""

import functools
import json
import os
import re
import subprocess
import sys
import traceback
import zlib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

DEVICE_COUNT = 8
RESULT_MARKER = "SHARDING_CHECKS_JSON "


class Checks(dict):
    """{check name: function} of one sharding test module; the `check` decorator registers a function by name."""

    def check(self, fn):
        self[fn.__name__] = fn
        return fn


@functools.cache
def mesh():
    """The ("data", "model") mesh of 2 x 4 over the subprocess's 8 devices."""
    assert jax.device_count() == DEVICE_COUNT, jax.devices()
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def rng(name):
    """A reproducible random stream per check name."""
    return np.random.default_rng(zlib.crc32(name.encode()))


def collectives(compiled_text):
    """[(op, result shape)] for every collective in compiled HLO text; combined ones give a tuple shape."""
    pattern = r"= (\([^)]*\)|\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
    return [(op, re.sub(r"\{[^}]*\}", "", shape)) for shape, op in re.findall(pattern, compiled_text)]


def matmul_operands(name, tokens=(14,), k=64, r=24, n=40, dtype="float32"):
    """x [*tokens, k], u [k, r], v [r, n]."""
    stream = rng(name)
    return [stream.standard_normal(s).astype(dtype) for s in (tokens + (k,), (k, r), (r, n))]


def matmul_f64(x, u, v):
    return x.astype(np.float64) @ u.astype(np.float64) @ v.astype(np.float64)


def mlp_operands(name, tokens=(2, 6), hidden=48, rank=(16, 12, 20), inter=64, out=48, dtype="float32"):
    """x and the six svd_mlp factors, scaled so activations stay O(1)."""
    stream = rng(name)
    rg, ru, rd = rank
    shapes = [tokens + (hidden,), (hidden, rg), (rg, inter), (hidden, ru), (ru, inter), (inter, rd), (rd, out)]
    return [(stream.standard_normal(s) / np.sqrt(s[-2] if len(s) == 2 else 1)).astype(dtype) for s in shapes]


def mlp_f64(x, gu, gv, uu, uv, du, dv):
    """The silu svd_mlp in float64."""
    x, gu, gv, uu, uv, du, dv = (a.astype(np.float64) for a in (x, gu, gv, uu, uv, du, dv))
    gate = x @ gu @ gv
    return (gate / (1 + np.exp(-gate)) * (x @ uu @ uv)) @ du @ dv


def run_checks(checks):
    """Subprocess side: runs every check (name -> function), reporting each failure, not just the first."""
    results = {}
    for name, fn in checks.items():
        try:
            fn()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    print(RESULT_MARKER + json.dumps(results), flush=True)


def checks_in_subprocess(module_file):
    """Pytest side: runs `python module_file` on 8 CPU devices; returns {check name: None or the failure}."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICE_COUNT}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, module_file], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    assert done.returncode == 0 and lines, f"subprocess failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len(RESULT_MARKER) :])


def check_test(checks):
    """Pytest side: a test, parametrized by check name, that passes where that check passed in the subprocess
    (`check_results`); a module binds it as `test_sharding = check_test(CHECKS)`."""

    @pytest.mark.parametrize("name", sorted(checks))
    def test_sharding(check_results, name):
        failure = check_results[name]
        assert failure is None, failure

    return test_sharding
