"""quantize_model: a copy of a model whose projections and LM head hold fp8 e4m3 weights with fp32 scales.

Dense projections become `nn.fp8.Fp8Linear`, SVD-factored ones `Fp8SVDLinear` / `Fp8SVDMLP` (each factor
quantized per column), the LM head an Fp8Linear (a tied embedding stays bf16 for the lookup; the head gets its
own fp8 copy, transposed, one scale per vocabulary entry). Quantization is round-to-nearest with one scale per
output channel (`compress.quantize_fp8`); calibration-aware rounding is not implemented yet.

Quantized models generate through their own forward (the decode-step kernels take no fp8 weights yet).
"""

from __future__ import annotations

from flax import nnx

from jax_neuronmm.compress.projections import ATTENTION_PROJECTIONS, MLP_PROJECTIONS
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.layers import GatedMLP
from jax_neuronmm.nn.fp8 import Fp8Linear, Fp8SVDLinear, Fp8SVDMLP
from jax_neuronmm.nn.nnx import SVDMLP, SVDLinear

WEIGHT_DTYPES = ("float8_e4m3",)
TARGETS = ("attention", "mlp", "head")


def _quantized(module, where):
    if isinstance(module, nnx.Linear):
        return Fp8Linear.from_linear(module)
    if isinstance(module, SVDLinear):
        return Fp8SVDLinear.from_svd(module)
    raise TypeError(f"quantize_model: {where} is a {type(module).__name__}; expected nnx.Linear or SVDLinear")


def quantize_model(model: CausalLM, weight_dtype="float8_e4m3", calibration_ids=None, targets=TARGETS) -> CausalLM:
    """A copy of `model` with fp8 weights in `targets`; the input model is left unchanged.

    Args:
      model: a CausalLM (Llama, Gemma), dense or compressed by `compress_model`.
      weight_dtype: "float8_e4m3" (Trainium's e4m3, ±240, stored as float8_e4m3fn), the only format.
      calibration_ids: must be None for now (calibration-aware rounding is not implemented).
      targets: a subset of ("attention", "mlp", "head"): the attention projections, the MLPs, the LM head.

    Returns:
      The quantized copy. Its `nnx.state` saves and loads with `compress.save_compressed` / `load_compressed`.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"quantize_model: weight_dtype={weight_dtype!r}; expected one of {WEIGHT_DTYPES}")
    if calibration_ids is not None:
        raise NotImplementedError(
            "quantize_model: calibration_ids: calibration-aware rounding is not implemented yet; pass None for "
            "round-to-nearest"
        )
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets or set(targets) - set(TARGETS):
        raise ValueError(f"quantize_model: targets={targets!r}; expected a non-empty subset of {TARGETS}")
    if not isinstance(model, CausalLM):
        raise TypeError(f"quantize_model: model is a {type(model).__name__}; expected a CausalLM")
    quantized = nnx.clone(model)
    for index, layer in enumerate(quantized.layers):
        if "attention" in targets:
            for name in ATTENTION_PROJECTIONS:
                module = getattr(layer.self_attn, name)
                setattr(layer.self_attn, name, _quantized(module, f"layer {index} {name}"))
        if "mlp" in targets:
            if isinstance(layer.mlp, SVDMLP):
                layer.mlp = Fp8SVDMLP.from_svd(layer.mlp)
            elif isinstance(layer.mlp, GatedMLP):
                for name in MLP_PROJECTIONS:
                    setattr(layer.mlp, name, _quantized(getattr(layer.mlp, name), f"layer {index} mlp.{name}"))
            else:
                raise TypeError(f"quantize_model: layer {index} mlp is a {type(layer.mlp).__name__}")
    if "head" in targets:
        if quantized.lm_head is None:
            # lm_head was None (static); the head now holds data.
            quantized.lm_head = nnx.data(Fp8Linear.from_embedding(quantized.embed_tokens))
        else:
            quantized.lm_head = _quantized(quantized.lm_head, "lm_head")
    return quantized
