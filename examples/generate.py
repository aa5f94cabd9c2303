"""Generate text with a dense or SVD-compressed Llama / Gemma, on XLA or on the NKI emulator.

    python examples/generate.py --checkpoint /path/to/Llama-3.2-1B --prompt "The meaning of life is" --keep 0.8
    python examples/generate.py --model gemma3 --preset tiny --keep 0.8 --backend emulator --max_new_tokens 8
    python examples/generate.py --preset 1b --num_layers 2 --prompt_ids 1,2,3 --keep 0.8

--checkpoint is a local Hugging Face directory (config.json, *.safetensors, tokenizer.json); without one, --preset
builds a random-init model of that shape (its text is noise; its speed is real). Prints the continuation (text
with a tokenizer, ids without), decode tokens/s, and with --backend emulator the NKI kernels that ran and their
modeled Trainium latency.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jax_neuronmm
from jax_neuronmm import models

flags.DEFINE_enum("model", "llama", list(models.presets.FAMILIES), "model family (with --preset)")
flags.DEFINE_string("checkpoint", None, "local HF checkpoint directory; overrides --model/--preset")
flags.DEFINE_enum("preset", "tiny", list(models.presets.PRESETS), "random-init shape when no --checkpoint")
flags.DEFINE_integer("num_layers", None, "override the preset's layer count (a 1b preset with fewer layers)")
flags.DEFINE_float("keep", None, "compress MLPs keeping this fraction of parameters (omit for the dense model)")
flags.DEFINE_enum("method", "svd", ["svd", "whitened"], "factorization; whitened calibrates on the prompt")
flags.DEFINE_bool("compress_attention", False, "also factor the attention projections")
flags.DEFINE_enum("backend", "xla", ["xla", "emulator"], "how svd_matmul / svd_mlp run")
flags.DEFINE_string("prompt", None, "prompt text (needs a tokenizer)")
flags.DEFINE_list("prompt_ids", None, "prompt token ids, comma separated")
flags.DEFINE_integer("max_new_tokens", 32, "tokens to generate")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("top_k", None, "sample from the k most likely tokens")
flags.DEFINE_float("top_p", None, "nucleus sampling mass")
flags.DEFINE_integer("seed", 0, "init and sampling seed")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter dtype")
FLAGS = flags.FLAGS


def build_model():
    dtype = jnp.dtype(FLAGS.dtype)
    if FLAGS.checkpoint:
        return models.load_hf(FLAGS.checkpoint, dtype=dtype)
    overrides = {} if FLAGS.num_layers is None else {"num_layers": FLAGS.num_layers}
    return models.from_preset(FLAGS.model, FLAGS.preset, dtype=dtype, seed=FLAGS.seed, **overrides)


def prompt_ids(model) -> np.ndarray:
    if FLAGS.prompt is not None and FLAGS.prompt_ids is not None:
        raise app.UsageError("give --prompt or --prompt_ids, not both")
    if FLAGS.prompt is not None:
        if model.tokenizer is None:
            raise app.UsageError("--prompt needs a tokenizer (a --checkpoint with tokenizer.json); use --prompt_ids")
        return np.array([model.tokenizer.encode(FLAGS.prompt).ids])
    ids = FLAGS.prompt_ids or ["1", "2", "3", "4"]
    ids = np.array([[int(i) for i in ids]])
    if ids.max() >= model.config.vocab_size or ids.min() < 0:
        raise app.UsageError(f"--prompt_ids must lie in [0, {model.config.vocab_size})")
    return ids


def main(argv):
    del argv
    model = build_model()
    ids = prompt_ids(model)
    if FLAGS.keep is not None:
        include = ("mlp", "attention") if FLAGS.compress_attention else ("mlp",)
        start = time.perf_counter()
        model = models.compress_model(
            model, keep=FLAGS.keep, method=FLAGS.method, include=include,
            calibration_ids=ids if FLAGS.method == "whitened" else None)
        print(f"compressed ({FLAGS.method}, keep {FLAGS.keep}, {'+'.join(include)}) in "
              f"{time.perf_counter() - start:.1f} s")
    eos = model.eos_token_ids or None
    sampling = dict(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, eos_id=eos,
                    seed=FLAGS.seed)

    with jax_neuronmm.use_backend(FLAGS.backend), jax_neuronmm.profile() as prof:
        if FLAGS.backend == "xla":
            # Compile prefill and decode step once, so the timed run measures decoding, not compilation.
            models.generate(model, ids, FLAGS.max_new_tokens, **sampling).block_until_ready()
        start = time.perf_counter()
        out = np.asarray(models.generate(model, ids, FLAGS.max_new_tokens, **sampling))
        seconds = time.perf_counter() - start

    new = out[0, ids.shape[1]:]
    if model.tokenizer is not None:
        print("text:", model.tokenizer.decode(ids[0].tolist()) + " ⟶ " + model.tokenizer.decode(new.tolist()))
    print("prompt ids:", ids[0].tolist())
    print("new ids:   ", new.tolist())
    label = "emulated (NKI emulator on CPU, first call incl. compile)" if FLAGS.backend == "emulator" else "XLA CPU"
    print(f"{len(new)} tokens in {seconds:.2f} s: {len(new) / seconds:.1f} tokens/s [{label}]")
    if FLAGS.backend == "emulator":
        print(prof)


if __name__ == "__main__":
    app.run(main)
