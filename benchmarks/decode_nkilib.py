"""The decode comparison's peer: AWS nki-library's transformer_tkg megakernel, traced from a local checkout on the
emulator (`measure_nkilib`), and the report's note on how it ran (`nkilib_note`) with its launches' cost apart
(`nkilib_launch_table`)."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys

import numpy as np
from harness.comparison import (
    BF16,
    TARGETS,
    DecodeModel,
    Measured,
    Results,
    describe_error,
    nkilib_shards,
    profiled,
)

from nki_kernels import emulator
from nki_kernels.emulator import launch, speed_bands
from nki_kernels.emulator.cost_model import fitted_terms
from nki_kernels.emulator.kernel import Spec
from nki_kernels.emulator.kernel import run as run_kernel


def measure_nkilib(
    source: str, model: DecodeModel, batch: int, cache_len: int, one_layer_calls: bool = False, bands: bool = False
) -> Measured:
    """nkilib's transformer_tkg (layers only), count-only, on each target where it runs (it asserts NeuronCore-v3
    or later). One call per shard runs all layers; where that fails (or with one_layer_calls), each shard runs
    one-layer calls (the layers are identical, so one is traced and repeated), and the note says why. bands: with
    its calls at the fitted cost terms and the band's corners (Measured.band_us; the fixed step cost once)."""
    calls, d, i = nkilib_shards(model)
    group = model.num_heads // model.num_kv_heads
    h, b = model.hidden, batch
    runs, failures, per_layer_calls, band_us = {}, [], [], {}
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
                records = []
                # nkilib's allocator prints its SBUF plan at every call; the report needs none of it.
                with contextlib.redirect_stdout(io.StringIO()):
                    traced = profiled(lambda: run_kernel(kernel, args, kwargs, numerics=False), target, False, records)
                if bands:
                    repeats = calls * (model.num_layers // num_layers)
                    band_us[target] = speed_bands.band_latencies(
                        lambda terms: (
                            repeats * (speed_bands.step_us(records, target, terms) - terms.step_fixed_us)
                            + terms.step_fixed_us
                        ),
                        fitted_terms(target),
                    )
                return traced

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
    return Measured.from_runs(runs, note=note, bands={t: band_us[t] for t in runs if t in band_us})


def check_nkilib_checkout(checkout: str) -> str:
    source = os.path.join(os.path.expanduser(checkout), "src", "nkilib_src")
    if not os.path.isdir(os.path.join(source, "nkilib", "experimental", "transformer")):
        raise ValueError(f"--nki_library: {checkout!r} has no src/nkilib_src/nkilib/experimental/transformer folder")
    return source


def nkilib_launch_table(res: Results, batch: int) -> list[str]:
    """The peer's step at `batch` split into its kernels' time and its launches' cost, per model, S and target it
    ran on, beside our dense looped kernel (one launch): launches = transformer_tkg calls + our LM head."""
    sweep = [o for o in launch.LAUNCH_OVERHEAD_SWEEP_US if o]
    lines = [
        "| model | batch, S | hw | launches per step (shards x calls per shard + our head) | kernels µs "
        + "".join(f"| + launches x {o:g} µs " for o in sweep)
        + "| our dense looped µs (1 launch) |",
        "|---|---|---|---|---|" + "---|" * len(sweep) + "---|",
    ]
    for (name, b, s), peer in res.nkilib.items():
        model = next((m for m in res.models if m.name == name), None)
        if b != batch or model is None:
            continue
        shards = nkilib_shards(model)[0]
        for t in TARGETS:
            kernels = res.nkilib_step_us(name, b, s, t, 0.0)
            ours = res.ours.get((name, False, b, s, "looped"))
            if kernels is None:
                continue
            count = peer.launches + 1
            lines.append(
                f"| {name} | {b}, {s} | {t} | {count:.0f} ({shards} x {peer.launches / shards:.0f} + 1) "
                f"| {kernels:.1f} "
                + "".join(f"| {count * o:.0f} " for o in sweep)
                + f"| {'–' if ours is None or ours.latency_us(t, 0.0) is None else f'{ours.latency_us(t, 0.0):.1f}'} |"
            )
    return lines if len(lines) > 2 else []


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
        "charged; the same weight and cache bytes and matmul flops as the model). **One launch per step for a "
        "whole model on one core is not possible with its signature**: it takes one KV head (`attention_block_tkg` "
        'fixes `kv_heads = 1` and asserts "Expecting single head for KV" on the cache), so one launch per step '
        "needs the tensor-parallel layout it is written for, one NeuronCore per KV head (8 for the Llamas here) "
        "each running all layers in one call (Gemma 3 270M's 256-wide heads exceed the 128 partitions: two calls "
        "even then). On one core it takes a launch per shard, and one per layer too where all layers in one call "
        "do not run (below). The table after this note therefore splits its step into the kernels' time and the "
        "launches' cost (launches x the assumed per-launch overhead); at the fitted cost terms the fixed step cost "
        "is charged once, as for ours. It asserts NeuronCore-v3 or "
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
