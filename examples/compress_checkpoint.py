"""Compress a local Hugging Face Llama / Gemma checkpoint into a new directory (`pipeline.compress_checkpoint`): by
default the recommended pipeline, its MLPs' neurons pruned to --keep (--mlp_form factored: SVD factors instead).

    python examples/compress_checkpoint.py --checkpoint_dir ~/llama --output_dir /tmp/llama-svd --keep 0.8
    python examples/compress_checkpoint.py ... --calibration_text my_corpus.txt   # calibrate on your own text
    python examples/compress_checkpoint.py ... --method whitened --steps sequential,distill
    python examples/compress_checkpoint.py ... --method svd                       # plain SVD, no calibration

Writes <output_dir>/model.safetensors (every parameter in our layout, each factored projection as u [in, r] and
v [r, out], pruned MLPs as narrower kernels with the neurons they kept, with method / keep / ranks / per-tensor
sha256 in the header), compression_report.json (rank, params
before/after, relative error per projection) and copies config.json and the tokenizer files. The output directory
must be new or hold none of these files: the source checkpoint is never touched. The default method is the
calibrated pipeline `compress_model` recommends; for every method but svd the text of --calibration_text (default:
the bundled public-domain calibration text) is tokenized with the checkpoint's tokenizer (UTF-8 bytes when it has
none) and its first --calibration_windows windows of --calibration_tokens tokens calibrate the compression (the
distill step trains on its first --distill_windows windows). The calibration default is the accuracy report's
(benchmarks/results/accuracy_report.md: 48 windows of 256 tokens); it distills on 480 windows of two texts (the
novel's chapters 1-49 and the Python reference), this script on 80 windows of one (the bundled calibration text,
chapters 1-12, 22,622 Gemma 3 tokens, holds 88): pass a larger corpus and --distill_windows for more.

Load the result as a model with the saved ranks and widths (no SVD or pruning runs again), or run it with
examples/generate.py --checkpoint OUT:

    from jax_neuronmm.models import generate, load_compressed_checkpoint
    model = load_compressed_checkpoint("/tmp/llama-svd")   # dtype=jnp.bfloat16 for bf16 parameters
    tokens = generate(model, prompt_ids, 32, eos_id=model.eos_token_ids)
"""

import _common  # sibling module: the script's folder is on sys.path
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jax_neuronmm import models, pipeline
from jax_neuronmm.compress import allocation
from jax_neuronmm.pipeline import calibration

flags.DEFINE_string("checkpoint_dir", None, "Local HF checkpoint directory (config.json + *.safetensors).")
flags.DEFINE_string("output_dir", None, "New directory to write the compressed checkpoint into.")
flags.DEFINE_float(
    "keep",
    pipeline.recipe.DEFAULT_KEEP,
    "Fraction of each compressed projection's parameters to keep, in (0, 1].",
)
flags.DEFINE_integer("rank", None, "One rank for every compressed projection (instead of --keep).", lower_bound=1)
flags.DEFINE_enum(
    "method",
    "recommended",
    ["recommended", "svd", "whitened"],
    "recommended: the calibrated pipeline compress_model runs by default (whitened SVD + its recommended "
    "recovery steps); svd: plain truncated SVD, no calibration; whitened: SVD-LLM whitening with --steps.",
)
flags.DEFINE_list("steps", None, f"Recovery steps for --method whitened, from {list(pipeline.recipe.STEPS)}.")
flags.DEFINE_list("include", ["mlp"], "What to compress: mlp and/or attention.")
flags.DEFINE_string(
    "calibration_text",
    calibration.CALIBRATION_TEXT,
    "UTF-8 text that calibrates every method but svd (default: the bundled public-domain text).",
)
flags.DEFINE_integer("calibration_windows", 48, "Windows of the calibration text used.", lower_bound=1)
flags.DEFINE_integer("calibration_tokens", 256, "Tokens per calibration window.", lower_bound=2)
flags.DEFINE_integer(
    "distill_windows",
    80,
    "Windows of the calibration text the distill step trains on (more "
    "than layer-wise calibration uses: distillation gains from more text).",
    lower_bound=1,
)
flags.DEFINE_integer(
    "block",
    None,
    "Rank alignment used with --keep (default: 128, or 64 for the ranks --steps=allocate chooses).",
    lower_bound=1,
)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter dtype of the compressed checkpoint.")
flags.DEFINE_bool(
    "allow_dense",
    True,
    "With the allocate step: a projection may stay dense where that costs less accuracy than its factors "
    "(--noallow_dense: factor every projection).",
)
flags.DEFINE_enum(
    "allocation_solver",
    pipeline.recipe.RECOMMENDED_ALLOCATION_SOLVER,
    list(allocation.SOLVERS),
    "With the allocate step: how ranks are chosen from each projection's costs (lagrangian: each projection's "
    "option of least loss + price x parameters at the smallest price that fits; exact: the least predicted loss).",
)
flags.DEFINE_enum(
    "mlp_form",
    "recommended",
    ["recommended", *pipeline.recipe.MLP_FORMS],
    "How the MLPs are compressed: factored (SVD factors, the fused svd_mlp kernel), pruned (each keeps a fraction "
    "--keep of its neurons, a narrower dense MLP; needs calibration text) or recommended (pruned with --method "
    "recommended and --keep, factored otherwise).",
)
flags.register_validator("keep", lambda keep: 0 < keep <= 1, message="--keep must lie in (0, 1]")
flags.register_validator(
    "steps",
    lambda steps: steps is None or set(steps) <= set(pipeline.recipe.STEPS),
    message=f"--steps takes steps from {list(pipeline.recipe.STEPS)}",
)
flags.register_validator(
    "include",
    lambda parts: bool(parts) and set(parts) <= {"mlp", "attention"},
    message="--include takes mlp and/or attention",
)
FLAGS = flags.FLAGS


def calibration_ids(checkpoint_dir: str, text_path: str, windows: int, tokens: int) -> np.ndarray:
    """Token ids [W, tokens] (W <= windows) of the text, with the checkpoint's tokenizer or as UTF-8 bytes."""
    text = _common.read_text("calibration_text", text_path)
    try:
        tokenizer = models.load_tokenizer(checkpoint_dir)
    except (OSError, ValueError) as error:  # a malformed tokenizer.json names the file
        raise app.UsageError(f"--checkpoint_dir {checkpoint_dir}: {error}") from error
    ids = (
        np.array(tokenizer.encode(text).ids)
        if tokenizer is not None
        else np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    )
    count = min(windows, len(ids) // tokens)
    if count < 1:
        raise app.UsageError(
            f"--calibration_text {text_path}: {len(ids)} tokens, fewer than one window of --calibration_tokens={tokens}"
        )
    return ids[: count * tokens].reshape(count, tokens)


def main(argv):
    del argv
    if FLAGS.rank is not None and FLAGS["keep"].present:
        raise app.UsageError("give --keep or --rank, not both")
    if FLAGS.steps is not None and FLAGS.method != "whitened":
        raise app.UsageError("--steps needs --method whitened (--method recommended picks its own steps)")
    if FLAGS.mlp_form == "pruned" and (FLAGS.method == "svd" or FLAGS.rank is not None or "mlp" not in FLAGS.include):
        raise app.UsageError(
            "--mlp_form pruned keeps a fraction --keep of the MLPs' neurons chosen on calibration "
            "text: it needs --include mlp, --keep rather than --rank, and --method other than svd"
        )
    # Source and output first: a bad --checkpoint_dir / --output_dir fails before any text is read or any compressing.
    try:
        pipeline.compressed_saving.check_output_dir(FLAGS.checkpoint_dir, FLAGS.output_dir)
    except (OSError, ValueError) as error:  # missing / malformed config.json; output empty, a file, taken, read-only
        raise app.UsageError(str(error)) from error
    try:  # from config.json's shapes, before any weight is read
        pipeline.compression.check_rank(
            models.hf_loading.abstract_model(FLAGS.checkpoint_dir, jnp.dtype(FLAGS.dtype)), FLAGS.include, FLAGS.rank
        )
    except ValueError as error:
        raise app.UsageError(f"--{error}") from error
    ids = distill_ids = None
    if FLAGS.method != "svd":
        ids = calibration_ids(
            FLAGS.checkpoint_dir, FLAGS.calibration_text, FLAGS.calibration_windows, FLAGS.calibration_tokens
        )
        steps = pipeline.compression.resolve_pipeline(
            None if FLAGS.method == "recommended" else FLAGS.method, FLAGS.steps, ids, FLAGS.rank
        )[1]
        if "distill" in steps:
            distill_ids = calibration_ids(
                FLAGS.checkpoint_dir, FLAGS.calibration_text, FLAGS.distill_windows, FLAGS.calibration_tokens
            )
    elif FLAGS["calibration_text"].present:
        raise app.UsageError("--calibration_text calibrates every method but svd")
    try:
        report = pipeline.compress_checkpoint(
            FLAGS.checkpoint_dir,
            FLAGS.output_dir,
            pipeline.Recipe(
                keep=None if FLAGS.rank is not None else FLAGS.keep,
                rank=FLAGS.rank,
                include=tuple(FLAGS.include),
                mlp_form=None if FLAGS.mlp_form == "recommended" else FLAGS.mlp_form,
                method=None if FLAGS.method == "recommended" else FLAGS.method,
                steps=FLAGS.steps,
                block=FLAGS.block,
                allow_dense=FLAGS.allow_dense,
                allocation_solver=FLAGS.allocation_solver,
            ),
            calibration_ids=ids,
            distill_ids=distill_ids,
            dtype=jnp.dtype(FLAGS.dtype),
        )
    except (FileExistsError, FileNotFoundError, PermissionError, NotADirectoryError) as error:
        raise app.UsageError(str(error)) from error  # the output taken or made unwritable meanwhile
    print(report)
    print(f"wrote {FLAGS.output_dir}")


if __name__ == "__main__":
    flags.mark_flags_as_required(["checkpoint_dir", "output_dir"])
    app.run(main)
