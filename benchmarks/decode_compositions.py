"""Decode step over all layers: one kernel per op vs one per layer vs one looped kernel, modeled on trn1 / trn2.

For Gemma 3 270M, Llama-3.2-1B and Llama-3.1-8B shapes (the presets of their published config.json, as
`jax_neuronmm.models.decode.decode_plan` turns them into DecodeSpecs), batch 1 and 8, one new token per row,
KV-cache lengths 128 / 512 / 2048, dense and compressed at keep 0.8 (every projection of every layer and the LM
head factored at `nki_kernels.ranks.block_aligned_rank`), each composition (nki_kernels.decode.compositions) runs
on the emulator in count-only mode (`nki_kernels.decode.runner.run_decode_step`, operands are shape/dtype
placeholders, no weight memory): per_op (i), per_layer (ii), looped (iii) and per_op_svd_mlp (per-op kernels,
fused svd_mlp kernels for the MLP). What is measured and judged (must-move bytes, the targets and their bounds)
is nki_kernels.decode.comparison. The peer "dense (nkilib megakernel)" is AWS nki-library's experimental
transformer_tkg, run from a local checkout (`--nki_library`) on the same emulator.

Latency of a composition = sum of its launches' modeled latencies (each launch scheduled on its own, so its
pipeline fill and drain count) + launches x a per-launch overhead (`nki_kernels.emulator.launch`: no public
Trainium figure, so 0, 2, 5, 10, 20 µs are swept). % of peak bandwidth = bytes that must move ÷ latency ÷ the
core's peak DMA-to-HBM rate.

    python benchmarks/decode_compositions.py --nki_library=/path/to/nki-library     # everything
    python benchmarks/decode_compositions.py --quick                                # one shape, a few seconds

Writes benchmarks/results/decode_step{,_quick}.md and .png. All numbers are modeled, not measured.

--weight_dtype=fp8 writes the fp8-weight report instead, benchmarks/results/decode_fp8{,_quick}.md: the same cases
with every weight (each projection and the LM head, dense or factored) in fp8 e4m3 with float32 per-output-column
scales (`DecodeSpec.fp8_weights`), beside the bf16 ones traced in the same run, with each case's speedup over the
bf16 dense looped kernel; it traces our compositions only (no nkilib peer, no plot), e.g.

    python benchmarks/decode_compositions.py --weight_dtype=fp8 --models="Gemma 3 270M" --batches=1,8 \
        --cache_lengths=512 --compositions=looped

--tensor_parallel writes the tensor-parallel report instead, benchmarks/results/decode_tensor_parallel{,_quick}.md:
each model split over T NeuronCores in the Megatron layout (nki_kernels.decode.sharding; T = 1, 2, 4, 8, and 16,
32 for Llama-3.1-8B, or --tp_degrees), every rank's kernels run together on the emulator with their collectives
(simulate_spmd), rank 0 measured: per_op, per_layer and looped, dense and compressed, with µs per step, % of the
aggregate peak bandwidth, µs in collectives and, beside each looped row, the physical (byte) bound and the
dependency floor (the same kernel with unlimited DMA and link bandwidth, cost_model.dependency_floor_us), e.g.

    python benchmarks/decode_compositions.py --tensor_parallel --batches=1,8 --cache_lengths=512

--models, --tp_degrees, --batches, --cache_lengths and --compositions pick the cases (each traced dense and
compressed), e.g. a handful of looped rows in a minute:

    python benchmarks/decode_compositions.py --tensor_parallel --models="Gemma 3 270M" --tp_degrees=2,4 \
        --batches=1 --cache_lengths=512 --compositions=looped --out_dir=/tmp/tp
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import pathlib
import shlex
import sys
import time
from collections.abc import Callable

import _flag_checks  # sibling module: the script's folder is on sys.path
import decode_paged  # sibling module: the script's folder is on sys.path
import numpy as np
from absl import app, flags
from tqdm import tqdm

from jax_neuronmm.compress.checkpoint import write_atomically
from jax_neuronmm.models.decode import published_decode_models
from nki_kernels import emulator
from nki_kernels.decode import traffic
from nki_kernels.decode.comparison import (
    BF16,
    COMPOSITIONS,
    LABELS,
    PEAK_FRACTION,
    TARGETS,
    TP_COMPOSITIONS,
    DecodeModel,
    Measured,
    Results,
    decode_spec,
    describe_error,
    fp8_table,
    measure_depths,
    measure_spec,
    must_move_bytes,
    nkilib_shards,
    peak_fraction,
    profiled,
    targets_table,
    tensor_parallel_bound_us,
    tensor_parallel_table,
    tp_spec,
    traced_layers,
    where,
)
from nki_kernels.emulator import collective_costs, launch
from nki_kernels.emulator.kernel import Spec
from nki_kernels.emulator.kernel import run as run_kernel

DEFAULT_MODELS = ("Gemma 3 270M", "Llama-3.2-1B", "Llama-3.1-8B")
# Tensor-parallel degrees the report traces per model (the others: TP_DEFAULT); a degree the model's heads,
# intermediate or vocabulary do not split over shows as not run.
TP_DEFAULT = (1, 2, 4, 8)
TP_DEGREES = {"Llama-3.1-8B": (1, 2, 4, 8, 16, 32)}

flags.DEFINE_bool(
    "quick", False, "Gemma 3 270M at 2 layers and an 8192-token vocabulary, batch 1, cache 128: a smoke run"
)
flags.DEFINE_list(
    "models", None, f"models to report (names in jax_neuronmm.models.presets.PUBLISHED); default {DEFAULT_MODELS}"
)
flags.DEFINE_list("batches", ["1", "8"], "batch sizes (rows, one new token each)")
flags.DEFINE_list("cache_lengths", ["128", "512", "2048"], "KV-cache lengths S")
flags.DEFINE_string(
    "nki_library",
    None,
    "checkout of aws-neuron/nki-library for the 'dense (nkilib megakernel)' "
    "peer (its experimental transformer_tkg); without it the report says so",
)
flags.DEFINE_list(
    "extrapolated_models",
    ["Llama-3.2-1B", "Llama-3.1-8B"],
    "models traced at one and two repeats of "
    "their layer pattern and extrapolated linearly in L (checked against a full trace of Gemma 3 270M); "
    "the others are traced at full depth",
)
flags.DEFINE_list("compositions", list(COMPOSITIONS), "compositions to trace (the others show as not traced)")
flags.DEFINE_enum(
    "weight_dtype",
    "bf16",
    ["bf16", "fp8"],
    "bf16: the composition report (decode_step.md); fp8: the fp8-weight report (decode_fp8.md), every weight in fp8 "
    "e4m3 with float32 scales beside the same cases in bf16 (the --compositions given, bf16 dense looped always)",
)
flags.DEFINE_bool(
    "tensor_parallel",
    False,
    "write the tensor-parallel report (decode_tensor_parallel.md) instead: each model split over T ranks "
    "(--tp_degrees), per_op, per_layer and looped (of --compositions)",
)
flags.DEFINE_list(
    "tp_degrees", None, f"tensor-parallel degrees for every model; default {dict(TP_DEGREES)} (else {TP_DEFAULT})"
)
flags.DEFINE_bool("cached_only", False, "trace nothing: report the cases found in --cache_file, the rest as not traced")
flags.DEFINE_string(
    "run_time_note",
    "",
    "how the cases were traced, for a report assembled with --cached_only (its own run time covers the assembly only)",
)
flags.DEFINE_string(
    "cache_file",
    None,
    "JSON-lines file of finished cases: cases found there are not traced "
    "again, new ones are appended (to resume a run or split it over processes by --models; only "
    "valid for the same kernels)",
)
flags.DEFINE_string(
    "out_dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), "where the markdown and PNG go"
)
FLAGS = flags.FLAGS
_flag_checks.output_directory("out_dir")
_flag_checks.not_with("quick", ("models", "batches", "cache_lengths"), "traces one small shape at batch 1, cache 128")

NKILIB = "nkilib"  # the peer's row label in tables: "dense (nkilib megakernel)"


def measure_ours(
    model: DecodeModel,
    composition: str,
    compressed: bool,
    batch: int,
    cache_len: int,
    num_layers: int,
    fp8: bool = False,
) -> Measured:
    """One composition of our kernels on `num_layers` layers, count-only, on each target; fp8: every weight in fp8
    with float32 scales."""
    return measure_spec(decode_spec(model, num_layers, compressed, fp8), composition, batch, cache_len)


def measure_nkilib(
    source: str, model: DecodeModel, batch: int, cache_len: int, one_layer_calls: bool = False
) -> Measured:
    """nkilib's transformer_tkg (layers only), count-only, on each target where it runs (it asserts NeuronCore-v3
    or later). One call per shard runs all layers; where that fails (or with one_layer_calls), each shard runs
    one-layer calls (the layers are identical, so one is traced and repeated), and the note says why."""
    calls, d, i = nkilib_shards(model)
    group = model.num_heads // model.num_kv_heads
    h, b = model.hidden, batch
    runs, failures, per_layer_calls = {}, [], []
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    try:
        with emulator.as_nki():
            sys.path.insert(0, source)
            try:
                module = importlib.import_module("nkilib.experimental.transformer.transformer_tkg")
            except Exception as error:  # noqa: BLE001 - a checkout that does not import is reported, not fatal
                return Measured({}, calls, 0.0, note=f"transformer_tkg does not import: {describe_error(error)}")
            kernel = emulator.jit(module.transformer_tkg)

            def call(num_layers, target):
                def layers(shape):
                    return [Spec(shape, BF16) for _ in range(num_layers)]

                args = (
                    Spec((b, 1, h), BF16),
                    layers((h, d * (group + 2))),
                    layers((group * d, h)),
                    layers((h, i)),
                    layers((h, i)),
                    layers((i, h)),
                    layers((1, h)),
                    layers((1, h)),
                    layers((b, 1, d, cache_len)),
                    layers((b, 1, cache_len, d)),
                    Spec((d // 2, b, 1), BF16),
                    Spec((d // 2, b, 1), BF16),
                    Spec((cache_len, b, group, 1), np.uint8),
                    Spec((1, b, group, 1), np.uint8),
                    Spec((b, 1), np.int32),
                )
                kwargs = dict(num_layers=num_layers, eps=model.norm_eps, replica_groups=[[0]])
                # nkilib's allocator prints its SBUF plan at every call; the report needs none of it.
                with contextlib.redirect_stdout(io.StringIO()):
                    return profiled(lambda: run_kernel(kernel, args, kwargs, numerics=False), target)

            for target in TARGETS:
                try:
                    if one_layer_calls:
                        raise RuntimeError("one-layer calls asked for")
                    runs[target] = call(model.num_layers, target) * calls
                except Exception as error:  # noqa: BLE001 - reported in the table; ours still stand
                    whole = describe_error(error)
                    try:
                        runs[target] = call(1, target) * (calls * model.num_layers)
                        per_layer_calls.append(
                            f"{target}: all {model.num_layers} layers in one call failed "
                            f"({whole}), so {model.num_layers} one-layer calls per shard"
                        )
                    except Exception as error:  # noqa: BLE001
                        failures.append(f"{target}: {describe_error(error)}")
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - saved_modules:
            if name == "nkilib" or name.startswith("nkilib."):
                del sys.modules[name]
    note = f"{calls} shard{'s' if calls > 1 else ''} of {group} heads x {d}, 1 KV head, MLP slice {i}"
    if per_layer_calls:
        note += "; " + "; ".join(per_layer_calls)
    if failures:
        note += "; did not run on " + "; ".join(failures)
    if not runs:
        return Measured({}, calls, 0.0, note=note)
    return Measured.from_runs(runs, note=note)


def check_nkilib_checkout(checkout: str) -> str:
    source = os.path.join(os.path.expanduser(checkout), "src", "nkilib_src")
    if not os.path.isdir(os.path.join(source, "nkilib", "experimental", "transformer")):
        raise ValueError(f"--nki_library: {checkout!r} has no src/nkilib_src/nkilib/experimental/transformer folder")
    return source


NOT_TRACED = "not traced in this run (run time on this machine)"


class CaseCache:
    """Finished cases in a JSON-lines file (None: no file): key -> Measured; each new case is appended at once.
    cached_only: cases not in the file are not traced but come back as NOT_TRACED placeholders."""

    def __init__(self, path: str | None, cached_only: bool = False):
        self.path, self.cases, self.cached_only = path, {}, cached_only
        if path and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        entry = json.loads(line)
                        fields = entry["measured"]
                        fields["extrapolated"] = tuple(fields["extrapolated"])
                        self.cases[entry["key"]] = Measured(**fields)

    def get(self, key: str, compute: Callable[[], Measured], traced: bool = True) -> Measured:
        """The cached case, else compute() (appended to the file), else (not traced) a placeholder."""
        if key not in self.cases and (self.cached_only or not traced):
            return Measured({}, 0, 0.0, note=NOT_TRACED)
        if key not in self.cases:
            self.cases[key] = compute()
            if self.path:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"key": key, "measured": dataclasses.asdict(self.cases[key])}) + "\n")
        return self.cases[key]


def run_all(
    models: list[DecodeModel], batches, cache_lengths, nkilib_source, extrapolated, cache=None, traced=COMPOSITIONS
) -> Results:
    cache = cache or CaseCache(None)
    # Batch-1 cases first (the targets), the deepest model last.
    cases = [
        (m, c, b, s, comp)
        for b in batches
        for m in models
        for s in cache_lengths
        for c in (False, True)
        for comp in COMPOSITIONS
    ]
    ours, peer = {}, {}
    for m, c, b, s, comp in tqdm(cases, desc="decode-step compositions", unit="case"):
        depths = traced_layers(m, m.name in extrapolated)
        ours[(m.name, c, b, s, comp)] = cache.get(
            f"{m.name}|{m.num_layers}|{c}|{b}|{s}|{comp}|{depths}",
            lambda: measure_depths(lambda layers: measure_ours(m, comp, c, b, s, layers), m, depths),
            traced=comp in traced,
        )
    status = "no --nki_library checkout given"
    if nkilib_source:
        status = "run from the --nki_library checkout"
        for m, b, s in tqdm(
            [(m, b, s) for m in models for b in batches for s in cache_lengths],
            desc="nkilib transformer_tkg",
            unit="case",
        ):
            peer[(m.name, b, s)] = measure_nkilib(nkilib_source, m, b, s)  # seconds each: never cached
    one_call = []
    for (name, b, s), measured in peer.items():
        if (
            (b, s) == (batches[0], cache_lengths[min(1, len(cache_lengths) - 1)])
            and measured.kernel_us
            and "one-layer calls" not in measured.note
        ):
            # What running all layers in one call gains the peer over one-layer calls, where both run.
            model = next(m for m in models if m.name == name)
            one_call.append((name, b, s, measured, measure_nkilib(nkilib_source, model, b, s, one_layer_calls=True)))
    check = []
    gemma = next((m for m in models if m.gemma3 and m.num_layers >= 3 * m.layer_period), None)
    if gemma is not None and 1 in batches:
        # Extrapolation check: Gemma 3 270M traced in full vs extrapolated from 6 and 12 layers, batch 1.
        b, s = 1, cache_lengths[min(1, len(cache_lengths) - 1)]
        depths = traced_layers(gemma, True)
        for c in (False, True):
            for comp in tqdm(COMPOSITIONS, desc=f"extrapolation check ({'compressed' if c else 'dense'})", unit="case"):
                full = ours[(gemma.name, c, b, s, comp)]
                if not full.kernel_us:
                    continue
                guess = cache.get(
                    f"{gemma.name}|{gemma.num_layers}|{c}|{b}|{s}|{comp}|{depths}",
                    lambda: measure_depths(lambda layers: measure_ours(gemma, comp, c, b, s, layers), gemma, depths),
                )
                check.append((comp, c, b, s, full, guess))
    return Results(ours, peer, status, check, models, one_call)


def run_fp8(models, batches, cache_lengths, extrapolated, cache, traced) -> tuple[dict, dict, list]:
    """The fp8 report's cases: ({(model, fp8, compressed, batch, S, composition): Measured}, {same key: seconds
    its trace took in this run, or None when it came from the cache}, the 1-minute load average before the first
    case and after each), fp8 and bf16 weights, dense and compressed, the `traced` compositions and bf16 dense
    looped (every speedup's base). bf16 cases share run_all's cache keys; fp8 ones end in "|fp8"."""
    cache = cache or CaseCache(None)
    cases = [
        (m, f, c, b, s, comp)
        for b in batches
        for m in models
        for s in cache_lengths
        for f in (False, True)
        for c in (False, True)
        for comp in COMPOSITIONS
        if comp in traced or (comp, f, c) == ("looped", False, False)
    ]
    ours, seconds, loads = {}, {}, [os.getloadavg()[0]]
    for m, f, c, b, s, comp in tqdm(cases, desc="decode-step fp8 report", unit="case"):
        depths = traced_layers(m, m.name in extrapolated)
        key = f"{m.name}|{m.num_layers}|{c}|{b}|{s}|{comp}|{depths}" + ("|fp8" if f else "")
        start, cached = time.time(), key in cache.cases
        ours[(m.name, f, c, b, s, comp)] = cache.get(
            key, lambda: measure_depths(lambda layers: measure_ours(m, comp, c, b, s, layers, f), m, depths)
        )
        seconds[(m.name, f, c, b, s, comp)] = None if cached else time.time() - start
        loads.append(os.getloadavg()[0])
    return ours, seconds, loads


def run_tensor_parallel(models, degrees, batches, cache_lengths, extrapolated, cache, traced):
    """The tensor-parallel report's cases: ({(model, T, compressed, batch, S, composition): Measured of rank 0},
    {same key: seconds its trace took in this run, or None from the cache}, the 1-minute load averages before the
    first case and after each, {(model, T): why it does not split} for degrees the model cannot take). T = 1 cases
    share run_all's cache keys; the others end in "|tpT"."""
    cache = cache or CaseCache(None)
    ours, seconds, loads, unsplit = {}, {}, [os.getloadavg()[0]], {}
    cases = []
    for m in models:
        for p in degrees(m):
            try:
                tp_spec(m, 1, False, p)
            except ValueError as error:
                unsplit[(m.name, p)] = str(error).split(": ", 1)[1]
                continue
            cases += [
                (m, p, c, b, s, comp)
                for b in batches
                for s in cache_lengths
                for c in (False, True)
                for comp in TP_COMPOSITIONS
                if comp in traced
            ]
    for m, p, c, b, s, comp in tqdm(cases, desc="decode-step tensor parallel", unit="case"):
        depths = traced_layers(m, m.name in extrapolated)
        key = f"{m.name}|{m.num_layers}|{c}|{b}|{s}|{comp}|{depths}" + (f"|tp{p}" if p > 1 else "")
        start, cached = time.time(), key in cache.cases
        ours[(m.name, p, c, b, s, comp)] = cache.get(
            key,
            lambda: measure_depths(lambda layers: measure_spec(tp_spec(m, layers, c, p, b), comp, b, s), m, depths),
        )
        seconds[(m.name, p, c, b, s, comp)] = None if cached else time.time() - start
        loads.append(os.getloadavg()[0])
    return ours, seconds, loads, unsplit


def _timing(seconds) -> str:
    """How the report's cases were traced: {case: seconds, or None when read from --cache_file}."""
    traced = [t for t in seconds.values() if t is not None]
    if not traced:
        return "every case from --cache_file"
    return f"{len(traced)} cases traced in this run, {min(traced):.0f} to {max(traced):.0f} s each (both targets)"


def tensor_parallel_markdown(
    ours, seconds, unsplit, models, degrees, batches, cache_lengths, quick, elapsed_s, depths, command, loads, note=""
) -> str:
    """The tensor-parallel report; note: how cached cases were traced (--run_time_note), for a --cached_only run."""
    timing = _timing(seconds)
    lines = [
        "# Decode step across NeuronCores (tensor parallel)" + (" (quick subset)" if quick else ""),
        "",
        "**All figures are modeled, not measured**: count-only emulator runs of our decode-step kernels on T "
        "emulated NeuronCores at once (`nki_kernels.decode.runner.run_sharded_decode_step`: every rank its own "
        "Megatron shard, `nki.collectives` between them under `simulate_spmd`), rank 0 measured, latency from "
        "`nki_kernels/emulator/cost_model.py` at 0 µs per launch, collectives priced by its link model "
        "(`nki_kernels/emulator/collective_costs.py`: NeuronLink and on-chip links from AWS's architecture guides, "
        f"{collective_costs.DEFAULT_HOP_LATENCY_US:g} µs per hop, ranks packed 2 per chip on trn1 and 4 (LNC=2) "
        "on trn2). Shards (`nki_kernels.decode.sharding`): attention by KV-head groups (a KV head replicated on the "
        "ranks that split its query heads when T exceeds the KV heads), the MLP by the intermediate dimension, the "
        "LM head by vocabulary; norms and the hidden state whole. Each layer all-reduces the partial products of o "
        "and down (for a factored one, its rank-r x·u) in float32; the logits are all-gathered so every rank "
        "returns them whole. per_op runs its collectives as launches of their own. bf16 weights and cache, one new "
        "token per row; compressed = keep 0.8 (`nki_kernels.ranks.block_aligned_rank` of the whole weights).",
        "",
        "- **Compressed shards keep u whole**: q, k, v, gate, up and the head split v's columns, so every rank reads "
        "all of their u factors (o and down split u's rows and keep v whole). A rank's compressed bytes therefore "
        "shrink much more slowly than its dense bytes as T grows, and from T = 4 (Llama) compressed moves more "
        "per rank than dense: the MB-moved column shows it.",
        "- **Packed attention** (`comparison.tp_spec`): at batch 1 on several ranks each rank packs its shard's q, "
        "k, v and o, dense ones included, into one operand read in one DMA a layer where the four fit a 32 KiB "
        "ring block a partition (`packing.attention_packing(..., dense=True)`: dense Gemma 3 270M at T = 2 and 4, "
        "Llama-3.2-1B at T = 8, Llama-3.1-8B at T = 32; compressed Gemma 3 270M packs its factors as on one "
        "rank); read alone, such small dense shards are short DMA runs (Llama-3.1-8B T = 32: 2 KiB a partition, "
        "82% of the DMA rate). Batch 8 and T = 1 keep the single-core report's packing (none for dense weights): "
        "batch-8 steps are bound by their dependency chain, which a layer's whole packed block delays.",
        "- **µs** = one rank's modeled step (all ranks run the same shapes). **tok/s** = batch ÷ µs (all T ranks "
        "together). **% aggregate peak** = T ranks' must-move bytes (`nki_kernels.decode.traffic.must_move_bytes` "
        "of one rank's shard, replicated KV heads counted on each rank, the whole logits written by each) ÷ µs ÷ "
        "T cores' peak DMA-to-HBM rate (272 GB/s trn1, 362.5 GB/s trn2 per core). **µs in collectives**: the "
        "step's time on the CC cores' queue (a share of µs; weight loads continue meanwhile). **KB to "
        "collectives** = `traffic.collective_bytes`.",
        "- **Physical bound** (looped rows) = `comparison.tensor_parallel_bound_us`: the larger of one rank's "
        "must-move bytes at the peak DMA rate and its collectives on the links one after another (the layers' "
        "data dependencies order them); the row's latency ÷ bound in parentheses.",
        "- **Dependency floor** (looped rows) = `Measured.floor_us`: the same instruction stream scheduled with DMA "
        "and link bandwidth unlimited (`cost_model.schedule(..., unlimited_bandwidth=True)`: transfers take only "
        "their fixed ~1.3 µs latency, collectives only their hop latency, every engine instruction and dependency "
        "as modeled), i.e. the kernel's own dependency chain; the row's latency ÷ floor in parentheses, then "
        "which limit is larger: **bytes** (the byte bound) or **chain** (the floor). A row can be at most as fast "
        "as the larger of the two; where the floor is larger, no overlap of DMA with compute reaches the byte "
        "bound, only a shorter chain does. The 5% target below is checked against the larger of the two (the "
        "collectives hidden behind weight loads where the data dependencies allow), and each row's ratio to the "
        "byte bound alone is listed beside it.",
        f"- Depths: {'; '.join(f'{k}: {v}' for k, v in depths.items())}.",
        f"- Made by `{command}`: {timing}; {elapsed_s / 60:.1f} min in all on a 2-core machine shared with other "
        f"jobs (1-minute load average {loads[0]:.1f} at the start, {min(loads):.1f} to {max(loads):.1f} during "
        "the run)" + (f"; {note}." if note else "."),
        "",
    ]
    for m in models:
        lines += [
            f"## {m.name} (L {m.num_layers}, H {m.hidden}, heads {m.num_heads}/{m.num_kv_heads}, I "
            f"{m.intermediate}, V {m.vocab})",
            "",
            *tensor_parallel_table(ours, m, degrees(m), batches, cache_lengths),
            "",
        ]
        for p in degrees(m):
            if (m.name, p) in unsplit:
                lines += [f"- T = {p} not run: {unsplit[(m.name, p)]}."]
        if m.name == "Llama-3.1-8B":
            lines += ["", *PUBLISHED_TP_ANCHORS]
        lines.append("")
    lines += tensor_parallel_targets(ours, models, degrees)
    return "\n".join(lines) + "\n"


# Published Trainium decode latencies of an 8B Llama (shared/research/fp8_and_decode_anchors.md cites the sources).
PUBLISHED_TP_ANCHORS = [
    "Published anchors, measured on hardware by AWS (not comparable row for row: other stacks, dtypes, sequence "
    "lengths and batching than these modeled bf16 steps at S 512):",
    "- Llama-3-8B on trn1.32xlarge, tensor parallel 32, batch 1, Transformers-NeuronX (Neuron 2.18.1), int8 "
    "weight storage: 5.86 ms per token at sequence length 4096, 7.03 ms at 8192 (AWS's latency_data_decoder.csv); "
    "our T = 32 looped row models one bf16 step at S 512.",
    "- Llama-3.1-8B on trn2.48xlarge through vLLM-Neuron, tensor parallel 8, concurrency 2, 512 tokens in and 128 "
    'out: median 10.52 ms per output token (AWS\'s EAGLE3 tutorial, its baseline; "numbers are illustrative"); '
    "our T = 8 rows model the kernel step alone, without the serving stack, sampling or host time.",
]


def _speedup_overhead(per_layer, looped, target="trn2", speedup=1.3) -> str:
    """At which per-launch overhead the looped kernel is `speedup` times faster than the per-layer launches
    (latency = kernel µs + launches x overhead for each)."""
    a, n = per_layer.kernel_us[target], per_layer.launches
    b, m = looped.kernel_us[target], looped.launches
    if n <= speedup * m:
        return f"no per-launch overhead makes it {speedup}x"
    overhead = max(0.0, (speedup * b - a) / (n - speedup * m))
    return (
        f"with per-launch overhead it reaches {speedup}x from {overhead:.1f} µs per launch ({n:.0f} launches vs "
        f"{m:.0f})"
    )


def tensor_parallel_targets(ours, models, degrees) -> list[str]:
    """The issue's targets checked on the traced cases (batch 1, S 512, 0 µs per launch): the looped kernel against
    its physical bound at every degree (all weight and cache bytes at the peak DMA rate with the collectives hidden
    behind weight loads where the data dependencies allow: the larger of the byte bound and the dependency floor),
    and against the byte bound alone; Llama-3.1-8B at T = 8 on trn2, and looped scaling of Llama-3.2-1B."""
    lines = ["## Targets (modeled, batch 1, S 512, 0 µs per launch)", ""]
    worst, worst_bytes, over_bytes = None, None, []
    for m in models:
        for p in degrees(m):
            for compressed in (False, True):
                looped = ours.get((m.name, p, compressed, 1, 512, "looped"))
                if looped is None or not looped.kernel_us:
                    continue
                spec = tp_spec(m, m.num_layers, compressed, p)
                for t in TARGETS:
                    us, bound = looped.latency_us(t, 0.0), tensor_parallel_bound_us(spec, 1, 512, t)
                    name = f"{m.name} T = {p} {where(compressed)} on {t}"
                    floor = looped.floor_us.get(t)
                    limit = bound if floor is None else max(bound, floor)
                    kind = (
                        "dependency floor"
                        if limit > bound
                        else "byte bound"
                        if floor is not None
                        else "byte bound, no floor traced"
                    )
                    if worst is None or us / limit > worst[0]:
                        worst = (us / limit, name, kind)
                    if worst_bytes is None or us / bound > worst_bytes[0]:
                        worst_bytes = (us / bound, name)
                    if us / bound > 1.05:
                        over_bytes.append(f"{name} {us / bound:.2f}x (its {kind}: {us / limit:.2f}x)")
    if worst is not None:
        verdict = "met" if worst[0] <= 1.05 else "NOT met"
        lines.append(
            "- the looped kernel within 5% of its physical bound at every shape (every weight and cache byte at the "
            "peak DMA rate, the collectives hidden behind the next weights' loads where the data dependencies allow: "
            "the larger of the byte bound and the dependency floor, the kernel's chain with unlimited bandwidth): "
            f"**{verdict}** (the farthest: {worst[1]}, {worst[0]:.3f}x its {worst[2]})"
        )
        lines.append(
            f"- against the byte bound alone (no chain: reachable only where the dependencies let every collective and "
            f"vector step hide behind loads): the farthest is {worst_bytes[1]}, {worst_bytes[0]:.3f}x"
            + (f"; over 1.05x: {'; '.join(over_bytes)}" if over_bytes else "; none over 1.05x")
        )
    big = ("Llama-3.1-8B", 8, False, 1, 512)
    looped, per_layer = ours.get((*big, "looped")), ours.get((*big, "per_layer"))
    if looped is not None and per_layer is not None and looped.kernel_us:
        model = next(m for m in models if m.name == big[0])
        spec = tp_spec(model, model.num_layers, False, 8)
        us, layer_us = looped.latency_us("trn2", 0.0), per_layer.latency_us("trn2", 0.0)
        share = peak_fraction(traffic.must_move_bytes(spec, 1, 512, itemsize=BF16.itemsize), us, "trn2")
        bound = tensor_parallel_bound_us(spec, 1, 512, "trn2")
        lines.append(
            "- Llama-3.1-8B at T = 8 on trn2, looped >= 85% of aggregate peak: "
            f"**{'met' if share >= 0.85 else 'NOT met'}** ({100 * share:.0f}%); >= 1.3x faster than per-layer "
            f"kernels with the collectives between launches where the bound allows it: per-layer {layer_us:.1f} µs / "
            f"looped {us:.1f} µs = {layer_us / us:.2f}x at 0 µs per launch, where the bound ({bound:.1f} µs) allows "
            f"at most {layer_us / bound:.2f}x, so 1.3x is not reachable there; {_speedup_overhead(per_layer, looped)}"
        )
    small = [ours.get(("Llama-3.2-1B", p, False, 1, 512, "looped")) for p in (1, 8)]
    if all(m is not None and m.kernel_us for m in small):
        effs = {t: small[0].latency_us(t, 0.0) / (8 * small[1].latency_us(t, 0.0)) for t in TARGETS}
        verdict = "met" if min(effs.values()) >= 0.8 else "NOT met"
        lines.append(
            f"- looped scaling efficiency T = 1 -> 8, Llama-3.2-1B: **{verdict}** ("
            + ", ".join(f"{t} {100 * e:.0f}%" for t, e in effs.items())
            + ")"
        )
    return lines + [""]


def fp8_markdown(
    ours, seconds, models, batches, cache_lengths, quick, elapsed_s, depths, command, load_averages
) -> str:
    timing = _timing(seconds)
    lines = [
        "# Decode step with fp8 weights" + (" (quick subset)" if quick else ""),
        "",
        "**All figures are modeled, not measured**: count-only emulator runs of our decode-step kernels "
        "(`nki_kernels.decode.runner.run_decode_step`), latency from `nki_kernels/emulator/cost_model.py` at 0 µs "
        "per launch. fp8 = every weight (each projection of every layer and the LM head, dense or factored) stored "
        "as fp8 e4m3 (Trainium's, ±240) with one float32 scale per output column (`DecodeSpec.fp8_weights`): the "
        "kernels DMA the fp8 bytes and multiply PSUM sums by the scales as they evict them; activations, norms "
        "and the KV cache stay bf16, logits fp32. Compressed = keep 0.8 (every projection and the head factored at "
        "`nki_kernels.ranks.block_aligned_rank(K, N, 0.8)`; fp8 factors scale by rank and by output column). One "
        "new token per row.",
        "",
        "- **Must move** = `nki_kernels.decode.traffic.must_move_bytes`: fp8 weights at one byte a value plus "
        "4 bytes a scale, the rest as in decode_step.md. **% peak** = must-move bytes ÷ latency ÷ the core's peak "
        "DMA-to-HBM rate (272 GB/s trn1, 362.5 GB/s trn2). **× bf16 dense** = bf16 dense looped latency ÷ this "
        "row's latency, the bf16 row traced in the same run.",
        f"- Depths: {'; '.join(f'{k}: {v}' for k, v in depths.items())}.",
        f"- Made by `{command}`: {timing}; {elapsed_s / 60:.1f} min in all on a 2-core machine shared with other "
        f"jobs (1-minute load average {load_averages[0]:.1f} at the start, {min(load_averages):.1f} to "
        f"{max(load_averages):.1f} during the run).",
        "",
    ]
    for m in models:
        lines += [
            f"## {m.name} (L {m.num_layers}, H {m.hidden}, I {m.intermediate}, V {m.vocab})",
            "",
            *fp8_table(ours, m, batches, cache_lengths),
            "",
        ]
    return "\n".join(lines) + "\n"


def _tokens(batch, latency_us):
    return "–" if latency_us is None else f"{batch / latency_us * 1e6:,.0f}"


def _ratio(slow_us, fast_us):
    return "–" if slow_us is None or fast_us is None else f"{slow_us / fast_us:.2f}x"


def _row_values(latency_us, batch, nbytes, target):
    if latency_us is None:
        return "– / – / –"
    return (
        f"{latency_us:.1f} / {batch / latency_us * 1e6:,.0f} / {100 * peak_fraction(nbytes, latency_us, target):.0f}%"
    )


def shape_table(res: Results, model: DecodeModel, batches, cache_lengths, overhead_us) -> list[str]:
    lines = [
        "| batch | S | model | composition | launches | HBM MB moved / must move "
        + "".join(f"| {t} µs / tok/s / % peak " for t in TARGETS)
        + "|",
        "|---|---|---|---|---|---|" + "---|" * len(TARGETS),
    ]
    for b in batches:
        for s in cache_lengths:
            for c in (False, True):
                need = must_move_bytes(model, c, b, s)
                for comp in COMPOSITIONS:
                    m = res.ours[(model.name, c, b, s, comp)]
                    if not m.kernel_us:
                        lines.append(
                            f"| {b} | {s} | {'compressed' if c else 'dense'} | {LABELS[comp]} | – | – / "
                            f"{need / 1e6:.1f} " + "| – " * len(TARGETS) + "|"
                        )
                        continue
                    lines.append(
                        f"| {b} | {s} | {'compressed' if c else 'dense'} | {LABELS[comp]} | {m.launches:.0f} "
                        f"| {m.hbm_bytes / 1e6:.1f} / {need / 1e6:.1f} "
                        + "".join(f"| {_row_values(m.latency_us(t, overhead_us), b, need, t)} " for t in TARGETS)
                        + "|"
                    )
            peer = res.nkilib.get((model.name, b, s))
            if peer is not None:
                need = must_move_bytes(model, False, b, s)
                lines.append(
                    f"| {b} | {s} | dense (nkilib megakernel) | transformer_tkg + our LM head "
                    f"| {peer.launches + 1:.0f} "
                    f"| {peer.hbm_bytes / 1e6:.1f} + head / {need / 1e6:.1f} "
                    + "".join(
                        f"| {_row_values(res.nkilib_step_us(model.name, b, s, t, overhead_us), b, need, t)} "
                        for t in TARGETS
                    )
                    + "|"
                )
    return lines


def sweep_table(res: Results, model: DecodeModel, batch: int, cache_len: int) -> list[str]:
    """tokens/s per composition at each assumed per-launch overhead, and the looped kernel's speedups."""
    sweep = launch.LAUNCH_OVERHEAD_SWEEP_US
    lines = [
        f"| {model.name}, batch {batch}, S {cache_len} | target | launches "
        + "".join(f"| {o:g} µs " for o in sweep)
        + "|",
        "|---|---|---|" + "---|" * len(sweep),
    ]
    for c in (False, True):
        for t in TARGETS:
            rows = {comp: res.ours[(model.name, c, batch, cache_len, comp)] for comp in COMPOSITIONS}
            for comp, m in rows.items():
                lines.append(
                    f"| {'compressed' if c else 'dense'} {LABELS[comp]} tok/s | {t} | {m.launches:.0f} "
                    + "".join(f"| {_tokens(batch, m.latency_us(t, o))} " for o in sweep)
                    + "|"
                )
            looped = rows["looped"]
            for other in ("per_op", "per_layer", "per_op_svd_mlp"):
                lines.append(
                    f"| {'compressed' if c else 'dense'} looped ÷ {other} speedup | {t} | "
                    + "".join(f"| {_ratio(rows[other].latency_us(t, o), looped.latency_us(t, o))} " for o in sweep)
                    + "|"
                )
            if not c:
                peer = [res.nkilib_step_us(model.name, batch, cache_len, t, o) for o in sweep]
                if peer[0] is not None:
                    p = res.nkilib[(model.name, batch, cache_len)]
                    lines.append(
                        f"| dense (nkilib megakernel) + our head tok/s | {t} | {p.launches + 1:.0f} "
                        + "".join(f"| {batch / us * 1e6:,.0f} " for us in peer)
                        + "|"
                    )
    return lines


def extrapolation_lines(res: Results) -> list[str]:
    if not res.extrapolation_check:
        return ["Every model here was traced at full depth."]
    lines = [
        "| composition | model | batch, S | depths traced "
        + "".join(f"| {t}: extrapolated ÷ full trace " for t in TARGETS)
        + "| launches: extrapolated vs full |",
        "|---|---|---|---|" + "---|" * len(TARGETS) + "---|",
    ]
    for comp, c, b, s, full, guess in res.extrapolation_check:
        lines.append(
            f"| {LABELS[comp]} | {'compressed' if c else 'dense'} | {b}, {s} | {guess.extrapolated} "
            + "".join(
                f"| {guess.kernel_us[t] / full.kernel_us[t]:.4f} "
                if t in guess.kernel_us and t in full.kernel_us
                else "| – "
                for t in TARGETS
            )
            + f"| {guess.launches:.1f} vs {full.launches:.0f} |"
        )
    return lines


def markdown(
    res: Results, batches, cache_lengths, quick: bool, elapsed_s: float, depths: dict, run_time_note: str = ""
) -> str:
    sweep = ", ".join(f"{o:g}" for o in launch.LAUNCH_OVERHEAD_SWEEP_US)
    lines = [
        "# Decode step over all layers: per-op vs per-layer vs looped kernels" + (" (quick subset)" if quick else ""),
        "",
        "**All figures are modeled, not measured**: count-only emulator runs (`nki_kernels.decode.runner."
        "run_decode_step(composition, operands, spec, numerics=False)` on shape/dtype placeholders), latency from "
        "`nki_kernels/emulator/cost_model.py` per launch, composed by `nki_kernels/emulator/launch.py`. bf16 "
        "weights and cache, one new token per row, fp32 logits. Compressed = keep 0.8: every projection of every "
        "layer and the LM head factored at `nki_kernels.ranks.block_aligned_rank(K, N, 0.8)` (the same rank in "
        "every layer). Compositions: (i) per_op = one kernel per op, the hidden state in HBM between them; (ii) "
        "per_layer = one fused kernel per layer, then the LM-head kernel; (iii) looped = one kernel for all "
        "layers, final norm and LM head; per_op + svd_mlp = per-op kernels except the MLP, which is the fused svd_mlp "
        "kernels when compressed (per-op projection kernels when dense).",
        "",
        "- **Latency** of a composition = Σ modeled latency of its launches (each launch scheduled on its own, so "
        "its pipeline fill and drain count) + launches × per-launch overhead. **No public source gives a "
        "per-launch overhead for a NeuronCore** (searched: the Neuron docs, runtime release notes, vllm-neuron "
        "design notes; the nearest figures are a 437 µs host-side gap between synchronous NEFF executions and a "
        '"20 µs" trn3 NEFF-start improvement, neither of them the cost of a kernel boundary; the kernel-looping '
        "paper, arXiv 2410.23668, measures SN40L and H100): the overhead is an assumption, swept over "
        f"{sweep} µs. Tables without a sweep use 0 µs (kernels only).",
        "- **Bytes that must move** (per step) = weights read once (projections K·N dense or r·(K+N) factored, "
        "norm weights, final norm, LM head H·V or r·(H+V)) + KV cache: k and v of every visible slot read "
        "(min(S, 512) slots in Gemma 3's sliding-window layers, S in the others) and the step's slot written, "
        "2·B·kv_heads·D per slot per layer + logits written (B·V fp32). Token embeddings, RoPE tables and masks "
        "are left out (< 0.1%). Our kernels read only the window's slots in sliding-window layers "
        "(`DecodeSpec.mask_windows`: a window of min(S, 512) slots ending at the step's slot, placed by a "
        "runtime DMA offset), so HBM MB moved tracks must-move at every S.",
        "- **% of peak** = must-move bytes ÷ latency ÷ the core's peak DMA-to-HBM rate: min(its share of the "
        "chip's HBM bandwidth, 16 DMA engines) = 272 GB/s on trn1 (DMA-bound: 16 × 17 GB/s), 362.5 GB/s on trn2 "
        "(2.9 TB/s ÷ 8 cores). tok/s = batch ÷ latency, per NeuronCore.",
        f"- Depths: {'; '.join(f'{k}: {v}' for k, v in depths.items())}.",
        f"- Run time of this benchmark: {elapsed_s / 60:.1f} min on this machine"
        + (f" (assembling cached cases; {run_time_note})." if run_time_note else "."),
        "",
        "## Targets (batch 1), at each assumed per-launch overhead",
        "",
        "The bound column: the most a ratio target can reach at 0 µs per launch, at the shape where that is lowest "
        "(other ÷ looped ≤ other's latency ÷ must-move bytes at the peak rate; compressed ÷ dense looped ≤ dense ÷ "
        'compressed must-move bytes); "unreachable": under the goal, so no looped kernel meets it there at 0 µs '
        "per launch (launch overhead slows only the many-launch side, so the bound rises with it).",
        "",
        *targets_table(res),
        "",
    ]
    first = res.models[0]
    b0 = batches[0]
    lines += [
        f"## Headline: {first.name}, batch {b0} (0 µs per launch)",
        "",
        *shape_table(res, first, [b0], cache_lengths, 0.0),
        "",
    ]
    lines += ["## Launch-overhead sweep (assumed per-launch overhead)", ""]
    for m in res.models:
        s = cache_lengths[min(1, len(cache_lengths) - 1)]
        lines += [*sweep_table(res, m, b0, s), ""]
    lines += ["## Every shape (0 µs per launch)", ""]
    for m in res.models:
        lines += [
            f"### {m.name} (L {m.num_layers}, H {m.hidden}, heads {m.num_heads}/{m.num_kv_heads}, D "
            f"{m.head_dim}, I {m.intermediate}, V {m.vocab}; {m.source})",
            "",
            *shape_table(res, m, batches, cache_lengths, 0.0),
            "",
        ]
    failed = [
        f"- {model}, {'compressed' if c else 'dense'}, batch {b}, S {s}, {LABELS[comp]}: {m.note}"
        for (model, c, b, s, comp), m in res.ours.items()
        if m.note and m.note != NOT_TRACED
    ]
    untraced = [
        f"{model} {'compressed' if c else 'dense'} b{b} S{s} {comp}"
        for (model, c, b, s, comp), m in res.ours.items()
        if m.note == NOT_TRACED
    ]
    if untraced:
        failed.append(f"- {NOT_TRACED}: " + ", ".join(untraced))
    if failed:
        lines += ["## Did not run (– in the tables)", "", *failed, ""]
    lines += [
        "## The peer: dense (nkilib megakernel)",
        "",
        nkilib_note(res),
        "",
        "## Layer-count extrapolation check",
        "",
        "Models deeper than the traced depth are traced at two layer counts (multiples of the layer pattern) "
        "and extrapolated linearly in L (latency, launches and bytes). The check traces Gemma 3 270M both ways:",
        "",
        *extrapolation_lines(res),
        "",
    ]
    return "\n".join(lines) + "\n"


def nkilib_note(res: Results) -> str:
    notes = {}
    for (name, b, s), measured in res.nkilib.items():
        notes.setdefault(name, f"{name} (batch {b}, S {s}): {measured.note}")
    notes = list(notes.values())
    text = (
        "AWS nki-library's `experimental/transformer/transformer_tkg.py` (all layers of a dense decode step in "
        "one kernel: attention block with RMSNorm, fused QKV, RoPE, KV-cache update and output projection, "
        "residual, RMSNorm + SiLU-gated MLP, residual; collectives over a replica group of one core), imported "
        "unmodified from a scratch copy of the checkout outside this repository, count-only on the same "
        f"emulator: {res.nkilib_status}. The checkout has two bugs that stop it from importing or running; the "
        "scratch copy fixes exactly these two places and nothing else: `core/mlp/mlp.py` (lines 202-214, a "
        "blank line and a second copy of the last 11 lines of the `mlp` docstring after its closing quotes, an "
        "IndentationError at line 203: deleted) and `core/mlp/mlp_tkg/mlp_tkg_constants.py` (the required "
        "dataclass field `remainderIFused` is never passed, a TypeError: one line added passing "
        "`remainderIFused=remainderI`; nothing reads the field). Its constraints: one KV head per call and a "
        "head dimension on partitions (≤ 128); it is written for tensor parallelism, so each model runs as "
        "one call per KV head (Gemma 3 270M's "
        "256-wide heads as 128-wide halves: two calls), each call with its heads' share of q/k/v/o and an "
        "intermediate slice of the MLP, back to back on one core (the all-reduce between shards is not "
        "charged; the same weight and cache bytes and matmul flops as the model). It asserts NeuronCore-v3 or "
        "later (trn2), so it has no trn1 figures. It covers the layers only; the comparison adds the same LM "
        "head to it: our `lm_head_kernel` launch (final norm + dense head, from composition (ii) at the same "
        "shape) plus one launch, i.e. peer step = transformer_tkg calls + our head. Its layers differ from "
        "Gemma 3's (no QK-norm, sandwich norms or sliding window; SiLU instead of GELU-tanh); they are "
        "Llama's."
    )
    if notes:
        text += " Per model and shape: " + " | ".join(notes) + "."
    for name, b, s, whole, split in res.nkilib_one_call:
        gains = ", ".join(f"{t} {split.kernel_us[t] / whole.kernel_us[t]:.2f}x" for t in whole.kernel_us)
        text += (
            f" Where all layers ran in one call ({name}, batch {b}, S {s}), that call is faster than "
            f"one-layer calls by {gains} at 0 µs per launch (cross-layer overlap inside one kernel): where the "
            "peer had to run as one-layer calls, its figures are pessimistic by about that much, and the "
            "launch-overhead sweep charges it one launch per layer and shard."
        )
        for t, gain in ((t, split.kernel_us[t] / whole.kernel_us[t]) for t in whole.kernel_us):
            adjusted = []
            for (model, pb, ps), peer in sorted(res.nkilib.items()):
                ours = res.ours.get((model, False, pb, ps, "looped"))
                head = res.ours.get((model, False, pb, ps, "per_layer"))
                if (
                    "one-layer calls" in peer.note
                    and pb == 1
                    and t in peer.kernel_us
                    and ours is not None
                    and t in ours.kernel_us
                    and t in head.head_us
                ):
                    peer_us = peer.kernel_us[t] / gain + head.head_us[t]
                    adjusted.append(f"{model} S {ps}: {peer_us / ours.kernel_us[t]:.2f}x")
            if adjusted:
                text += (
                    f" With the peer's one-layer-call time divided by that {gain:.2f}x ({t}, 0 µs per launch), "
                    "peer ÷ our dense looped kernel at batch 1 would be " + ", ".join(adjusted) + "."
                )
    return text


def plot(res: Results, batches, cache_lengths, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(TARGETS), figsize=(12, 8))
    sweep = launch.LAUNCH_OVERHEAD_SWEEP_US
    first, b0 = res.models[0], batches[0]
    s0 = cache_lengths[min(1, len(cache_lengths) - 1)]
    colors = dict(zip(COMPOSITIONS, ("tab:red", "tab:orange", "tab:green", "tab:gray")))
    for col, t in enumerate(TARGETS):
        ax = axes[0][col]
        for comp in COMPOSITIONS:
            for c, style in ((False, "-o"), (True, "--s")):
                m = res.ours[(first.name, c, b0, s0, comp)]
                if t not in m.kernel_us:
                    continue
                ax.plot(
                    sweep,
                    [b0 / m.latency_us(t, o) * 1e6 for o in sweep],
                    style,
                    color=colors[comp],
                    label=f"{'compressed' if c else 'dense'} {LABELS[comp]}",
                )
        peer = [res.nkilib_step_us(first.name, b0, s0, t, o) for o in sweep]
        if peer[0] is not None:
            ax.plot(sweep, [b0 / us * 1e6 for us in peer], ":^", color="black", label="dense (nkilib megakernel)")
        ax.set_title(f"{t}: {first.name}, batch {b0}, S {s0}: tok/s vs assumed µs per launch", fontsize=9)
        ax.set_xlabel("per-launch overhead (µs, assumed)")
        ax.set_ylabel("tokens/s per NeuronCore (modeled)")
        ax.grid(alpha=0.3)
        ax = axes[1][col]
        for m in res.models:
            for c, style in ((False, "-o"), (True, "--s")):
                points = [(s, res.ours[(m.name, c, b0, s, "looped")].latency_us(t, 0.0)) for s in cache_lengths]
                points = [(s, us) for s, us in points if us is not None]
                ax.plot(
                    [s for s, _ in points],
                    [100 * peak_fraction(must_move_bytes(m, c, b0, s), us, t) for s, us in points],
                    style,
                    label=f"{m.name} {'compressed' if c else 'dense'}",
                )
        ax.axhline(100 * PEAK_FRACTION, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.set_title(f"{t}: looped kernel, % of peak HBM bandwidth, batch {b0}, 0 µs/launch", fontsize=9)
        ax.set_xlabel("KV-cache length S")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    axes[0][-1].legend(fontsize=6)
    axes[1][0].legend(fontsize=6)
    fig.suptitle("Decode step, modeled (emulator cost model, bf16; compressed = keep 0.8)")
    fig.tight_layout()
    write_atomically(path, lambda temporary: fig.savefig(temporary, format="png", dpi=110))
    plt.close(fig)


def _ints(values, name):
    try:
        out = [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{name}: expected positive integers, got {values}") from None
    if not out or min(out) < 1:
        raise app.UsageError(f"--{name}: expected positive integers, got {values}")
    return out


def main(argv):
    del argv
    start = time.time()
    try:
        every = published_decode_models(dict.fromkeys([*DEFAULT_MODELS, *(FLAGS.models or ())]))
    except ValueError as error:
        raise app.UsageError(f"--models: {error}") from None
    names = FLAGS.models or list(DEFAULT_MODELS)
    models = [every[n] for n in names]
    batches, cache_lengths = _ints(FLAGS.batches, "batches"), _ints(FLAGS.cache_lengths, "cache_lengths")
    if FLAGS.quick:
        # Its own name: case-cache keys name a model, its depth, the case and the traced depths.
        gemma = every["Gemma 3 270M"]
        spec = decode_spec(gemma, 2, False).replace(vocab=8192)
        models = [DecodeModel("Gemma 3 270M (2 layers, V 8192)", gemma.source, spec)]
        batches, cache_lengths = [1], [128]
    source = None
    if FLAGS.nki_library:
        try:
            source = check_nkilib_checkout(FLAGS.nki_library)
        except ValueError as error:
            raise app.UsageError(str(error)) from None
    extrapolated = set(FLAGS.extrapolated_models)
    unknown = sorted(extrapolated - set(every))
    if unknown:
        raise app.UsageError(f"--extrapolated_models: unknown {unknown}, expected some of {list(every)}")
    depths = {
        m.name: (
            "full trace"
            if traced_layers(m, m.name in extrapolated) == (m.num_layers,)
            else f"traced at {traced_layers(m, True)} layers, extrapolated to {m.num_layers}"
        )
        for m in models
    }
    if FLAGS.quick:
        depths = {m.name: "2 layers and an 8192-token vocabulary only (quick smoke run)" for m in models}
    traced = tuple(FLAGS.compositions)
    if not set(traced) <= set(COMPOSITIONS):
        raise app.UsageError(f"--compositions: got {FLAGS.compositions}, expected some of {list(COMPOSITIONS)}")
    if FLAGS.cached_only and not FLAGS.cache_file:
        raise app.UsageError("--cached_only needs --cache_file")
    cache = CaseCache(FLAGS.cache_file, FLAGS.cached_only)
    command = "python benchmarks/decode_compositions.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if FLAGS.tensor_parallel:
        if source or FLAGS.weight_dtype == "fp8":
            raise app.UsageError("--tensor_parallel: traces our bf16 kernels only (no --nki_library, no fp8)")
        chosen = _ints(FLAGS.tp_degrees, "tp_degrees") if FLAGS.tp_degrees else None

        def degrees(m):
            return chosen or TP_DEGREES.get(m.name, TP_DEFAULT)

        ours, seconds, loads, unsplit = run_tensor_parallel(
            models, degrees, batches, cache_lengths, extrapolated, cache, traced
        )
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        path = os.path.join(FLAGS.out_dir, f"decode_tensor_parallel{'_quick' if FLAGS.quick else ''}.md")
        text = tensor_parallel_markdown(
            ours,
            seconds,
            unsplit,
            models,
            degrees,
            batches,
            cache_lengths,
            FLAGS.quick,
            time.time() - start,
            depths,
            command,
            loads,
            FLAGS.run_time_note,
        )
        write_atomically(path, lambda temporary: pathlib.Path(temporary).write_text(text, encoding="utf-8"))
        print(text)
        print(f"wrote {path} ({(time.time() - start) / 60:.1f} min)")
        return
    if FLAGS.weight_dtype == "fp8":
        if source:
            raise app.UsageError("--nki_library: the fp8 report (--weight_dtype=fp8) traces our kernels only")
        ours, seconds, loads = run_fp8(models, batches, cache_lengths, extrapolated, cache, traced)
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        path = os.path.join(FLAGS.out_dir, "decode_fp8_quick.md" if FLAGS.quick else "decode_fp8.md")
        text = fp8_markdown(
            ours, seconds, models, batches, cache_lengths, FLAGS.quick, time.time() - start, depths, command, loads
        )
        write_atomically(path, lambda temporary: pathlib.Path(temporary).write_text(text, encoding="utf-8"))
        print(text)
        print(f"wrote {path} ({(time.time() - start) / 60:.1f} min)")
        return
    res = run_all(models, batches, cache_lengths, source, extrapolated, cache, traced)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    stem = os.path.join(FLAGS.out_dir, "decode_step_quick" if FLAGS.quick else "decode_step")
    text = markdown(res, batches, cache_lengths, FLAGS.quick, time.time() - start, depths, FLAGS.run_time_note)
    if not FLAGS.quick:  # the paged-cache comparison, from decode_paged.py's data (benchmarks/decode_paged.py)
        text += decode_paged.report_section(FLAGS.out_dir)
    write_atomically(stem + ".md", lambda temporary: pathlib.Path(temporary).write_text(text, encoding="utf-8"))
    plot(res, batches, cache_lengths, stem + ".png")
    print("\n".join(targets_table(res)))
    print(f"wrote {stem}.md and {stem}.png ({(time.time() - start) / 60:.1f} min)")


if __name__ == "__main__":
    app.run(main)
