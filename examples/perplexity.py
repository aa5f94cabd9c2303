"""Perplexity of a dense model and its SVD-compressed versions on a local text file (`models.perplexity`).

    python examples/perplexity.py --checkpoint /path/to/Llama-3.2-1B --keep 0.6,0.8,0.9
    python examples/perplexity.py --checkpoint /tmp/llama-svd        # a compressed checkpoint: scored as saved
    python examples/perplexity.py --checkpoint gemma-3-270m-it-Q4_K_M.gguf --keep 0.9
    python examples/perplexity.py --preset tiny --method whitened     # random init: only the relative change means much

--checkpoint (alias --checkpoint_dir) is a local Hugging Face directory, a compressed checkpoint directory written by
examples/compress_checkpoint.py (scored at its saved ranks, alone: --keep does not apply) or a llama.cpp GGUF file.

The text (default: the shipped public-domain sample, examples/data/sample.txt) is tokenized with the checkpoint's
tokenizer, or as UTF-8 bytes when there is none (ids 0..255, so the model's vocabulary must cover them), and cut
into non-overlapping windows of --seq_len tokens; perplexity = exp(mean next-token negative log-likelihood).
With --method whitened, the first --calibration_windows windows calibrate the whitening and are left out of
every model's score.
"""

from __future__ import annotations

import os
import time

import _common  # sibling module: the script's folder is on sys.path
import numpy as np
from absl import app, flags

from jax_neuronmm import models, pipeline

DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sample.txt")

_common.define_model_flags()
flags.DEFINE_string("text", DEFAULT_TEXT, "UTF-8 text file to score")
flags.DEFINE_list("keep", ["0.5", "0.8", "0.9"], "parameter fractions to compare against dense, each in (0, 1]")
flags.DEFINE_enum("method", "svd", ["svd", "whitened"], "factorization")
flags.DEFINE_bool("compress_attention", False, "also factor the attention projections")
flags.DEFINE_integer("block", 128, "rank alignment (block_aligned_rank)", lower_bound=1)
flags.DEFINE_integer("seq_len", 128, "tokens per window", lower_bound=2)
flags.DEFINE_integer("calibration_windows", 4, "windows used to calibrate --method whitened", lower_bound=1)
flags.DEFINE_integer("seed", 0, "init seed for --preset")


def _fractions(values) -> bool:
    try:
        return bool(values) and all(0 < float(value) <= 1 for value in values)
    except ValueError:
        return False


flags.register_validator("keep", _fractions, message="--keep must be numbers in (0, 1], comma separated")
FLAGS = flags.FLAGS


def tokenize(model, text: str) -> np.ndarray:
    if model.tokenizer is not None:
        return np.array(model.tokenizer.encode(text).ids)
    ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    if model.config.vocab_size < 256:
        raise app.UsageError(f"byte-level ids need vocab_size >= 256, the model has {model.config.vocab_size}")
    return ids


def load_model():
    """(model, whether it is a compressed checkpoint) from --checkpoint or --preset."""
    model = _common.load_model(seed=FLAGS.seed)
    return model, bool(FLAGS.checkpoint) and models.is_compressed_checkpoint(FLAGS.checkpoint)


def main(argv):
    del argv
    text = _common.read_text("text", FLAGS.text)  # before loading: a wrong path fails at once
    if (
        FLAGS.checkpoint
        and (FLAGS["keep"].present or FLAGS["method"].present)
        and models.is_compressed_checkpoint(FLAGS.checkpoint)
    ):
        raise app.UsageError(
            f"--keep / --method: {FLAGS.checkpoint} is compressed already (it is scored at its saved ranks)"
        )
    model, compressed_already = load_model()
    ids = tokenize(model, text)
    count = len(ids) // FLAGS.seq_len
    calibration_count = FLAGS.calibration_windows if FLAGS.method == "whitened" and not compressed_already else 0
    if count <= calibration_count:
        raise app.UsageError(
            f"{FLAGS.text}: {len(ids)} tokens make {count} windows of {FLAGS.seq_len}; need more "
            f"than the {calibration_count} calibration windows (lower --seq_len)"
        )
    windows = ids[: count * FLAGS.seq_len].reshape(count, FLAGS.seq_len)
    calibration, scored = windows[:calibration_count], windows[calibration_count:]
    print(
        f"{FLAGS.text}: {len(ids)} tokens, scoring {len(scored)} windows of {FLAGS.seq_len}"
        + (f" (+{calibration_count} for calibration)" if calibration_count else "")
    )

    if compressed_already:
        print(f"{'model':24s} {'perplexity':>12s}")
        print(f"{'compressed checkpoint':24s} {models.perplexity(model, scored):12.3f}")
        return
    dense = models.perplexity(model, scored)
    print(f"{'model':24s} {'perplexity':>12s} {'vs dense':>9s}")
    print(f"{'dense':24s} {dense:12.3f} {1.0:9.3f}")
    include = ("mlp", "attention") if FLAGS.compress_attention else ("mlp",)
    for keep in (float(k) for k in FLAGS.keep):
        start = time.perf_counter()
        compressed = pipeline.compress_model(
            model,
            pipeline.Recipe(keep=keep, include=include, method=FLAGS.method, block=FLAGS.block),
            calibration_ids=calibration if calibration_count else None,
        )
        ppl = models.perplexity(compressed, scored)
        print(
            f"{f'{FLAGS.method} keep {keep}':24s} {ppl:12.3f} {ppl / dense:9.3f}   "
            f"({time.perf_counter() - start:.1f} s)"
        )


if __name__ == "__main__":
    app.run(main)
