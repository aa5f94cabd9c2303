"""Generate text with a dense or SVD-compressed Llama / Gemma, on XLA or on the NKI emulator.

    python examples/generate.py --checkpoint /path/to/Llama-3.2-1B --prompt "The meaning of life is" --keep 0.8
    python examples/generate.py --checkpoint /tmp/llama-svd --prompt "Hello"   # from compress_checkpoint.py
    python examples/generate.py --checkpoint gemma-3-270m-it-Q4_K_M.gguf --prompt "Hello"
    python examples/generate.py --model gemma3 --preset tiny --keep 0.8 --backend emulator --max_new_tokens 8
    python examples/generate.py --preset 1b --num_layers 2 --prompt_ids 1,2,3 --keep 0.8

--checkpoint (alias --checkpoint_dir) is a local Hugging Face directory (config.json, *.safetensors,
tokenizer.json), a compressed checkpoint directory written by examples/compress_checkpoint.py (loaded at its saved
ranks; --keep then does not apply) or a llama.cpp GGUF file; without one, --preset builds a random-init model of
that shape (its text is noise; its speed is real). Prints the continuation (text with a tokenizer, ids without), the
model's perplexity on the prompt followed by its continuation (`models.perplexity`), decode tokens/s, and with
--backend emulator one row per NKI kernel with its launches and modeled Trainium latency (--profile_launches: one
row per launch too), followed by what each column means.
"""

from __future__ import annotations

import math
import time

import _common  # sibling module: the script's folder is on sys.path
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jax_neuronmm
from jax_neuronmm import models, pipeline, profiling
from jax_neuronmm.models.validation import check_token_ids

_common.define_model_flags()
flags.DEFINE_float("keep", None, "compress MLPs keeping this fraction of parameters, in (0, 1] (omit: dense)")
flags.DEFINE_enum("method", "svd", ["svd", "whitened"], "factorization; whitened calibrates on the prompt")
flags.DEFINE_bool("compress_attention", False, "also factor the attention projections")
flags.DEFINE_enum("backend", "xla", ["xla", "emulator"], "how svd_matmul / svd_mlp run")
flags.DEFINE_bool("profile_launches", False, "with --backend emulator: also print one row per kernel launch")
flags.DEFINE_string("prompt", None, "prompt text (needs a tokenizer)")
flags.DEFINE_list("prompt_ids", None, "prompt token ids, comma separated")
flags.DEFINE_integer("max_new_tokens", 32, "tokens to generate", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "0 = greedy", lower_bound=0.0)
flags.DEFINE_integer("top_k", None, "sample from the k most likely tokens", lower_bound=1)
flags.DEFINE_float("top_p", None, "nucleus sampling mass, in (0, 1]")
flags.DEFINE_integer("seed", 0, "init and sampling seed")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter dtype")
flags.register_validator("keep", lambda keep: keep is None or 0 < keep <= 1, message="--keep must lie in (0, 1]")
flags.register_validator("top_p", lambda p: p is None or 0 < p <= 1, message="--top_p must lie in (0, 1]")
flags.register_validator("temperature", math.isfinite, message="--temperature must be a finite number >= 0")
flags.register_validator(
    "prompt_ids",
    lambda ids: ids is None or (bool(ids) and all(i.strip().isdigit() for i in ids)),
    message="--prompt_ids must be one or more non-negative integers, comma separated",
)
flags.register_multi_flags_validator(
    ["prompt", "prompt_ids"],
    lambda values: values["prompt"] is None or values["prompt_ids"] is None,
    message="give --prompt or --prompt_ids, not both",
)
FLAGS = flags.FLAGS


def build_model():
    if FLAGS.checkpoint and FLAGS.keep is not None and models.is_compressed_checkpoint(FLAGS.checkpoint):
        raise app.UsageError(f"--keep: {FLAGS.checkpoint} is compressed already (it loads at its saved ranks)")
    return _common.load_model(seed=FLAGS.seed, dtype=jnp.dtype(FLAGS.dtype))


def prompt_ids(model) -> np.ndarray:
    if FLAGS.prompt is not None:
        if model.tokenizer is None:
            raise app.UsageError(
                "--prompt needs a tokenizer (a --checkpoint with tokenizer.json or a GGUF vocabulary); use --prompt_ids"
            )
        return np.array([model.tokenizer.encode(FLAGS.prompt).ids])
    ids = np.array([[int(i) for i in FLAGS.prompt_ids or ["1", "2", "3", "4"]]])
    try:
        return check_token_ids(ids, model.config.vocab_size, name="--prompt_ids")
    except ValueError as error:
        raise app.UsageError(str(error)) from error


def main(argv):
    del argv
    model = build_model()
    ids = prompt_ids(model)
    if FLAGS.top_k is not None and FLAGS.top_k > model.config.vocab_size:
        raise app.UsageError(f"--top_k must be at most the vocabulary size {model.config.vocab_size}")
    if FLAGS.keep is not None:
        include = ("mlp", "attention") if FLAGS.compress_attention else ("mlp",)
        start = time.perf_counter()
        model = pipeline.compress_model(
            model,
            pipeline.Recipe(keep=FLAGS.keep, include=include, method=FLAGS.method),
            calibration_ids=ids if FLAGS.method == "whitened" else None,
        )
        print(
            f"compressed ({FLAGS.method}, keep {FLAGS.keep}, {'+'.join(include)}) in "
            f"{time.perf_counter() - start:.1f} s"
        )
    eos = model.eos_token_ids or None
    sampling = dict(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, eos_id=eos, seed=FLAGS.seed)
    context = model.config.max_position_embeddings
    if context is not None and ids.shape[1] + FLAGS.max_new_tokens > context:
        raise app.UsageError(
            f"--max_new_tokens: {ids.shape[1]} prompt tokens + {FLAGS.max_new_tokens} exceed the "
            f"model's context of {context}"
        )

    with jax_neuronmm.use_backend(FLAGS.backend), jax_neuronmm.profile() as prof:
        if FLAGS.backend == "xla":
            # Compile prefill and decode step once, so the timed run measures decoding, not compilation.
            models.generate(model, ids, FLAGS.max_new_tokens, **sampling).block_until_ready()
        start = time.perf_counter()
        out = np.asarray(models.generate(model, ids, FLAGS.max_new_tokens, **sampling))
        seconds = time.perf_counter() - start

    new = out[0, ids.shape[1] :]
    # Scored on XLA, outside the profile: how likely the model finds its own text (greedy text scores low).
    scored = models.perplexity(model, out[:1])
    if model.tokenizer is not None:
        print("text:", model.tokenizer.decode(ids[0].tolist()) + " ⟶ " + model.tokenizer.decode(new.tolist()))
    print("prompt ids:", ids[0].tolist())
    print("new ids:   ", new.tolist())
    print(f"perplexity of prompt + continuation: {scored:.3f}")
    label = "emulated (NKI emulator on CPU, first call incl. compile)" if FLAGS.backend == "emulator" else "XLA CPU"
    print(f"{len(new)} tokens in {seconds:.2f} s: {len(new) / seconds:.1f} tokens/s [{label}]")
    if FLAGS.backend == "emulator":
        print(f"\nNKI kernels on the emulator ({len(prof)} launches):")
        print(prof.grouped())
        if FLAGS.profile_launches:
            print()
            print(prof)
        print()
        print(profiling.LEGEND)


if __name__ == "__main__":
    app.run(main)
