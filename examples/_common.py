"""What the example scripts share (a sibling module, not a script): the flags that pick a model (--checkpoint, else
a random-init --model / --preset), building that model, and reading a text file, with every problem a usage error
(no traceback)."""

from __future__ import annotations

import jax.numpy as jnp
from absl import app, flags

from jax_neuronmm import models

FLAGS = flags.FLAGS


def define_model_flags():
    """--model, --checkpoint (alias --checkpoint_dir), --preset and --num_layers: what `load_model` reads."""
    flags.DEFINE_enum("model", "llama", list(models.presets.FAMILIES), "model family (with --preset)")
    flags.DEFINE_string(
        "checkpoint",
        None,
        "local HF checkpoint directory, compressed checkpoint directory or GGUF file; overrides --model/--preset",
    )
    flags.DEFINE_alias("checkpoint_dir", "checkpoint")
    flags.DEFINE_enum(
        "preset",
        "tiny",
        list(models.presets.PRESETS),
        f"random-init shape when no --checkpoint, per family: {models.presets.FAMILY_PRESETS}",
    )
    flags.DEFINE_integer("num_layers", None, "override the preset's layer count", lower_bound=1)


def load_model(*, seed: int, dtype=jnp.float32):
    """The model at --checkpoint (`models.load_checkpoint`), else a random-init --model / --preset (--num_layers
    overriding its layer count) from `seed`, in `dtype`. What is wrong with the path, its files or the preset is a
    usage error."""
    if FLAGS.checkpoint:
        try:
            return models.load_checkpoint(FLAGS.checkpoint, dtype=dtype)
        except (OSError, ValueError) as error:  # missing / unreadable files; malformed or tampered ones
            raise app.UsageError(f"--checkpoint {FLAGS.checkpoint}: {error}") from error
    if FLAGS.preset not in models.presets.FAMILY_PRESETS[FLAGS.model]:
        raise app.UsageError(
            f"--preset {FLAGS.preset}: family {FLAGS.model} has presets {models.presets.FAMILY_PRESETS[FLAGS.model]}"
        )
    overrides = {} if FLAGS.num_layers is None else {"num_layers": FLAGS.num_layers}
    return models.from_preset(FLAGS.model, FLAGS.preset, dtype=dtype, seed=seed, **overrides)


def read_text(flag: str, path: str) -> str:
    """The UTF-8 text of the file `path` given as --`flag`, or a usage error saying why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as error:
        raise app.UsageError(f"--{flag} {path}: not UTF-8 text ({error})") from error
    except OSError as error:  # missing, a directory, unreadable
        raise app.UsageError(f"--{flag} {path}: cannot read it ({error.strerror or error})") from error
