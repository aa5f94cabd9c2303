"""How a model gets compressed: the recommended pipeline and each of its steps, in one place.

  compress_model(model, recipe, calibration_ids)   factored / pruned / fp8 copy of a CausalLM (pipeline.compression)
  Recipe                                           what compress_model does: keep or rank, include, steps, options
  quantize_model(model, ...)                       fp8 e4m3 weights with per-channel scales (pipeline.quantization)
  distill_fp8(model, distill_ids)                  fp8 weights trained for their rounding (pipeline.fp8_distillation)
  compress_checkpoint(src_dir, out_dir, recipe)    a compressed checkpoint directory from a Hugging Face one
  SelfTextOptions                                  the dense model's own samples as distillation text

Its steps: the output Fisher weighting (fisher), rank allocation's costs (sensitivity), layer-by-layer calibration
(sequential), local and end-to-end fine-tuning (local_finetune, distill), MLP neuron pruning (pruning), self-generated
training text (self_distillation) and the shipped calibration text (calibration). The weight math they call lives in
`jax_neuronmm.compress`; the models they run in `jax_neuronmm.models`, which never imports this package.
"""

from jax_neuronmm.pipeline.compressed_saving import compress_checkpoint
from jax_neuronmm.pipeline.compression import compress_model
from jax_neuronmm.pipeline.distill import DistillOptions
from jax_neuronmm.pipeline.fp8_distillation import distill_fp8
from jax_neuronmm.pipeline.local_finetune import LocalFinetuneOptions
from jax_neuronmm.pipeline.quantization import quantize_model
from jax_neuronmm.pipeline.recipe import Recipe
from jax_neuronmm.pipeline.self_distillation import SelfTextOptions

__all__ = [
    "DistillOptions",
    "LocalFinetuneOptions",
    "Recipe",
    "SelfTextOptions",
    "compress_checkpoint",
    "compress_model",
    "distill_fp8",
    "quantize_model",
]
