"""The tensor-parallel decode step (nki_kernels.decode.sharding, .parallel, runner.run_sharded_decode_step): a whole
model cut into 2 or 4 Megatron shards and run on that many emulated NeuronCores (simulate_spmd, real data through
nki.collectives) equals the float64 reference of the WHOLE model, and the single-rank kernels' step, in every
composition.

Tiny ragged shapes: H = 200 (natural tiles) and 256 (row-grouped), per-rank intermediate 100 / 50 / 192 / 96 and
vocabulary 150 / 75 (not multiples of 128); Llama-like dense, Gemma-3-like with factored projections and head at
ragged per-layer ranks (o and down split u's rows, the others v's columns), and fp8 weights.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from decode_operands import (
    BF16,
    GEMMA3,
    GEMMA3_DENSE_LAYERS,
    RING,
    check_cache,
    fp8_operands,
    llama_like,
    make_operands,
    relative_error,
)
from harness import comparison
from harness.runner import COMPOSITIONS, run_decode_step, run_sharded_decode_step

from nki_kernels.decode import parallel, reference, traffic
from nki_kernels.decode.contract import WEIGHTS, DecodeOperands, Factored, Quantized
from nki_kernels.decode.sharding import gather_cache, shard_operands, shard_spec
from nki_kernels.emulator import cost_model, profile, trace

LLAMA_TP = llama_like(num_layers=2, hidden=200, num_heads=8, num_kv_heads=4, head_dim=32, intermediate=200)
# Gemma 3's variants with 4 KV heads of 2 query heads each; its ragged per-layer ranks, factored head.
GEMMA3_TP = GEMMA3.replace(num_heads=8, num_kv_heads=4, head_dim=32)
GEMMA3_TP_FP8 = GEMMA3_TP.replace(fp8_weights=WEIGHTS)
# Layers left dense in factored stacks: each rank reads its shard of W alone (v's columns, o's and down's u's rows).
GEMMA3_TP_DENSE_LAYERS = GEMMA3_DENSE_LAYERS.replace(num_heads=8, num_kv_heads=4, head_dim=32)

# (spec, ranks, B, T, S, write slot, dtype, tolerance against the float64 reference)
CASES = [
    (LLAMA_TP, 2, 3, 1, 12, 11, np.float32, 1e-5),
    (LLAMA_TP, 4, 2, 2, 9, 3, np.float32, 1e-5),
    (GEMMA3_TP, 2, 1, 2, 20, 7, np.float32, 1e-5),
    (GEMMA3_TP, 4, 2, 1, 10, 4, BF16, 2e-2),
    (GEMMA3, 4, 1, 1, 8, 6, np.float32, 1e-5),  # one KV head, replicated on the 4 ranks
    (GEMMA3_TP_DENSE_LAYERS, 2, 2, 1, 12, 5, np.float32, 1e-5),
]
IDS = [
    "llama-dense-2",
    "llama-dense-4",
    "gemma3-factored-2",
    "gemma3-factored-bf16-4",
    "gemma3-kv-replicated-4",
    "gemma3-dense-layers-2",
]


def _step(spec, ranks, operands, composition):
    """(logits, whole k_cache, whole v_cache) of the sharded step, and the per-rank profile runs."""
    rank_spec, shards = shard_operands(spec, operands, ranks)
    with profile() as prof:
        logits, k_caches, v_caches = run_sharded_decode_step(composition, shards, rank_spec, **RING)
    return (logits, gather_cache(k_caches, spec.num_kv_heads), gather_cache(v_caches, spec.num_kv_heads)), prof.runs


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("spec, ranks, b, t, s, w, dtype, tolerance", CASES, ids=IDS)
def test_sharded_step_matches_whole_model(rng, composition, spec, ranks, b, t, s, w, dtype, tolerance):
    operands = make_operands(rng, spec, b, t, s, w, dtype)
    k_before, v_before = operands[10].copy(), operands[11].copy()
    want_logits, want_k, want_v = reference.decode_step_f64(operands, spec)
    (logits, k_cache, v_cache), runs = _step(spec, ranks, operands, composition)
    assert logits.shape == (b, t, spec.vocab) and logits.dtype == np.float32
    assert relative_error(logits, want_logits) < tolerance
    check_cache(k_cache, k_before, want_k, w, t, tolerance)
    check_cache(v_cache, v_before, want_v, w, t, tolerance)
    single_logits, single_k, _ = run_decode_step(composition, operands, spec, **RING)
    assert relative_error(logits, single_logits.astype(np.float64)) < tolerance
    assert relative_error(k_cache, single_k.astype(np.float64)) < tolerance
    assert {run.rank for run in runs} == set(range(ranks))
    # Two all-reduces a layer (o, down) and one gather, on every rank; priced by the cost model.
    assert sum(run.collectives for run in runs) == ranks * (2 * spec.num_layers + 1)
    assert all(run.collective_us["trn2"] > 0 for run in runs if run.collectives)


def test_one_row_logits_gather_in_pieces(rng, monkeypatch):
    """One row's logits gathered a piece of each rank's slice at a time (parallel.gather_pieces: 75 columns a rank
    cut into 37, 19 and 19 with a tail of 16; strided pieces of the logits row) equal the float64 reference."""
    monkeypatch.setattr(parallel, "GATHER_TAIL_COLUMNS", 16)
    spec, ranks, b, t, s, w = GEMMA3, 4, 1, 1, 8, 6
    pieces = parallel.gather_pieces(shard_spec(spec, ranks).vocab)
    assert pieces == [(0, 37), (37, 19), (56, 19)]
    operands = make_operands(rng, spec, b, t, s, w, np.float32)
    want_logits, _, _ = reference.decode_step_f64(operands, spec)
    (logits, _, _), runs = _step(spec, ranks, operands, "looped")
    assert relative_error(logits, want_logits) < 1e-5
    assert sum(run.collectives for run in runs) == ranks * (2 * spec.num_layers + len(pieces))


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("spec", [GEMMA3_TP_FP8, GEMMA3_TP_DENSE_LAYERS.replace(fp8_weights=WEIGHTS)])
def test_sharded_fp8_step_matches_whole_model(rng, composition, spec):
    ranks, b, t, s, w = 2, 1, 2, 12, 5
    operands = fp8_operands(rng, spec, b, t, s, w)
    want_logits, want_k, _ = reference.decode_step_f64(operands, spec)
    (logits, k_cache, _), _ = _step(spec, ranks, operands, composition)
    assert np.std(want_logits) > 0.1
    assert relative_error(logits, want_logits) < 2e-2
    check_cache(k_cache, operands[10], want_k, w, t, 2e-2)
    single_logits, _, _ = run_decode_step(composition, operands, spec, **RING)
    assert relative_error(logits, single_logits.astype(np.float64)) < 2e-2  # both round bf16 activations


def test_looped_kernel_keeps_loading_weights_while_a_collective_runs(rng):
    """On the cost model's schedule, the ring loads the kernel issues after each all-reduce start before it ends:
    they wait for nothing but ring space, so the collective does not stall the prefetch."""
    rank_spec, shards = shard_operands(LLAMA_TP, make_operands(rng, LLAMA_TP, 2, 1, 12, 5, BF16), 2)
    runs = []
    trace.add_listener(runs.append)
    try:
        run_sharded_decode_step("looped", shards, rank_spec)
    finally:
        trace.remove_listener(runs.append)
    records = runs[0].records
    for target in cost_model.TARGETS:
        schedule = cost_model.schedule(runs[0], target)
        reduces = [i for i, r in enumerate(records) if r.collective is not None and r.collective.kind == "all_reduce"]
        assert len(reduces) == 2 * LLAMA_TP.num_layers and schedule.collective_us > 0
        for i in reduces:
            later = [j for j in range(i + 1, len(records)) if records[j].dma and records[j].line.startswith("ring.py")]
            assert schedule.start_us[later[0]] < schedule.finish_us[i]


def test_shards_split_heads_features_and_vocabulary(rng):
    spec = GEMMA3_TP_FP8
    operands = DecodeOperands.of(fp8_operands(rng, spec, 1, 1, 6, 2), spec)
    rank_spec, shards = shard_operands(spec, operands, 2)
    assert (rank_spec.num_heads, rank_spec.num_kv_heads, rank_spec.intermediate, rank_spec.vocab) == (4, 2, 192, 150)
    assert rank_spec.tensor_parallel == 2 and rank_spec.hidden == spec.hidden and rank_spec.ranks == spec.ranks
    second = shards[1]
    q, o, k, gate, down, head = (getattr(second, n) for n in ("q", "o", "k", "gate", "down", "head"))
    assert isinstance(q, Factored) and isinstance(k, Quantized)
    np.testing.assert_array_equal(q.u, operands.q.u)  # column split: u whole, v's columns and their scales
    np.testing.assert_array_equal(q.v, operands.q.v[:, :, 128:])
    np.testing.assert_array_equal(q.v_scale, operands.q.v_scale[:, 128:])
    np.testing.assert_array_equal(k.w, operands.k.w[:, :, 64:])
    np.testing.assert_array_equal(k.scale, operands.k.scale[:, 64:])
    np.testing.assert_array_equal(o.u, operands.o.u[:, 128:])  # row split: u's rows, v and the scales whole
    np.testing.assert_array_equal(o.v, operands.o.v)
    np.testing.assert_array_equal(o.u_scale, operands.o.u_scale)
    np.testing.assert_array_equal(down.u, operands.down.u[:, 192:])
    np.testing.assert_array_equal(gate.v, operands.gate.v[:, :, 192:])
    np.testing.assert_array_equal(head.v, operands.head.v[:, 150:])
    np.testing.assert_array_equal(second.k_cache, operands.k_cache[:, :, :, 2:])
    np.testing.assert_array_equal(second.norms, operands.norms)
    np.testing.assert_array_equal(gather_cache([s.v_cache for s in shards], 4), operands.v_cache)


def test_replicated_kv_heads_go_to_the_ranks_of_their_query_heads(rng):
    """LLAMA_TP on 8 ranks: 4 KV heads of 2 query heads each; ranks 2j and 2j+1 share KV head j."""
    spec = LLAMA_TP.replace(vocab=296)
    operands = DecodeOperands.of(make_operands(rng, spec, 1, 1, 6, 2, np.float32), spec)
    rank_spec, shards = shard_operands(spec, operands, 8)
    assert (rank_spec.num_heads, rank_spec.num_kv_heads, rank_spec.intermediate, rank_spec.vocab) == (1, 1, 25, 37)
    d = spec.head_dim
    for r, shard in enumerate(shards):
        np.testing.assert_array_equal(shard.q, operands.q[:, :, r * d : (r + 1) * d])
        np.testing.assert_array_equal(shard.k, operands.k[:, :, r // 2 * d : (r // 2 + 1) * d])
        np.testing.assert_array_equal(shard.v_cache, operands.v_cache[:, :, :, r // 2 : r // 2 + 1])
    np.testing.assert_array_equal(gather_cache([s.k_cache for s in shards], 4), operands.k_cache)


def test_rejects_ranks_that_do_not_divide_the_model(rng):
    with pytest.raises(ValueError, match="tensor_parallel: got 3, which does not divide spec.num_kv_heads = 4"):
        shard_spec(LLAMA_TP, 3)
    with pytest.raises(ValueError, match="nor is it a multiple of them that divides spec.num_heads = 8"):
        shard_spec(LLAMA_TP, 16)
    uneven = LLAMA_TP.replace(num_heads=8, num_kv_heads=8, intermediate=196)
    with pytest.raises(ValueError, match="tensor_parallel: got 8, which does not divide spec.intermediate = 196"):
        shard_spec(uneven, 8)
    with pytest.raises(ValueError, match="tensor_parallel: got 8, which does not divide spec.vocab = 300"):
        shard_spec(uneven.replace(intermediate=200), 8)
    with pytest.raises(ValueError, match="tensor_parallel: got 0"):
        shard_spec(LLAMA_TP, 0)
    with pytest.raises(TypeError, match="tensor_parallel"):
        shard_spec(LLAMA_TP, 2.0)
    rank_spec = shard_spec(LLAMA_TP, 2)
    with pytest.raises(ValueError, match="spec.tensor_parallel: got 2, expected 1"):
        shard_spec(rank_spec, 2)
    operands = make_operands(rng, LLAMA_TP, 1, 1, 8, 3, np.float32)
    with pytest.raises(ValueError, match="x has shape"):
        shard_operands(LLAMA_TP, [operands[0][:, :, :100]] + operands[1:], 2)
    _, shards = shard_operands(LLAMA_TP, operands, 2)
    with pytest.raises(ValueError, match="rank_operands: got 1 operand sets, expected one per rank"):
        run_sharded_decode_step("looped", shards[:1], rank_spec)
    with pytest.raises(ValueError, match="run_sharded_decode_step"):
        run_decode_step("looped", shards[0], rank_spec)


def test_traffic_counts_one_rank_and_its_collectives(rng):
    """A rank moves 1/T of the dense weights and the cache, and sends what collective_bytes counts (hidden, vocab
    slices and ranks whole tiles here: the kernels sum whole column tiles)."""
    spec = llama_like(num_layers=2, hidden=256, num_heads=8, num_kv_heads=4, head_dim=32, intermediate=256)
    ranks, b, s = 4, 2, 12
    rank_spec = shard_spec(spec, ranks)
    assert ranks * traffic.weight_bytes(rank_spec) == traffic.weight_bytes(spec)
    whole, one = (traffic.must_move_bytes(x, b, s, layers_only=True) for x in (spec, rank_spec))
    norms = spec.num_layers * spec.num_norms * spec.hidden * 2
    assert ranks * (one - norms - b * spec.hidden * 2) == whole - norms - b * spec.hidden * 2
    head = traffic.weight_bytes(rank_spec) - traffic.weight_bytes(rank_spec, head=False)
    logits = b * spec.vocab * 4  # every rank writes the whole logits
    assert traffic.must_move_bytes(rank_spec, b, s) - one == spec.hidden * 2 + head + logits - b * spec.hidden * 2
    assert traffic.collective_bytes(spec, b) == 0
    sent = traffic.collective_bytes(rank_spec, b)
    assert sent == 4 * b * (2 * spec.num_layers * spec.hidden + rank_spec.vocab)
    _, shards = shard_operands(spec, make_operands(rng, spec, b, 1, s, 3, BF16), ranks)
    with profile() as prof:
        run_sharded_decode_step("looped", shards, rank_spec)
    assert [run.collective_bytes for run in prof.runs] == [sent] * ranks


def test_measure_spec_models_one_rank_with_its_collectives():
    spec = shard_spec(GEMMA3_TP, 2)
    for composition in ("per_op", "looped"):
        m = comparison.measure_spec(spec, composition, 1, 16)
        assert set(m.kernel_us) == set(cost_model.TARGETS) and not m.note
        for t in cost_model.TARGETS:
            assert 0 < m.collective_us[t] < m.kernel_us[t]


def test_physical_bound_prices_the_collectives_the_kernel_makes():
    """With whole tiles (H = 256), the looped kernel's modeled time in collectives is the links' floor exactly; the
    bound is at least the must-move bytes at the peak rate and under the modeled step."""
    spec = llama_like(num_layers=2, hidden=256, num_heads=8, num_kv_heads=4, head_dim=32, intermediate=256)
    rank_spec = shard_spec(spec, 4)
    m = comparison.measure_spec(rank_spec, "looped", 2, 16)
    for t in cost_model.TARGETS:
        assert comparison.collective_floor_us(spec, 2, t) == 0
        floor = comparison.collective_floor_us(rank_spec, 2, t)
        assert m.collective_us[t] == pytest.approx(floor)
        bound = comparison.tensor_parallel_bound_us(rank_spec, 2, 16, t)
        need = traffic.must_move_bytes(rank_spec, 2, 16)
        assert max(floor, cost_model.roofline_us(0, need, t)) == bound < m.kernel_us[t]


def test_quick_tensor_parallel_report(tmp_path):
    bench = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "decode_compositions.py")
    args = ["--quick", "--tensor_parallel", "--tp_degrees=1,2,8", "--compositions=looped", f"--out_dir={tmp_path}"]
    result = subprocess.run([sys.executable, bench, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    text = (tmp_path / "decode_tensor_parallel_quick.md").read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "(iii) looped" in line]
    assert [(row[0], row[3]) for row in rows] == [
        ("| 1", "dense"),
        ("| 1", "compressed"),
        ("| 2", "dense"),
        ("| 2", "compressed"),
    ]
    assert all("(0%)" not in row[8] for row in rows[2:]) and "x) / " in rows[2][-3]  # byte bound per target
    floors = [cell.split(" (")[1].split(")")[0] for cell in rows[2][-2].split(" / ")]
    assert len(floors) == 2 and all(f.endswith((", chain", ", bytes")) for f in floors)  # dependency floors
    # Speedup over T = 1: documented, then at the fitted terms with its band, per target; T = 1 over itself is 1.
    scaling = rows[2][-1].rstrip(" |")
    assert re.fullmatch(r"(\d\.\d\dx / \d\.\d\dx \(\d\.\d\d–\d\.\d\dx\)( / )?){2}", scaling), scaling
    assert rows[0][-1].rstrip(" |") == "1.00x / 1.00x (1.00–1.00x) / 1.00x / 1.00x (1.00–1.00x)"
    assert "T = 8 not run: tensor_parallel: got 8" in text and "modeled, not measured" in text


GEMMA3_TP_DENSE = GEMMA3_TP.replace(ranks=(None,) * len(GEMMA3_TP.ranks), head_rank=None)


@pytest.mark.parametrize("spec, ranks", [(LLAMA_TP, 2), (GEMMA3_TP_DENSE, 4)], ids=["llama-2", "gemma3-4"])
def test_greedy_tokens_of_the_sharded_emulator_equal_the_xla_backend(rng, spec, ranks):
    """Three greedy steps (each step's tokens embedded by a random table as the next x, the caches carried): the
    looped kernel on `ranks` emulated NeuronCores picks the tokens the single-device XLA decode_step picks, and its
    logits agree to float32 rounding."""
    import jax.numpy as jnp

    import jax_neuronmm
    from jax_neuronmm.decode_step import decode_step

    b, s, w = 3, 12, 5
    operands = make_operands(rng, spec, b, 1, s, w, np.float32)
    embedding = rng.standard_normal((spec.vocab, spec.hidden)).astype(np.float32)
    emulated = list(operands)
    xla_ops = DecodeOperands.of([_jax(o) for o in DecodeOperands.of(operands, spec).values()], spec)
    tokens_seen = set()
    for step in range(3):
        rank_spec, shards = shard_operands(spec, emulated, ranks)
        logits, k_caches, v_caches = run_sharded_decode_step("looped", shards, rank_spec, **RING)
        with jax_neuronmm.use_backend("xla"):
            xla_logits, xla_k, xla_v = decode_step(xla_ops, spec=spec)
        assert relative_error(logits, np.asarray(xla_logits, np.float64)) < 1e-5
        tokens = np.argmax(logits[:, 0], axis=-1)
        np.testing.assert_array_equal(tokens, np.argmax(np.asarray(xla_logits)[:, 0], axis=-1))
        tokens_seen.add(tuple(tokens))
        index = np.array([[w + step + 1]], np.int32)
        x = embedding[tokens][:, None]
        emulated[0], emulated[10], emulated[11], emulated[12] = (
            x,
            gather_cache(k_caches, spec.num_kv_heads),
            gather_cache(v_caches, spec.num_kv_heads),
            index,
        )
        xla_ops = xla_ops.replace(x=jnp.asarray(x), k_cache=xla_k, v_cache=xla_v, write_index=jnp.asarray(index))
    assert len(tokens_seen) > 1  # the steps pick different tokens: the loop carries state


def _jax(value):
    import jax.numpy as jnp

    if isinstance(value, np.ndarray):
        return jnp.asarray(value)
    if isinstance(value, (Factored, Quantized)):
        return type(value)(*(jnp.asarray(part) for part in value.parts().values()))
    return value
