"""The decode comparison's cases: each traced once (count-only, `measure_ours`) and kept in a JSON-lines cache
(`CaseCache`), for the composition report (`run_all`, with the nkilib peer), the fp8 report (`run_fp8`) and the
tensor-parallel report (`run_tensor_parallel`); `RunInfo` is how a run went, for a report's header."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable

from decode_nkilib import measure_nkilib  # sibling module: the script's folder is on sys.path
from harness.comparison import (
    COMPOSITIONS,
    TP_COMPOSITIONS,
    DecodeModel,
    Measured,
    Results,
    decode_spec,
    measure_depths,
    measure_spec,
    tp_spec,
    traced_layers,
)
from tqdm import tqdm


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """How a report's run went, for its header: the command line, --quick, the traced depths per model, the
    run's seconds, {case: seconds its trace took, or None when read from the cache}, the 1-minute load averages
    before the first case and after each, and how cached cases were traced (--run_time_note)."""

    command: str
    quick: bool
    elapsed_s: float
    depths: dict
    seconds: dict
    loads: list
    note: str = ""


def measure_ours(
    model: DecodeModel,
    composition: str,
    compressed: bool,
    batch: int,
    cache_len: int,
    num_layers: int,
    fp8: bool = False,
    bands: bool = False,
) -> Measured:
    """One composition of our kernels on `num_layers` layers, count-only, on each target; fp8: every weight in fp8
    with float32 scales; bands: with the step at the fitted cost terms and the band's corners."""
    return measure_spec(decode_spec(model, num_layers, compressed, fp8), composition, batch, cache_len, bands)


NOT_TRACED = "not traced in this run (run time on this machine)"


class CaseCache:
    """Finished cases in a JSON-lines file (None: no file): key -> Measured (the last line of a key wins); each new
    case is appended at once. cached_only: cases not in the file are not traced but come back as NOT_TRACED
    placeholders."""

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

    def get(self, key: str, compute: Callable[[], Measured], traced: bool = True, bands: bool = False) -> Measured:
        """The cached case, else compute() (appended to the file), else (not traced) a placeholder. bands: a cached
        case without its bands (Measured.has_bands, e.g. traced before the report had them) counts as missing."""
        if key in self.cases and bands and not self.cases[key].has_bands():
            del self.cases[key]
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
) -> tuple[Results, dict, list]:
    """The composition report's cases, each with its band (measure_spec's bands; a cached case without one is traced
    again), the nkilib peer's (never cached) and the extrapolation check: (Results, {(model, compressed, batch, S,
    composition): seconds its trace took in this run, or None from the cache}, the 1-minute load averages before
    the first case and after each)."""
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
    ours, peer, seconds, loads = {}, {}, {}, [os.getloadavg()[0]]
    for m, c, b, s, comp in tqdm(cases, desc="decode-step compositions", unit="case"):
        depths = traced_layers(m, m.name in extrapolated)
        key = f"{m.name}|{m.num_layers}|{c}|{b}|{s}|{comp}|{depths}"
        start, cached = time.time(), key in cache.cases and cache.cases[key].has_bands()
        ours[(m.name, c, b, s, comp)] = cache.get(
            key,
            lambda: measure_depths(lambda layers: measure_ours(m, comp, c, b, s, layers, bands=True), m, depths),
            traced=comp in traced,
            bands=True,
        )
        placeholder = ours[(m.name, c, b, s, comp)].note == NOT_TRACED
        seconds[(m.name, c, b, s, comp)] = None if cached or placeholder else time.time() - start
        loads.append(os.getloadavg()[0])
    status = "no --nki_library checkout given"
    if nkilib_source:
        status = "run from the --nki_library checkout"
        for m, b, s in tqdm(
            [(m, b, s) for m in models for b in batches for s in cache_lengths],
            desc="nkilib transformer_tkg",
            unit="case",
        ):
            peer[(m.name, b, s)] = measure_nkilib(nkilib_source, m, b, s, bands=True)  # seconds each: not cached
            loads.append(os.getloadavg()[0])
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
    loads.append(os.getloadavg()[0])
    return Results(ours, peer, status, check, models, one_call), seconds, loads


def run_fp8(models, batches, cache_lengths, extrapolated, cache, traced) -> tuple[dict, dict, list]:
    """The fp8 report's cases: ({(model, fp8, compressed, batch, S, composition): Measured}, {same key: seconds
    its trace took in this run, or None when it came from the cache}, the 1-minute load average before the first
    case and after each), fp8 and bf16 weights, dense and compressed, the `traced` compositions and bf16 dense
    looped (every speedup's base), each with its band (measure_spec's bands). bf16 cases share run_all's cache keys;
    fp8 ones end in "|fp8"."""
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
            key, lambda: measure_depths(lambda layers: measure_ours(m, comp, c, b, s, layers, f, True), m, depths)
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
            lambda: measure_depths(
                lambda layers: measure_spec(tp_spec(m, layers, c, p, b), comp, b, s, bands=True), m, depths
            ),
        )
        seconds[(m.name, p, c, b, s, comp)] = None if cached else time.time() - start
        loads.append(os.getloadavg()[0])
    return ours, seconds, loads, unsplit


def timing_note(seconds) -> str:
    """How the report's cases were traced: {case: seconds, or None when read from --cache_file}."""
    traced = [t for t in seconds.values() if t is not None]
    if not traced:
        return "every case from --cache_file"
    return f"{len(traced)} cases traced in this run, {min(traced):.0f} to {max(traced):.0f} s each (both targets)"
