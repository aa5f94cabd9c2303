"""Training text for distillation that the dense model writes itself (data-free distillation, as in LLM-QAT).

A few thousand tokens of a user's text teach a compressed model that text; what it must keep is the dense model's
behaviour on whatever arrives. The dense model's own samples (temperature 1, top-p) are drawn from that
distribution: some windows start from the beginning-of-sequence token alone, the others continue short prompts cut
from the user's text, so the samples cover both what the model writes unprompted and the user's domain. They are
generated in batches through `models.generate` (the decode-step primitive), cached on disk under a key of the
model's weights and every setting (atomic writes), and mixed with the user's windows; windows the training never
sees are generated ones, so the step kept is chosen on text of the model's own kind rather than on the user's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jax_neuronmm.compress import checkpoint
from jax_neuronmm.models.generation import generate
from jax_neuronmm.pipeline import distill as distillation

# Bumped when the way samples are drawn changes, so older cache files are not reused.
_CACHE_VERSION = 1


def default_cache_dir() -> str:
    """$JAX_NEURONMM_CACHE, else $XDG_CACHE_HOME/jax_neuronmm, else ~/.cache/jax_neuronmm; samples go in
    "generated/" under it."""
    root = os.environ.get("JAX_NEURONMM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "jax_neuronmm"
    )
    return os.path.join(root, "generated")


@dataclasses.dataclass(frozen=True)
class SelfTextOptions:
    """How much of its own text the dense model writes, and how.

    windows: generated windows, each as long as the user's windows; from_start: fraction of them started from a
    start token alone: start_id, else the first token the user's windows share (their beginning-of-sequence token;
    with neither, every window continues a prompt); prompt_tokens: tokens of the user's text each other window
    continues (after the shared first token, when there is one); temperature, top_p: sampling; batch: windows
    generated together; holdout:
    generated windows no step trains on, on which the step kept is chosen; calibration_windows: generated windows
    (of those trained on) that compress_model also adds to the calibration windows of its layer-wise steps
    (whitening, Fisher weights, neuron choice), so those steps see the model's general text beside the user's;
    seed: prompts and samples; cache_dir: where samples are cached (None: `default_cache_dir()`; "": not cached).
    """

    windows: int = 96
    from_start: float = 0.25
    prompt_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 0.95
    batch: int = 16
    holdout: int = 8
    calibration_windows: int = 32
    start_id: int | None = None
    seed: int = 0
    cache_dir: str | None = None

    def __post_init__(self):
        for name, low in (
            ("windows", 1),
            ("prompt_tokens", 1),
            ("batch", 1),
            ("holdout", 1),
            ("calibration_windows", 0),
            ("seed", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"SelfTextOptions.{name}: got {value!r}, expected an int >= {low}")
        if self.holdout >= self.windows:
            raise ValueError(
                f"SelfTextOptions.holdout: got {self.holdout}, expected fewer than windows ({self.windows}): "
                "the rest are trained on"
            )
        if self.calibration_windows > self.windows - self.holdout:
            raise ValueError(
                f"SelfTextOptions.calibration_windows: got {self.calibration_windows}, expected at most windows - "
                f"holdout ({self.windows - self.holdout}): held-out windows are seen by no step"
            )
        for name, low, high in (("from_start", 0.0, 1.0), ("top_p", 1e-9, 1.0), ("temperature", 1e-9, math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"SelfTextOptions.{name}: got {value!r}, expected a number in [{low}, {high}]")
        if self.start_id is not None and (
            isinstance(self.start_id, bool) or not isinstance(self.start_id, int) or self.start_id < 0
        ):
            raise ValueError(f"SelfTextOptions.start_id: got {self.start_id!r}, expected None or a token id >= 0")
        if self.cache_dir is not None and not isinstance(self.cache_dir, str):
            raise ValueError(f"SelfTextOptions.cache_dir: got {self.cache_dir!r}, expected None or a path string")


def start_token(user_ids: np.ndarray) -> int | None:
    """The first token every window of user_ids [B, T] shares (a beginning-of-sequence token), else None."""
    first = np.asarray(user_ids)[:, 0]
    return int(first[0]) if np.all(first == first[0]) else None


def prompts(user_ids: np.ndarray, options: SelfTextOptions) -> tuple[np.ndarray, np.ndarray]:
    """(start prompts [S, 1], text prompts [P, prompt_tokens (+1)]) for options.windows samples: S =
    round(windows · from_start) rows of the start token (options.start_id, else the first token all windows of
    user_ids [B, T] share; 0 rows when there is neither), the rest prompt_tokens consecutive tokens from a random
    window and offset of user_ids (after the shared first token, which leads each of them)."""
    user_ids = np.asarray(user_ids)
    shared = start_token(user_ids)
    first = options.start_id if options.start_id is not None else shared
    body = user_ids if shared is None else user_ids[:, 1:]
    if body.shape[1] <= options.prompt_tokens:
        raise ValueError(
            f"user_ids: windows of {user_ids.shape[1]} tokens, too short for prompts of "
            f"{options.prompt_tokens} tokens (SelfTextOptions.prompt_tokens)"
        )
    starts = 0 if first is None else round(options.windows * options.from_start)
    rng = np.random.default_rng(options.seed)
    rows = rng.integers(0, body.shape[0], options.windows - starts)
    offsets = rng.integers(0, body.shape[1] - options.prompt_tokens + 1, options.windows - starts)
    text = np.stack([body[r, o : o + options.prompt_tokens] for r, o in zip(rows, offsets)]).reshape(
        -1, options.prompt_tokens
    )
    if shared is not None:
        text = np.concatenate([np.full((text.shape[0], 1), shared), text], axis=1)
    return np.full((starts, 1), first if first is not None else 0, np.int64), text


def model_digest(model) -> str:
    """sha256 over a model's configuration and every parameter's path, dtype, shape and bytes."""
    digest = hashlib.sha256(repr(model.config).encode())
    for path, value in sorted(nnx.to_flat_state(nnx.state(model, nnx.Param)), key=lambda item: str(item[0])):
        array = np.asarray(jax.device_get(value[...]))
        digest.update(f"{path}|{array.dtype}|{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def generated_windows(model, user_ids, options: SelfTextOptions = SelfTextOptions(), *, progress: bool = True):
    """options.windows windows [W, T] of `model`'s own text, T the length of user_ids' windows [B, T]: each window is
    its prompt (`prompts`) followed by sampled tokens (models.generate, options' temperature and top-p, seeded).

    Cached in options.cache_dir under a key of the model's weights, the prompts and every setting: a second call
    with the same model and settings reads the file instead of generating (a cache file that does not hold such
    windows is not used, and is regenerated)."""
    user_ids = np.asarray(user_ids)
    if user_ids.ndim != 2:
        raise ValueError(f"user_ids: got shape {user_ids.shape}, expected token ids [B, T]")
    start, text = prompts(user_ids, options)
    length = user_ids.shape[1]
    cache = None
    if options.cache_dir != "":
        key = hashlib.sha256(
            f"v{_CACHE_VERSION}|{model_digest(model)}|{length}|{options.temperature}|{options.top_p}|"
            f"{options.batch}|{options.seed}".encode()
            + start.astype(np.int64).tobytes()  # one key whatever integer type the caller's ids have
            + text.astype(np.int64).tobytes()
        ).hexdigest()[:24]
        cache = os.path.join(options.cache_dir or default_cache_dir(), f"generated-{key}.npy")
        cached = _read_cache(cache, (options.windows, length), model.config.vocab_size)
        if cached is not None:
            return cached
    bar = tqdm(total=options.windows * length, desc="generating training text", unit="tok", disable=not progress)
    parts = [_sample(model, group, length, options, bar, index) for index, group in enumerate((start, text))]
    bar.close()
    windows = np.concatenate([part for part in parts if part.size]).astype(np.int32)
    if cache is not None:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        checkpoint.write_atomically(cache, lambda temporary: _save(temporary, windows))
    return windows


def _save(path: str, windows: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file, not a path: np.save would append ".npy" to the temporary's name
        np.save(f, windows, allow_pickle=False)


def _read_cache(path: str, shape: tuple, vocab: int) -> np.ndarray | None:
    """The cached windows at path when the file holds int32 ids of `shape` in [0, vocab), else None."""
    if not os.path.isfile(path):
        return None
    try:
        windows = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if windows.dtype != np.int32 or windows.shape != shape or windows.min() < 0 or windows.max() >= vocab:
        return None
    return windows


def _sample(model, group: np.ndarray, length: int, options: SelfTextOptions, bar, index: int) -> np.ndarray:
    """Windows [len(group), length]: each prompt row of `group` continued by sampling, options.batch rows at a time
    (the last batch padded with repeats of its first row, so every batch shares one compiled decode step)."""
    if group.shape[0] == 0:
        return np.zeros((0, length), np.int32)
    out = []
    for begin in range(0, group.shape[0], options.batch):
        rows = group[begin : begin + options.batch]
        padded = np.concatenate([rows, np.repeat(rows[:1], options.batch - rows.shape[0], axis=0)])
        sampled = generate(
            model,
            padded,
            length - group.shape[1],
            temperature=options.temperature,
            top_p=options.top_p,
            seed=options.seed * 1_000_003 + index * 10_007 + begin,
        )
        out.append(np.asarray(sampled)[: rows.shape[0]])
        bar.update(rows.shape[0] * length)
    return np.concatenate(out)


def mixed_windows(user_ids, generated: np.ndarray, holdout: int) -> np.ndarray:
    """Distillation windows [B + W, T]: the user's windows [B, T] interleaved with the first W − holdout generated
    ones [W, T], then the last `holdout` generated windows, which `distill_factors` holds out (its last
    DistillOptions.holdout windows) to choose the step kept."""
    user_ids, generated = np.asarray(user_ids), np.asarray(generated)
    if user_ids.shape[1:] != generated.shape[1:]:
        raise ValueError(f"generated: windows of shape {generated.shape[1:]}, expected the user's {user_ids.shape[1:]}")
    if not 1 <= holdout < generated.shape[0]:
        raise ValueError(f"holdout: got {holdout}, expected 1 <= holdout < {generated.shape[0]} generated windows")
    train = generated[: generated.shape[0] - holdout]
    # Spread the user's windows evenly among the generated ones, so any leading slice holds both.
    order = np.argsort(
        np.concatenate([np.arange(user_ids.shape[0]) / user_ids.shape[0], np.arange(train.shape[0]) / train.shape[0]]),
        kind="stable",
    )
    mixed = np.concatenate([user_ids, train])[order]
    return np.concatenate([mixed, generated[generated.shape[0] - holdout :]]).astype(np.int32)


# The text the default DistillOptions.steps were chosen for (the accuracy report's 480 windows, two texts); runs
# on less text take fewer steps at a lower step size, so small text is not trained on for many epochs.
_REFERENCE_WINDOWS = 480
_MAX_EPOCHS = 2
_MIN_STEPS = 40


def scaled_options(train_windows: int, holdout: int, base=None):
    """`base` (DistillOptions; None: the defaults) with steps and learning rates scaled to train_windows: at most
    _MAX_EPOCHS passes over them (and at most base.steps, at least _MIN_STEPS), peak step sizes times
    sqrt(train_windows / _REFERENCE_WINDOWS) (at most 1x), about 12 held-out measurements, `holdout` windows held
    out."""
    if isinstance(train_windows, bool) or not isinstance(train_windows, int) or train_windows < 1:
        raise ValueError(f"train_windows: got {train_windows!r}, expected an int >= 1")
    base = distillation.DistillOptions() if base is None else base
    steps = int(min(base.steps, max(_MIN_STEPS, _MAX_EPOCHS * train_windows // base.batch)))
    scale = min(1.0, math.sqrt(train_windows / _REFERENCE_WINDOWS))
    return dataclasses.replace(
        base,
        steps=steps,
        warmup=min(base.warmup, steps // 10),
        learning_rate=base.learning_rate * scale,
        pruned_learning_rate=base.pruned_learning_rate * scale,
        eval_every=max(1, steps // 12),
        holdout=holdout,
    )


def distillation_text(dense, training_ids, distill, scale_distill: bool, self_text, progress: bool = True):
    """(the "distill" step's windows, its options, the generated windows or None): training_ids mixed with the
    dense model's own samples when self_text is given (the generated windows last held out), and options scaled to
    the windows trained on when the caller gave none (`scaled_options`)."""
    base = distill or distillation.DistillOptions()
    holdout, generated = base.holdout, None
    if self_text is not None:
        generated = generated_windows(dense, training_ids, self_text, progress=progress)
        training_ids = mixed_windows(training_ids, generated, self_text.holdout)
        holdout = self_text.holdout
    held = holdout if training_ids.shape[0] > holdout else 0
    if scale_distill:
        distill = scaled_options(training_ids.shape[0] - held, holdout, base)
    else:
        distill = dataclasses.replace(base, holdout=holdout)
    return training_ids, distill, generated
