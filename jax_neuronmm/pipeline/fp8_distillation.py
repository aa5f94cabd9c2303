"""distill_fp8: fp8 weights whose rounding the model was trained for (quantization-aware distillation).

Rounding a small model's attention and MLP weights to fp8 e4m3 (3 mantissa bits) costs 1-4% perplexity on some
kinds of text whichever way it rounds: GPTQ lowers the error on the inputs of its calibration text, not on those of
text of another kind (benchmarks/results/generalization.md). Here a float copy of the model is fine-tuned with the
rounding in every forward pass (each projection kernel rounded to nearest with a scale per output channel, the
gradient passed straight through) toward the dense model's next-token distributions, on the user's windows and the
dense model's own samples (distillation on the model's generations, as LLM-QAT, Liu et al. 2023, does), the step
kept chosen on held-out generated windows; the result is that copy rounded to nearest, the rounding training saw.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from jax_neuronmm.compress.projections import ATTENTION_PROJECTIONS, MLP_PROJECTIONS
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.validation import check_token_windows
from jax_neuronmm.nn.nnx import describe
from jax_neuronmm.pipeline import distill, quantization, self_distillation

# Adam's peak step relative to each kernel's RMS before `scaled_options` scales it to the text trained on: a tenth of
# what factors take, as the kernels start at the dense model's weights and a step need only move values across
# rounding boundaries (an fp8 e4m3 value's neighbours are 6-12% of it apart).
LEARNING_RATE = 2e-4
TARGETS = ("attention", "mlp")
# Where each target's projections sit in a decoder layer, and their names.
_MODULES = {"attention": "self_attn", "mlp": "mlp"}
_PROJECTIONS = {"attention": ATTENTION_PROJECTIONS, "mlp": MLP_PROJECTIONS}


def distill_fp8(model: CausalLM, distill_ids, targets=TARGETS, *, options=None, self_text=True, progress=True):
    """A copy of `model` with fp8 e4m3 weights in `targets`, trained for their rounding; `model` is left unchanged.

    Args:
      model: a CausalLM (Llama, Gemma) whose targeted projections are nnx.Linear (not compressed or quantized).
      distill_ids: the user's token windows [B, T] (int ids; with self_text, T longer than its prompt_tokens).
      targets: a non-empty subset of ("attention", "mlp"); the LM head stays in the model's dtype.
      options: DistillOptions (None: the defaults at LEARNING_RATE, steps and step sizes scaled to the windows
        trained on, `self_distillation.scaled_options`); their weight_dtype is set to "float8_e4m3".
      self_text: the dense model's own samples mixed into the training windows, their last `holdout` held out to
        choose the step kept: SelfTextOptions, True (the defaults) or False (the user's windows only).
      progress: show progress bars (generation, distillation).

    Returns:
      The quantized copy, as `quantize_model` returns (round to nearest, one scale per output channel); its
      `nnx.state` saves and loads with `compress.save_compressed` / `load_compressed`.
    """
    op = "distill_fp8"
    if not isinstance(model, CausalLM):
        raise TypeError(f"{op}: model is a {type(model).__name__}; expected a CausalLM")
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets or set(targets) - set(TARGETS):
        raise ValueError(f"{op}: targets={targets!r}; expected a non-empty subset of {TARGETS}")
    for index, layer in enumerate(model.layers):
        for target in targets:
            for name in _PROJECTIONS[target]:
                module = getattr(getattr(layer, _MODULES[target]), name, None)
                if not isinstance(module, nnx.Linear):
                    raise TypeError(
                        f"{op}: layer {index} {_MODULES[target]}.{name} is {describe(module)}; expected an "
                        "nnx.Linear (a model not compressed or quantized: compress_model trains factors through fp8)"
                    )
    ids = check_token_windows(distill_ids, model.config.vocab_size, name=f"{op}: distill_ids")
    if self_text is True:
        self_text = self_distillation.SelfTextOptions()
    elif self_text is False:
        self_text = None
    elif not isinstance(self_text, self_distillation.SelfTextOptions):
        raise TypeError(f"{op}: self_text={self_text!r}; expected SelfTextOptions, True or False")
    base = dataclasses.replace(
        options or distill.DistillOptions(learning_rate=LEARNING_RATE), weight_dtype="float8_e4m3"
    )
    training_ids, options, _ = self_distillation.distillation_text(
        model, ids, base, options is None, self_text, progress
    )
    student = nnx.clone(model)
    distill.distill_factors(student, model, training_ids, options, progress=progress, trained=_kernels(targets))
    return quantization.quantize_model(student, targets=targets, progress=False)


def _kernels(targets):
    """nnx filter of the kernels of `targets`' projections: paths layers/<i>/<self_attn or mlp>/<name>/kernel."""
    modules = {_MODULES[target] for target in targets}

    def trained(path, value) -> bool:
        return (
            isinstance(value, nnx.Param)
            and len(path) == 5
            and path[0] == "layers"
            and path[2] in modules
            and path[-1] == "kernel"
        )

    return trained
