"""What benchmarks/decode_compositions.py measures (benchmarks/harness/comparison.py): the bytes a decode step must move
(counted by hand here), the specs (from the presets through decode_plan) and operand placeholders of each model,
the nkilib peer's sharding, the targets' bounds, and a --quick smoke run of the whole script."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import decode_cases
import decode_nkilib
import decode_step_report
import numpy as np
import pytest
from harness import comparison as bench
from harness import tables

from nki_kernels.decode import layouts, packing
from nki_kernels.decode.contract import PROJECTIONS
from nki_kernels.emulator import cost_model, speed_bands

BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")
BAND = r"\d+\.\d\dx \(\d+\.\d\d–\d+\.\d\dx\)"  # band_text's "fitted (lowest–highest)"
MODELS = bench.published_decode_models(["Gemma 3 270M", "Llama-3.2-1B", "Llama-3.1-8B"])


def test_must_move_bytes_of_llama_1b_dense_counted_by_hand():
    m = MODELS["Llama-3.2-1B"]
    h, i, kv, d, v, layers = 2048, 8192, 8, 64, 128256, 16
    per_layer = h * h + 2 * h * kv * d + h * h + 3 * h * i + 2 * h  # q, k + v, o, MLP, two norms
    for batch, s in ((1, 128), (8, 2048), (3, 130)):
        kv_bytes = 2 * batch * kv * d * layers * (s + 1)  # every visible slot read, this step's written
        expected = 2 * (layers * per_layer + kv_bytes + h + h * v) + 4 * batch * v
        assert bench.must_move_bytes(m, False, batch, s) == expected
        layers_only = 2 * (layers * per_layer + kv_bytes + batch * h)
        assert bench.must_move_bytes(m, False, batch, s, layers_only=True) == layers_only


def test_must_move_bytes_of_gemma3_counts_the_sliding_window_and_the_factors():
    m = MODELS["Gemma 3 270M"]
    dense_2048 = bench.must_move_bytes(m, False, 1, 2048)
    dense_512 = bench.must_move_bytes(m, False, 1, 512)
    # 15 sliding-window layers read 512 slots at either length, the 3 global layers 2048 instead of 512.
    assert dense_2048 - dense_512 == 2 * 2 * 1 * 1 * 256 * 3 * (2048 - 512)
    spec = bench.decode_spec(m, 18, True)
    factored = sum(
        r * (spec.in_features(p) + spec.out_features(p))
        for p, r in zip(PROJECTIONS, (spec.rank(p, 0) for p in PROJECTIONS))
    )
    dense = sum(spec.in_features(p) * spec.out_features(p) for p in PROJECTIONS)
    head = (640 * 262144, spec.head_rank * (640 + 262144))
    assert bench.must_move_bytes(m, False, 1, 128) - bench.must_move_bytes(m, True, 1, 128) == 2 * (
        18 * (dense - factored) + head[0] - head[1]
    )


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("compressed", [False, True])
def test_specs_and_operands_follow_the_contract(name, compressed):
    m = MODELS[name]
    spec = bench.decode_spec(m, 7, compressed)
    assert spec.num_layers == 7 and len(spec.layer_rope) == 7
    ops = bench.operand_specs(spec, 3, 130)
    assert len(ops) == 21 and (ops[18] is None) == (not spec.packed_weights)  # packed: with spec.packed_weights
    assert ops[19] is None and ops[20] is None  # block_table, lengths: a paged spec's
    if spec.packed_weights:  # Gemma 3 270M's bf16 attention factors (packing.attention_packing)
        assert ops[18].shape == layouts.packed_shape(spec) and ops[18].dtype == bench.BF16
        spec = packing.unpacked_spec(spec)
        ops = bench.operand_specs(spec, 3, 130)
    assert ops[0].shape == (3, 1, m.hidden)
    assert ops[10].shape == ops[11].shape == (7, 3, 130, m.num_kv_heads, m.head_dim)
    assert ops[15].shape == (spec.num_masks, 3, 1, 130)
    for name_, op in zip(PROJECTIONS, ops[3:10]):
        k, n = spec.in_features(name_), spec.out_features(name_)
        if compressed:
            r = spec.rank(name_, 0)
            assert [o.shape for o in op] == [(7, k, r), (7, r, n)] and r * (k + n) < k * n
        else:
            assert op.shape == (7, k, n)
    if compressed:
        assert [o.shape for o in ops[17]] == [(m.hidden, spec.head_rank), (spec.head_rank, m.vocab)]
    else:
        assert ops[17].shape == (m.hidden, m.vocab)
    if m.gemma3:
        # Layers 6, 12, ... are global (table 1), the rest local (table 0).
        assert spec.layer_mask == (0, 0, 0, 0, 0, 1, 0) == spec.layer_rope and spec.sandwich and spec.qk_norm
        assert spec.mask_windows == (m.sliding_window, None)  # the local layers read only their window
        assert bench.decode_spec(m, 5, compressed).mask_windows == (m.sliding_window,)
    else:
        assert spec.mask_windows == ()


def test_cut_layers_keeps_per_layer_ranks_the_head_and_fp8_weights():
    m = MODELS["Gemma 3 270M"]
    full = bench.decode_spec(m, m.num_layers, True, fp8=True)
    assert bench.cut_layers(full, 5) == bench.decode_spec(m, 5, True, fp8=True)
    uneven = full.replace(ranks=(tuple(range(1, 19)), *full.ranks[1:]), head_rank=448)
    cut = bench.cut_layers(uneven, 7)
    assert cut.ranks[0] == (1, 2, 3, 4, 5, 6, 7) and cut.ranks[1:] == tuple(r[:7] for r in full.ranks[1:])
    assert cut.head_rank == 448 and cut.fp8_weights == full.fp8_weights and cut.mask_windows == full.mask_windows
    assert bench.cut_layers(uneven, 5).mask_windows == (m.sliding_window,)


def test_nkilib_shards_keep_the_model_s_bytes():
    for m in MODELS.values():
        calls, d, i = bench.nkilib_shards(m)
        group = m.num_heads // m.num_kv_heads
        assert d <= 128 and i * calls == m.intermediate
        assert calls * (group + 2) * d == (m.num_heads + 2 * m.num_kv_heads) * m.head_dim  # q, k, v columns


def test_extrapolation_is_linear_in_layers():
    a = bench.Measured({"trn1": 10.0, "trn2": 8.0}, 3, 100.0)
    b = bench.Measured({"trn1": 16.0, "trn2": 12.0}, 5, 180.0)
    c = bench.extrapolate(a, 2, b, 4, 18)
    assert c.kernel_us == {"trn1": 58.0, "trn2": 40.0} and c.launches == 19 and c.hbm_bytes == 740.0
    assert c.latency_us("trn2", 5.0) == 40.0 + 19 * 5.0


def test_bands_extrapolate_linearly_in_layers_corner_by_corner():
    a = bench.Measured({"trn1": 10.0}, 3, 100.0, band_us={"trn1": {"fitted": 20.0, "corners": [10.0, 30.0]}})
    b = bench.Measured({"trn1": 16.0}, 5, 180.0, band_us={"trn1": {"fitted": 26.0, "corners": [16.0, 40.0]}})
    c = bench.extrapolate(a, 2, b, 4, 18)
    # The fixed step cost is in both traces once, so the slope leaves it once: 20 + 6 * 8.
    assert c.band_us == {"trn1": {"fitted": 68.0, "corners": [58.0, 110.0]}}


@pytest.mark.parametrize("composition", ["looped", "per_layer"])
def test_measured_bands_are_the_step_rescheduled_at_each_corner(composition):
    # A 1-layer Gemma 3 270M step: each corner's latency is the launches scheduled at that corner's terms (its fixed
    # step cost left out) plus the fixed cost once, however many launches the composition makes.
    spec = bench.decode_spec(MODELS["Gemma 3 270M"], 1, False, fp8=composition == "looped")
    measured = bench.measure_spec(spec, composition, 2, 96, bands=True)
    for target in ("trn1", "trn2"):
        fitted = cost_model.fitted_terms(target)
        band = measured.band_us[target]
        corners = speed_bands.corners(fitted)
        assert len(band["corners"]) == len(corners) == 8
        kernels = measured.kernel_us[target]  # the documented model: no terms
        all_low = band["corners"][0]
        assert all_low == pytest.approx(speed_bands.step_us(_records(spec, composition, target), target, corners[0]))
        # Fixed cost once: the all-high corner minus its twin with no fixed cost is the fitted fixed cost exactly.
        no_fixed = dataclasses.replace(corners[-1], step_fixed_us=0.0)
        twin = speed_bands.step_us(_records(spec, composition, target), target, no_fixed)
        assert band["corners"][-1] - twin == pytest.approx(fitted.step_fixed_us)
        assert band["fitted"] >= fitted.step_fixed_us and kernels > 0
    assert bench.measure_spec(spec, composition, 2, 96).band_us == {}


def _records(spec, composition, target):
    records = []
    operands = bench.operand_specs(spec, 2, 96)
    bench.profiled(lambda: bench.run_decode_step(composition, operands, spec, numerics=False), target, False, records)
    return records


def test_ratio_bounds_at_peak_on_a_synthetic_case():
    """per_layer at 1.1x / 1.3x its roofline (dense / compressed): looped ÷ per_layer can reach at most 1.10x
    (1.100x, under the 1.15x goal: unreachable); compressed ÷ dense looped at most dense ÷ compressed
    must-move bytes."""
    m = MODELS["Gemma 3 270M"]
    need = {c: bench.must_move_bytes(m, c, 1, 128) for c in (False, True)}
    slow = {"per_op": 2.0, "per_layer": {False: 1.1, True: 1.3}, "looped": 1.0, "per_op_svd_mlp": 2.0}
    ours = {}
    for c in (False, True):
        for comp in bench.COMPOSITIONS:
            k = slow[comp][c] if isinstance(slow[comp], dict) else slow[comp]
            ours[(m.name, c, 1, 128, comp)] = bench.Measured(
                {t: k * bench.roofline_us(0, need[c], t) for t in bench.TARGETS}, 1, float(need[c])
            )
    res = bench.Results(ours, {}, "none", [], [m])
    for t in bench.TARGETS:
        cells = bench.bound_cells(res, t)
        assert cells["per_layer"] == "≤ 1.100x (S 128, dense): unreachable"
        assert cells["per_op"] == "≤ 2.000x (S 128, dense)"
        assert cells["compressed"] == f"≤ {need[False] / need[True]:.3f}x (Gemma 3 270M, S 128)"
    table = "\n".join(bench.targets_table(res))
    assert "| ≤ 1.100x (S 128, dense): unreachable |" in table and table.count("unreachable") == len(bench.TARGETS)


def test_quick_run_writes_the_report(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "decode_compositions.py"), "--quick", f"--out_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "decode_step_quick.md").read_text()
    for composition in bench.COMPOSITIONS:
        assert bench.LABELS[composition] in text
    assert "modeled, not measured" in text and (tmp_path / "decode_step_quick.png").stat().st_size > 0
    # Every speedup of ours in the headline has its band on each target (the peer's: "–", no checkout given).
    headline = [line for line in text.splitlines() if line.startswith("| 128 | ") and " looped vs " in line]
    ours = [line for line in headline if "nkilib" not in line]
    assert len(ours) == 7 and all(len(re.findall(BAND, line)) == len(bench.TARGETS) for line in ours)
    fitted = [line for line in text.splitlines() if line.startswith("| 1 | 128 | trn")]
    assert len(fitted) == len(bench.TARGETS) and all(len(re.findall(BAND, line)) == 7 for line in fitted)
    fp8 = subprocess.run(
        [
            sys.executable,
            os.path.join(BENCHMARKS, "decode_compositions.py"),
            "--quick",
            "--weight_dtype=fp8",
            "--compositions=looped",
            f"--out_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert fp8.returncode == 0, fp8.stderr[-3000:]
    rows = [line for line in (tmp_path / "decode_fp8_quick.md").read_text().splitlines() if line.startswith("| 1 |")]
    assert [row.split(" | ")[2:4] for row in rows] == [
        ["bf16", "dense"],
        ["bf16", "compressed"],
        ["fp8", "dense"],
        ["fp8", "compressed"],
    ]
    # bf16 dense looped over itself: 1.00x documented and at every corner of the band, on each target
    assert rows[0].count(" / 1.00x / 1.00x (1.00–1.00x) |") == len(bench.TARGETS)
    assert "/ –" not in rows[2] and "| –" not in rows[2]  # every value there (the band's own dash aside)
    bad = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "decode_compositions.py"), "--models=GPT-5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode != 0 and "--models" in bad.stderr and "Traceback" not in bad.stderr


def test_fp8_table_speedups_are_over_bf16_dense_looped():
    m = MODELS["Gemma 3 270M"]
    need = {(f, c): bench.must_move_bytes(m, c, 1, 512, fp8=f) for f in (False, True) for c in (False, True)}
    assert need[(True, False)] < 0.52 * need[(False, False)]  # fp8 weights at half the bytes; cache and logits not
    rng = np.random.default_rng()
    # Bands on trn1 only: [fitted, 8 corners] of each case, random, so the table's band must be their ratio's.
    bands = {(f, c): rng.uniform(100.0, 900.0, size=9) for f in (False, True) for c in (False, True)}
    ours = {
        (m.name, f, c, 1, 512, "looped"): bench.Measured(
            {t: (1 + (not f) + (not c)) * bench.roofline_us(0, need[(f, c)], t) for t in bench.TARGETS},
            1,
            float(need[(f, c)]),
            band_us={"trn1": {"fitted": bands[(f, c)][0], "corners": list(bands[(f, c)][1:])}},
        )
        for f in (False, True)
        for c in (False, True)
    }
    lines = tables.fp8_table(ours, m, [1], [512])
    fp8_compressed = lines[-1].split(" | ")
    assert fp8_compressed[2:5] == ["fp8", "compressed", bench.LABELS["looped"]]
    base = 3 * bench.roofline_us(0, need[(False, False)], "trn1")
    us = bench.roofline_us(0, need[(True, True)], "trn1")
    ratios = bands[(False, False)] / bands[(True, True)]
    band = f"{ratios[0]:.2f}x ({ratios.min():.2f}–{ratios.max():.2f}x)"
    assert fp8_compressed[7] == f"{us:.1f} / 100% / {base / us:.2f}x / {band}"
    assert fp8_compressed[8].endswith(" / – |")  # no band traced on trn2


def _band(rng):
    values = rng.uniform(100.0, 900.0, size=9)
    return values, {"fitted": values[0], "corners": list(values[1:])}


def test_step_report_states_each_speedup_with_its_band_and_the_peer_s_launches_apart():
    # Random bands on trn2 for every composition, the per_layer LM-head launch (no fixed cost) and the nkilib peer's
    # calls (fixed cost once): the peer's step band is its calls' plus our head's, corner by corner.
    m, rng = MODELS["Gemma 3 270M"], np.random.default_rng()
    values, ours = {}, {}
    for c in (False, True):
        for comp in bench.COMPOSITIONS:
            values[(c, comp)], band = _band(rng)
            head = {"trn2": 50.0} if comp == "per_layer" else {}
            ours[(m.name, c, 1, 512, comp)] = bench.Measured(
                {"trn2": float(rng.uniform(1000.0, 3000.0))}, 19, 1e6, head_us=head, band_us={"trn2": band}
            )
    head_values, ours[(m.name, False, 1, 512, "per_layer")].head_band_us["trn2"] = _band(rng)
    ours[(m.name, True, 1, 512, "per_layer")].head_band_us["trn2"] = _band(rng)[1]
    peer_values, peer_band = _band(rng)
    peer = bench.Measured({"trn2": 2500.0}, 36, 1e6, band_us={"trn2": peer_band})
    res = bench.Results(ours, {(m.name, 1, 512): peer}, "test", [], [m])
    assert all(measured.has_bands() for measured in ours.values()) and peer.has_bands()
    rows = {row.split(" | ")[1]: row.split(" | ") for row in decode_step_report.headline_speedups(res, m, 1, [512])[2:]}

    def band(ratios):
        return f"{ratios[0]:.2f}x ({ratios.min():.2f}–{ratios.max():.2f}x)"

    per_op = rows[f"dense: looped vs {bench.LABELS['per_op']}"]
    slow, fast = ours[(m.name, False, 1, 512, "per_op")], ours[(m.name, False, 1, 512, "looped")]
    assert per_op[2:4] == ["–", "–"]  # nothing on trn1
    assert per_op[4] == f"{slow.kernel_us['trn2'] / fast.kernel_us['trn2']:.2f}x"
    assert per_op[5] == band(values[(False, "per_op")] / values[(False, "looped")]) + " |"
    assert (
        rows["compressed looped vs dense looped"][5]
        == band(values[(False, "looped")] / values[(True, "looped")]) + " |"
    )
    peer_row = rows["compressed: looped vs dense (nkilib megakernel)"]
    assert peer_row[4] == f"{(2500.0 + 50.0) / ours[(m.name, True, 1, 512, 'looped')].kernel_us['trn2']:.2f}x"
    assert peer_row[5] == band((peer_values + head_values) / values[(True, "looped")]) + " |"
    fitted = next(
        row for row in decode_step_report.band_table(res, m, [1], [512]) if row.startswith("| 1 | 512 | trn2")
    )
    dense = values[(False, "looped")]
    assert f"| {dense[0]:.0f} ({dense[1:].min():.0f}–{dense[1:].max():.0f}) |" in fitted
    assert fitted.endswith(f"| {band((peer_values + head_values) / values[(True, 'looped')])} |")
    launches = decode_nkilib.nkilib_launch_table(res, 1)
    assert launches[2].startswith(f"| {m.name} | 1, 512 | trn2 | 37 (2 x 18 + 1) | 2550.0 | 74 |")


def test_case_cache_traces_again_a_case_cached_without_its_bands(tmp_path):
    path = tmp_path / "cases.jsonl"
    old = bench.Measured({"trn1": 10.0}, 1, 5.0)
    path.write_text(json.dumps({"key": "k", "measured": dataclasses.asdict(old)}) + "\n")
    new = bench.Measured({"trn1": 10.0}, 1, 5.0, band_us={"trn1": {"fitted": 12.0, "corners": [9.0, 14.0]}})
    assert decode_cases.CaseCache(str(path)).get("k", lambda: new) == old  # bands not asked for: as cached
    assert decode_cases.CaseCache(str(path), cached_only=True).get("k", lambda: new, bands=True).note == (
        decode_cases.NOT_TRACED
    )
    assert decode_cases.CaseCache(str(path)).get("k", lambda: new, bands=True) == new
    assert decode_cases.CaseCache(str(path)).get("k", lambda: old, bands=True) == new  # the last line of a key wins


@pytest.mark.parametrize("num_layers,fp8", [(1, True), (2, False)])
def test_llama_8b_looped_step_fits_one_core_sbuf(num_layers, fp8):
    # Hidden 4096: a staged [R, hidden] float32 row block (16 KiB a partition) and the small tiles beside it
    # overflowed the ring's reserve; every layer's fp8 scales (an [R, 14336] float32 staging) came before the ring.
    spec = bench.decode_spec(MODELS["Llama-3.1-8B"], num_layers, False, fp8=fp8)
    measured = bench.measure_spec(spec, "looped", 1, 512)
    assert measured.note == ""
    assert all(measured.latency_us(target, 0.0) > 0 for target in ("trn1", "trn2"))


@pytest.mark.parametrize("compressed", [False, True])
def test_gemma_fp8_looped_step_with_8_rows_fits_one_core_sbuf(compressed):
    # The fp8 head's scales (8 KiB a partition for a 262,144-token vocabulary) beside its staged logits for 8 rows,
    # with the layers' fp8 scales still live, overflowed a ring sized from the hidden size's reserve.
    spec = bench.decode_spec(MODELS["Gemma 3 270M"], 18, compressed, fp8=True)
    measured = bench.measure_spec(spec, "looped", 8, 512)
    assert measured.note == ""
    assert all(measured.latency_us(target, 0.0) > 0 for target in ("trn1", "trn2"))


@pytest.mark.parametrize("model", ["Llama-3.2-1B", "Llama-3.1-8B"])
def test_per_op_step_fits_one_core_sbuf(model):
    # A projection kernel's output rows (up to the intermediate size, staged in float32) overflowed the reserve
    # beside a full weight ring until the ring was released after its last block.
    spec = bench.decode_spec(MODELS[model], 1, False)
    measured = bench.measure_spec(spec, "per_op", 1, 512)
    assert measured.note == ""
    assert all(measured.latency_us(target, 0.0) > 0 for target in ("trn1", "trn2"))
