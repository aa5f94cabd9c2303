"""The neuron lowering, exercised on CPU with a stand-in "neuron" platform.

A stand-in for NKI's JAX integration turns each kernel launch into the custom
call the real `nki.jit` emits (target AwsNeuronCustomNativeKernel); the test
checks what svd_matmul / svd_mlp lower to for platform "neuron".
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mlp_calls import svd_mlp_of_factors
from neuron_platform import stand_in_platform

import jax_neuronmm as jn
from jax_neuronmm import nki_frontend
from jax_neuronmm._compat import is_known_platform
from nki_kernels import emulator


def custom_call_like_nki(kernel, grid, args, kwargs):
    specs = emulator.output_specs(kernel, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args], kwargs)
    call = jax.ffi.ffi_call(
        "AwsNeuronCustomNativeKernel",
        [jax.ShapeDtypeStruct(s, d) for s, d in specs],
        custom_call_api_version=2,
        legacy_backend_config=kernel.__name__,
    )
    outputs = call(*args)
    return outputs[0] if len(outputs) == 1 else outputs


@pytest.fixture
def neuron_platform():
    # The primitives' lowering rule is registered for every platform, so a platform that becomes known after
    # jax_neuronmm was imported (a Neuron plugin loaded late) gets the kernels without a registration of its own.
    with stand_in_platform("neuron"):
        emulator.set_array_frontend(custom_call_like_nki)
        try:
            assert is_known_platform("neuron")
            yield
        finally:
            nki_frontend.install()
    assert not is_known_platform("neuron")  # the stand-in is gone


def kernel_calls(text):
    """(kernel name, operand types, result type) of every NKI custom call in StableHLO text."""
    pattern = r'custom_call @AwsNeuronCustomNativeKernel\(.*?backend_config = "(\w+)".*?: \((.*?)\) -> (.*)'
    return re.findall(pattern, text)


def test_svd_matmul_lowers_to_one_nki_kernel_on_neuron(rng, neuron_platform):
    x = rng.standard_normal((2, 7, 100)).astype(np.float32)
    u, v = rng.standard_normal((100, 13)).astype(np.float32), rng.standard_normal((13, 300)).astype(np.float32)
    text = jax.jit(jn.svd_matmul).trace(x, u, v).lower(lowering_platforms=("neuron",)).as_text()
    calls = kernel_calls(text)
    assert len(calls) == 1
    name, operands, result = calls[0]
    assert name in ("svd_matmul_kernel", "svd_matmul_decode_kernel")
    assert operands == "tensor<14x100xf32>, tensor<100x13xf32>, tensor<13x300xf32>"  # tokens flattened
    assert result.startswith("tensor<14x300xf32>")
    assert "dot_general" not in text


def test_svd_mlp_lowers_to_two_kernels_on_neuron(rng, neuron_platform):
    shapes = [(5, 64), (64, 8), (8, 160), (64, 8), (8, 160), (160, 8), (8, 64)]
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    text = jax.jit(svd_mlp_of_factors).trace(*args).lower(lowering_platforms=("neuron",)).as_text()
    assert [c[0] for c in kernel_calls(text)] == ["svd_mlp_gate_up_kernel", "svd_mlp_down_kernel"]
    assert kernel_calls(text)[0][2].startswith("tensor<160x5xf32>")  # hᵀ [I, T] between the two kernels
    assert "dot_general" not in text


def test_xla_backend_on_neuron_keeps_the_reference(rng, neuron_platform):
    x, u, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 8), (8, 2), (2, 4)))
    with jn.use_backend("xla"):
        text = jax.jit(jn.svd_matmul).trace(x, u, v).lower(lowering_platforms=("neuron",)).as_text()
    assert not kernel_calls(text) and "dot_general" in text


def test_cpu_lowering_is_unchanged_by_the_neuron_rule(rng, neuron_platform):
    x, u, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 8), (8, 2), (2, 4)))
    text = jax.jit(jn.svd_matmul).trace(x, u, v).lower(lowering_platforms=("cpu",)).as_text()
    assert not kernel_calls(text) and "dot_general" in text


def test_neuron_backend_on_cpu_is_a_clear_error(rng):
    x, u, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 8), (8, 2), (2, 4)))
    from jax_neuronmm import backend

    with backend._backend("neuron"), pytest.raises(RuntimeError, match="lowered for platform 'cpu'"):
        jax.jit(jn.svd_matmul)(x, u, v)


def test_fp8_svd_matmul_lowers_to_one_kernel_with_trainium_fp8_and_scales(rng, neuron_platform):
    from jax_neuronmm.compress import quantize_fp8

    x = rng.standard_normal((2, 7, 100)).astype(jnp.bfloat16)
    (u, us), (v, vs) = quantize_fp8(rng.standard_normal((100, 13))), quantize_fp8(rng.standard_normal((13, 300)))
    f = jax.jit(lambda x, u, v, us, vs: jn.svd_matmul(x, u, v, u_scale=us, v_scale=vs))
    text = f.trace(x, u, v, us, vs).lower(lowering_platforms=("neuron",)).as_text()
    calls = kernel_calls(text)
    assert len(calls) == 1
    # float8_e4m3fn storage reaches the kernel reinterpreted as Trainium's float8_e4m3 (same bits within ±240).
    assert calls[0][1] == (
        "tensor<14x100xbf16>, tensor<100x13xf8E4M3>, tensor<13x300xf8E4M3>, tensor<13xf32>, tensor<300xf32>"
    )
    assert "bitcast_convert" in text and "dot_general" not in text


def test_fp8_svd_mlp_lowers_to_two_kernels_with_their_scales(rng, neuron_platform):
    from jax_neuronmm.compress import quantize_fp8

    shapes = [(64, 8), (8, 160), (64, 8), (8, 160), (160, 8), (8, 64)]
    quantized = [quantize_fp8(rng.standard_normal(s)) for s in shapes]
    x = rng.standard_normal((5, 64)).astype(jnp.bfloat16)

    def mlp(x, *weights):
        return svd_mlp_of_factors(x, *weights)

    args = [q for q, _ in quantized] + [s for _, s in quantized]
    text = jax.jit(mlp).trace(x, *args).lower(lowering_platforms=("neuron",)).as_text()
    calls = kernel_calls(text)
    assert [c[0] for c in calls] == ["svd_mlp_gate_up_kernel", "svd_mlp_down_kernel"]
    assert calls[0][1].count("f8E4M3") == 4 and calls[0][1].count("xf32>") == 4
    assert calls[1][1].count("f8E4M3") == 2 and calls[1][1].endswith("tensor<8xf32>, tensor<64xf32>")
