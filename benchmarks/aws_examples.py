"""Run AWS's new-dialect NKI kernels, unmodified, on the emulator against numpy references.

    python benchmarks/aws_examples.py --sdk_path=/path/to/aws-neuron-sdk
    python benchmarks/aws_examples.py --nki_library=/path/to/nki-library

`--sdk_path` is a checkout of github.com/aws-neuron/aws-neuron-sdk (the kernels are imported from its
nki/examples folder inside `nki_kernels.emulator.as_nki()`; nothing of theirs is copied here).
`--nki_library` is a checkout of github.com/aws-neuron/nki-library: its kernels (RMSNorm, RoPE, cumsum, max,
top-k, nonzero indices, decode attention, the attention block, the dense MLPs and the transformer_tkg
megakernel) are imported from the checkout the same way (benchmarks/nkilib_cases.py). Either flag or both.
Prints one line per kernel: PASS, FAIL (with the reason) or SKIP (why it cannot run anywhere).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import traceback
from collections.abc import Callable

import _flag_checks  # sibling module: the script's folder is on sys.path
import ml_dtypes
import nkilib_cases
import numpy as np
from absl import app, flags

from nki_kernels import emulator

FLAGS = flags.FLAGS
flags.DEFINE_string("sdk_path", None, "checkout of aws-neuron/aws-neuron-sdk (its nki/examples kernels)")
flags.DEFINE_string("nki_library", None, "checkout of aws-neuron/nki-library (its src/nkilib_src/nkilib kernels)")
_flag_checks.directory_with("sdk_path", os.path.join("nki", "examples"), "aws-neuron/aws-neuron-sdk")
_flag_checks.directory_with("nki_library", os.path.join("src", "nkilib_src", "nkilib"), "aws-neuron/nki-library")
flags.register_multi_flags_validator(
    ["sdk_path", "nki_library"],
    lambda values: bool(values["sdk_path"] or values["nki_library"]),
    message="give --sdk_path (aws-neuron-sdk checkout) and/or --nki_library (nki-library checkout)",
)

BF16 = ml_dtypes.bfloat16


@dataclasses.dataclass
class Case:
    name: str
    file: str  # relative to nki/examples
    kernel: str | None  # attribute of the module; None: importing the module is the test
    make_args: Callable = None  # rng -> (args, kwargs)
    reference: Callable = None  # (*args, **kwargs) -> expected output(s)
    rtol: float = 1e-5
    atol: float = 1e-5
    expect_error: type | None = None  # the example demonstrates a violation
    skip: str = ""


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _matmul_args(k, m, n):
    def make(rng):
        return ((rng.standard_normal((k, m)).astype(BF16), rng.standard_normal((k, n)).astype(BF16)), {})

    return make


def _matmul_ref(lhs_t, rhs):
    return _f64(lhs_t).T @ _f64(rhs)


def _pool_ref(reduce):
    def ref(x, pool):
        c, h, w = x.shape
        return reduce(_f64(x).reshape(c, h // pool, pool, w // pool, pool), axis=(2, 4))

    return ref


def _mamba_args(rng):
    batch, channels, seq_len, state = 1, 256, 512, 4
    delta = rng.uniform(0.1, 1.0, (batch, channels, seq_len)).astype(np.float32)
    u = rng.standard_normal((batch, channels, seq_len)).astype(np.float32)
    a = -rng.uniform(0.5, 1.5, (channels, state)).astype(np.float32)
    b = rng.standard_normal((batch, state, seq_len)).astype(np.float32)
    c = rng.standard_normal((batch, state, seq_len)).astype(np.float32)
    return (delta, u, a, b, c), {}


def _mamba_ref(delta, u, a, b, c):
    """Selective scan: h_t = exp(delta_t * A) * h_(t-1) + delta_t * u_t * B_t; y_t = sum over states of h_t * C_t."""
    delta = _f64(delta)
    out = np.zeros_like(delta)
    for batch in range(delta.shape[0]):
        for state in range(a.shape[1]):
            decay = np.exp(delta[batch] * a[:, state : state + 1])
            drive = delta[batch] * u[batch] * b[batch, state][None, :]
            h = np.zeros(delta.shape[1])
            for t in range(delta.shape[2]):
                h = decay[:, t] * h + drive[:, t]
                out[batch, :, t] += h * c[batch, state, t]
    return out


MM = "matrix_multiplication/matrix_multiplication_nki_kernels.py"
MAMBA = "fused_mamba/mamba_nki_kernels.py"
CASES = [
    Case("matmul basic", MM, "nki_matmul_basic_", _matmul_args(128, 64, 512), _matmul_ref, 2e-2, 2e-1),
    Case("matmul tiled", MM, "nki_matmul_tiled_", _matmul_args(256, 256, 1024), _matmul_ref, 2e-2, 2e-1),
    Case("matmul hoist load", MM, "nki_matmul_hoist_load_", _matmul_args(256, 256, 1024), _matmul_ref, 2e-2, 2e-1),
    Case(
        "matmul block free dimension",
        MM,
        "nki_matmul_block_free_dimension_",
        _matmul_args(256, 512, 2048),
        _matmul_ref,
        2e-2,
        2e-1,
    ),
    Case(
        "matmul fully optimized",
        MM,
        "nki_matmul_fully_optimized_",
        _matmul_args(2048, 2048, 1024),
        _matmul_ref,
        2e-2,
        5e-1,
    ),
    Case(
        "tensor addition",
        "tensor_addition/tensor_addition_nki_kernels.py",
        "nki_tensor_add",
        lambda rng: (
            (rng.standard_normal((256, 1024)).astype(BF16), rng.standard_normal((256, 1024)).astype(BF16)),
            {},
        ),
        lambda a, b: _f64(a) + _f64(b),
        1e-2,
        1e-2,
    ),
    Case(
        "transpose2d",
        "transpose2d/transpose2d_nki_kernels.py",
        "tensor_transpose2D_kernel_",
        lambda rng: ((rng.integers(-100, 100, (5, 3 * 4)).astype(np.int8), (3, 4)), {}),
        lambda a, shape: a.reshape(a.shape[0], *shape).transpose(0, 2, 1).reshape(a.shape[0], -1),
        0,
        0,
    ),
    Case(
        "average_pool2d",
        "average_pool2d/average_pool2d_nki_kernels.py",
        "tensor_avgpool_kernel",
        lambda rng: ((rng.standard_normal((3, 6, 8)).astype(np.float32), 2), {}),
        _pool_ref(np.mean),
    ),
    Case(
        "index case 1 (split even/odd columns)",
        "index-case-1.py",
        "tensor_split_kernel_",
        lambda rng: ((rng.standard_normal((4, 5)).astype(BF16),), {}),
        lambda x: (_f64(x)[:, 0::2], _f64(x)[:, 1::2]),
        0,
        0,
    ),
    Case(
        "index case 3 (max pool)",
        "index-case-3.py",
        "tensor_maxpool_kernel_",
        lambda rng: ((rng.standard_normal((2, 6, 6)).astype(BF16), 2), {}),
        _pool_ref(np.max),
        0,
        0,
    ),
    Case(
        "layout pass (exp)",
        "layout-pass.py",
        "tensor_exp_kernel_",
        lambda rng: ((rng.standard_normal((128, 512)).astype(np.float32),), {}),
        lambda x: np.exp(_f64(x)),
        1e-5,
    ),
    Case(
        "layout violation (256 partitions)",
        "layout-violation.py",
        "tensor_exp_kernel_",
        lambda rng: ((rng.standard_normal((256, 512)).astype(np.float32),), {}),
        None,
        expect_error=emulator.NkiHardwareError,
    ),
    Case(
        "getting started baremetal",
        "getting_started_baremetal.py",
        "nki_tensor_add_kernel",
        lambda rng: (
            (rng.standard_normal((4, 3)).astype(np.float16), rng.standard_normal((4, 3)).astype(np.float16)),
            {},
        ),
        lambda a, b: _f64(a) + _f64(b),
        1e-3,
        1e-3,
    ),
    Case("fused mamba v1", MAMBA, "mamba_v1", _mamba_args, _mamba_ref, 1e-4, 1e-4),
    Case("fused mamba v2", MAMBA, "mamba_v2", _mamba_args, _mamba_ref, 1e-4, 1e-4),
    Case("fused mamba v3", MAMBA, "mamba_v3", _mamba_args, _mamba_ref, 1e-4, 1e-4),
    Case("simulate example (asserts on import)", "simulate/nki_simulate_example.py", None),
    Case(
        "layout loop",
        "layout-loop.py",
        None,
        skip="legacy dialect fragment (imports torch_neuronx.nki_jit, uses undefined i_f)",
    ),
    Case(
        "layout dynamic loop",
        "layout-dynamic-loop.py",
        None,
        skip="documentation fragment with a syntax error (unclosed parenthesis), not runnable",
    ),
]


def _import(path, index):
    spec = importlib.util.spec_from_file_location(f"_aws_nki_example_{index}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_case(case, examples_dir, index, rng):
    """'' when the case passes, else why not."""
    path = os.path.join(examples_dir, case.file)
    saved_env = dict(os.environ)
    try:
        with emulator.as_nki():
            module = _import(path, index)
            if case.kernel is None:
                return ""
            args, kwargs = case.make_args(rng)
            kernel = getattr(module, case.kernel)
            try:
                got = kernel(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - reported, and checked for expected violations
                if case.expect_error is not None and isinstance(error, case.expect_error):
                    return ""
                raise
            if case.expect_error is not None:
                return f"expected {case.expect_error.__name__}, the kernel ran"
            return nkilib_cases.compare_outputs(got, case.reference(*args, **kwargs), case.rtol, case.atol)
    except Exception as error:  # noqa: BLE001 - the runner reports every failure and goes on
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return f"{type(error).__name__}: {error} (at {os.path.basename(frame.filename)}:{frame.lineno})"
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def _run_sdk_examples(sdk_path):
    examples_dir = os.path.join(sdk_path, "nki", "examples")
    rng = np.random.default_rng(0)
    passed = 0
    runnable = 0
    for index, case in enumerate(CASES):
        if case.skip:
            print(f"SKIP  {case.name}: {case.skip}")
            continue
        runnable += 1
        reason = run_case(case, examples_dir, index, rng)
        passed += not reason
        print(f"PASS  {case.name}" if not reason else f"FAIL  {case.name}: {reason}")
    print(f"{passed}/{runnable} runnable examples pass")


def _run_nki_library(checkout):
    results = nkilib_cases.run_cases(checkout)
    for name, reason in results:
        print(f"PASS  nkilib {name}" if not reason else f"FAIL  nkilib {name}: {reason}")
    print(f"{sum(not reason for _, reason in results)}/{len(results)} nki-library kernels pass")


def main(argv):
    del argv
    if FLAGS.sdk_path:
        _run_sdk_examples(os.path.expanduser(FLAGS.sdk_path))
    if FLAGS.nki_library:
        _run_nki_library(os.path.expanduser(FLAGS.nki_library))


if __name__ == "__main__":
    app.run(main)
