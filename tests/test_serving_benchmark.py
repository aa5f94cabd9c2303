"""benchmarks/serving.py's modeled part and report: a recorded schedule priced on the cost model adds up step by
step, the HBM capacity table matches a hand count, and serving.md is what --render_only renders from serving.json
alone."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from decode_operands import llama_like
from harness.comparison import DecodeModel, measure_spec

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
import serving_modeled  # noqa: E402

# 2 layers, 2 KV heads of 64 (128 cache features), vocabulary 300: traces in a second.
TINY = DecodeModel("tiny", "a test spec", llama_like(2, 200, 4, 2, 64, 200))


def test_priced_schedule_adds_up_step_by_step():
    # Three decode steps of two shapes and two prefill chunks; 16-slot blocks.
    schedule = [
        ["prefill", 1, 32, 2, 1, 20],
        ["decode", 8, 1, 2, 5, 5],
        ["decode", 8, 1, 2, 8, 8],
        ["prefill", 1, 32, 4, 1, 32],
        ["decode", 4, 1, 4, 3, 3],
    ]
    priced = serving_modeled.price_schedule(schedule, TINY, "bf16", 16, 64)
    assert sorted(priced["decode"]) == ["4,64", "8,32"]
    paged = TINY.spec.replace(block_size=16)
    for target in serving_modeled.TARGETS:
        step_8 = measure_spec(paged, "looped", 8, 32).kernel_us[target]
        step_4 = measure_spec(paged, "looped", 4, 64).kernel_us[target]
        alone = measure_spec(TINY.spec, "looped", 8, 64).kernel_us[target]
        alone_32 = measure_spec(TINY.spec, "looped", 8, 32).kernel_us[target]
        prefill = sum(serving_modeled.prefill_us(TINY.spec, 1, 32, slots, target) for slots in (32, 64))
        assert sorted(priced["prefill"]) == ["1,32,32", "1,32,64"]
        assert priced["prefill"]["1,32,64"][target] == serving_modeled.prefill_us(TINY.spec, 1, 32, 64, target)
        # two rows in one prefill step read the weights once: less than two steps of one row
        one, two = (serving_modeled.prefill_us(TINY.spec, rows, 32, 64, target) for rows in (1, 2))
        assert one < two < 2 * one
        # no logits: the head's size does not change a prefill step's price
        wide = TINY.spec.replace(vocab=30 * TINY.spec.vocab)
        assert serving_modeled.prefill_us(wide, 2, 32, 64, target) == two
        rate = serving_modeled.modeled_rate(schedule, priced, target)
        # prefill steps sample nothing: the output tokens are the decode steps' active rows
        assert rate["engine"] == pytest.approx(16 / (2 * step_8 + step_4 + prefill) * 1e6)
        assert 0 < prefill and rate["prefill_us"] == pytest.approx(prefill)
        assert rate["decode_only"] == pytest.approx(16 / (2 * step_8 + step_4) * 1e6)
        assert rate["standalone"] == pytest.approx(8 / alone * 1e6)
        # like for like: the standalone kernel over each decode step's own slots (32, 32, 64), 8 tokens a step
        same = 3 * 8 / (2 * alone_32 + alone) * 1e6
        assert rate["standalone_same_slots"] == pytest.approx(same) and alone_32 < alone
        assert rate["ratio"] == pytest.approx(rate["engine"] / same)
        assert rate["ratio_full_context"] == pytest.approx(rate["engine"] / rate["standalone"])
        # Saturated: up to the last prefill (requests still waiting), so the last decode step (the drain) is left out.
        busy = serving_modeled.saturated(schedule)
        assert busy == schedule[:4] and serving_modeled.schedule_tokens(busy) == 13
        busy_rate = serving_modeled.modeled_rate(busy, priced, target)
        assert busy_rate["engine"] == pytest.approx(13 / (2 * step_8 + prefill) * 1e6)
        assert busy_rate["standalone_same_slots"] == pytest.approx(8 / alone_32 * 1e6)
        slots, ratios = serving_modeled.paged_over_contiguous(dict(schedule=schedule, priced={"bf16": priced}))
        assert slots == 32 and ratios["bf16"][target] == pytest.approx(step_8 / alone_32)
    # The prefill_ahead sweep: one row per schedule (the report's marked default), each its own whole-run ratio.
    other = schedule[1:3] + schedule[4:]  # the same decode steps without prefill: a higher ratio
    modeled = dict(schedule=schedule, prefill_ahead=2, sweep={"0": other}, priced={"bf16": priced})
    lines = serving_modeled.sweep_lines(modeled)
    want = {
        ahead: [f"{serving_modeled.modeled_rate(s, priced, t)['ratio']:.3f}" for t in serving_modeled.TARGETS]
        for ahead, s in (("0", other), ("2 (default)", schedule))
    }
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 0", "| 2 (default)"]
    for line, (ahead, cells) in zip(lines[2:], want.items()):
        assert line == f"| {ahead} | {'2' if ahead == '2 (default)' else '0'} | 3 | " + " | ".join(cells) + " |"
    assert want["0"] > want["2 (default)"]
    priced["decode"]["8,32"].pop("trn1")  # a shape that did not run on a target: no rate there
    assert serving_modeled.modeled_rate(schedule, priced, "trn1") is None


def test_capacity_matches_a_hand_count():
    (bf16, fp8, *_) = serving_modeled.capacity_rows([TINY])
    spec = TINY.spec
    projections = 2 * (200 * 256 + 2 * 200 * 128 + 256 * 200 + 2 * 200 * 200 + 200 * 200)  # q, k+v, o, gate+up, down
    norms = 2 * 2 * 200
    assert bf16["weight_bytes"] == 2 * (projections + 200 * 300 + norms)
    # fp8: a byte a value, float32 scales per output channel, plus the bf16 embedding table
    assert fp8["weight_bytes"] > projections + 200 * 300 + 2 * 200 * 300 > bf16["weight_bytes"] / 2
    per_seq = 2 * spec.num_layers * 2 * 64 * 2048 * 2
    assert bf16["kv_bytes"]["2048"] == per_seq
    for target, hbm in serving_modeled.HBM_BYTES_PER_CORE.items():
        assert bf16["sequences"][f"{target},2048"] == (hbm - bf16["weight_bytes"]) // per_seq
    assert serving_modeled.HBM_BYTES_PER_CORE == {"trn1": 16 * 2**30, "trn2": 12 * 2**30}


@pytest.mark.skipif(not (RESULTS / "serving.json").exists(), reason="no serving results yet")
@pytest.mark.parametrize("model,stem", [("SmolLM2-135M", "serving"), ("Gemma 3 270M", "serving_gemma3_270m")])
def test_serving_markdown_rerenders_from_its_json(tmp_path, model, stem):
    shutil.copy(RESULTS / f"{stem}.json", tmp_path / f"{stem}.json")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "serving.py"),
            "--render_only",
            f"--model={model}",
            f"--out={tmp_path}",
        ],
        check=True,
        env=env,
        timeout=600,
    )
    assert (tmp_path / f"{stem}.md").read_text() == (RESULTS / f"{stem}.md").read_text()
    assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_closed_loop_clients_take_every_request_once_and_never_more_than_clients_at_a_time():
    import threading
    import time

    import serving_llama_cpp

    lock, running, peak, started = threading.Lock(), [0], [0], []

    def one(index):
        with lock:
            started.append(index)
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.002 * (index % 3))
        with lock:
            running[0] -= 1
        return index * 10

    results, wall = serving_llama_cpp.closed_loop(11, 3, one)
    assert sorted(results) == [i * 10 for i in range(11)] and started == sorted(started) and wall > 0
    assert peak[0] == 3


def test_a_part_run_again_replaces_the_runs_it_measured_again():
    import serving_render

    runs = {"engine": "old, every config", "static": "s"}
    serving_render.record_run(runs, "engine", ["compressed"], ("dense", "fp8", "compressed"), "t1")
    assert runs == {"engine": "old, every config", "static": "s", "engine compressed": "t1"}
    serving_render.record_run(runs, "engine", ["dense", "fp8", "compressed"], ("dense", "fp8", "compressed"), "t2")
    assert runs == {"static": "s", "engine dense/fp8/compressed": "t2"}
    serving_render.record_run(runs, "engine", ["fp8"], ("dense", "fp8", "compressed"), "t3")
    serving_render.record_run(runs, "static", ["fp8"], ("dense", "fp8", "compressed"), "t4")
    assert runs == {"static": "t4", "engine dense/fp8/compressed": "t2", "engine fp8": "t3"}
