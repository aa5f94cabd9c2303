"""Cost model on hand-built instruction records (no emulator involved).

Expected times are written out from the documented constants, so each test pins one rule of
the model: matmul cycles, engine concurrency, dependency ordering, DMA bandwidth and its documented
dependence on transfer size, targets.
"""

import dataclasses

import pytest

from nki_kernels.emulator import cost_model, trace

A = trace.Access


def _matmul(stationary, moving, out, *, contraction=128, stationary_free=128, moving_free=512, dtype="bfloat16"):
    itemsize = 4 if dtype == "float32" else 2
    return trace.InstructionRecord(
        opcode="nc_matmul",
        engine="tensor",
        line="k.py:1",
        partitions=contraction,
        free_elements=moving_free,
        dtype="float32",
        reads=(
            A(stationary, "sbuf", 0, contraction, 0, stationary_free * itemsize),
            A(moving, "sbuf", 0, contraction, 0, moving_free * itemsize),
        ),
        writes=(A(out, "psum", 0, stationary_free, 0, moving_free * 4),),
        matmul=trace.MatmulInfo(contraction, stationary_free, moving_free, dtype),
    )


def _elementwise(
    opcode,
    engine,
    src,
    dst,
    *,
    free=512,
    partitions=128,
    src_buffer="sbuf",
    dst_buffer="sbuf",
    dtype="float32",
    p_start=0,
    src_dtype=None,
    inner_contiguous=True,
):
    """One-input instruction; src_dtype defaults to dtype (the output's)."""
    return trace.InstructionRecord(
        opcode=opcode,
        engine=engine,
        line="k.py:2",
        partitions=partitions,
        free_elements=free,
        dtype=dtype,
        reads=(A(src, src_buffer, p_start, p_start + partitions, 0, free * 4),),
        writes=(A(dst, dst_buffer, p_start, p_start + partitions, 0, free * 4),),
        input_dtypes=(dtype if src_dtype is None else src_dtype,),
        inner_contiguous=inner_contiguous,
    )


def _dma(src, dst, nbytes, *, partitions=128, to_hbm=False, hbm_offset=0, hbm_run=None):
    """HBM <-> SBUF copy of nbytes over `partitions`; hbm_run: contiguous HBM bytes (default a row)."""
    per_partition = nbytes // partitions
    hbm = A(src if not to_hbm else dst, "hbm", 0, 1, hbm_offset, hbm_offset + nbytes)
    sbuf = A(dst if not to_hbm else src, "sbuf", 0, partitions, 0, per_partition)
    return trace.InstructionRecord(
        opcode="dma_copy",
        engine="dma",
        line="k.py:3",
        partitions=partitions,
        free_elements=per_partition // 2,
        dtype="bfloat16",
        reads=(sbuf,) if to_hbm else (hbm,),
        writes=(hbm,) if to_hbm else (sbuf,),
        dma=trace.DmaInfo(
            nbytes,
            "sbuf" if to_hbm else "hbm",
            "hbm" if to_hbm else "sbuf",
            per_partition if hbm_run is None else hbm_run,
        ),
    )


# Bytes per partition at which the documented DMA throughput curve is at its peak (32 KiB).
FULL_RATE_BYTES = 32768


def _run(*records, target="trn1"):
    return trace.KernelRun(name="synthetic", target=target, records=list(records))


def _us(cycles, ghz):
    return cycles / ghz / 1e3


@pytest.mark.parametrize(
    "moving_free, stationary_free, dtype, cycles",
    [
        (512, 128, "bfloat16", 512),
        (200, 128, "bfloat16", 200),
        (32, 128, "bfloat16", 64),  # below MM_INIT_LATENCY: max(N, 64)
        (32, 16, "bfloat16", 32),  # tiny stationary: max(min(64, 16), 32)
        (512, 128, "float32", 4 * 512),  # fp32 operands: 4x
        (32, 128, "float32", 4 * 64),
    ],
)
@pytest.mark.parametrize("target, ghz", [("trn1", 2.8), ("trn2", 2.4)])
def test_single_matmul_cycles(moving_free, stationary_free, dtype, cycles, target, ghz):
    run = _run(_matmul(1, 2, 3, stationary_free=stationary_free, moving_free=moving_free, dtype=dtype))
    assert cost_model.model_latency(run, target) == pytest.approx(_us(cycles, ghz))


@pytest.mark.parametrize("rows, cols, cycles", [(128, 32, 128), (16, 100, 64), (8, 20, 20)])
def test_tensor_engine_transpose_cycles(rows, cols, cycles):
    # nc_transpose of data [rows, cols] on TensorE: max(P, min(64, F)), also for fp32 data. The data is
    # the stationary operand [rows, cols], a [rows, rows] identity the moving one.
    record = trace.InstructionRecord(
        opcode="nc_transpose",
        engine="tensor",
        line="k.py:5",
        partitions=cols,
        free_elements=rows,
        dtype="float32",
        reads=(A(1, "sbuf", 0, rows, 0, cols * 4),),
        writes=(A(2, "psum", 0, cols, 0, rows * 4),),
        matmul=trace.MatmulInfo(
            contraction=rows, stationary_free=cols, moving_free=rows, input_dtype="float32", is_transpose=True
        ),
    )
    assert cost_model.model_latency(_run(record), "trn1") == pytest.approx(_us(cycles, 2.8))


def test_back_to_back_matmuls_add_up():
    # Accumulating matmuls into one PSUM tile: TensorE issues them in order, one pass each.
    run = _run(*[_matmul(10 + k, 20 + k, 3, moving_free=384) for k in range(7)])
    assert cost_model.model_latency(run, "trn1") == pytest.approx(7 * _us(384, 2.8))


def test_independent_engines_overlap():
    matmul = _matmul(1, 2, 3, moving_free=512)
    act = _elementwise("activation", "scalar", 4, 5, free=2048)
    vec = _elementwise("tensor_scalar", "vector", 6, 7, free=1000)
    run = _run(matmul, act, vec)
    expected = max(_us(512, 2.8), _us(2048, 1.4), _us(1000, 1.12))
    assert cost_model.model_latency(run, "trn1") == pytest.approx(expected)
    busy = cost_model.schedule(run, "trn1").engine_busy_us
    assert busy["scalar"] == pytest.approx(_us(2048, 1.4))
    assert busy["vector"] == pytest.approx(_us(1000, 1.12))


def test_read_after_write_serializes_with_dependency_overhead():
    matmul = _matmul(1, 2, 3, moving_free=512)
    evict = _elementwise("tensor_copy", "scalar", 3, 4, free=512, src_buffer="psum")
    run = _run(matmul, evict)
    sched = cost_model.schedule(run, "trn1")
    mm_us = _us(512, 2.8)
    assert sched.start_us[1] == pytest.approx(mm_us + _us(cost_model.DEPENDENT_OVERHEAD_CYCLES, 1.4))
    assert sched.latency_us == pytest.approx(sched.start_us[1] + _us(512, 1.4))


def test_write_after_read_waits_for_the_reader():
    # The DMA overwrites the moving tile the matmul is still reading.
    matmul = _matmul(1, 2, 3, moving_free=512)
    reload = _dma(50, 2, 128 * 1024)
    sched = cost_model.schedule(_run(matmul, reload), "trn1")
    assert sched.start_us[1] == pytest.approx(_us(512, 2.8))


def test_write_after_write_orders_on_chip_writes():
    first = _elementwise("tensor_scalar", "vector", 1, 9, free=4096)
    second = _elementwise("activation", "scalar", 2, 9, free=64)
    sched = cost_model.schedule(_run(first, second), "trn1")
    assert sched.start_us[1] >= sched.finish_us[0]


def test_disjoint_partitions_of_one_tensor_do_not_depend():
    low = _elementwise("tensor_scalar", "vector", 1, 9, free=4096, partitions=64, p_start=0)
    high = _elementwise("activation", "scalar", 1, 9, free=4096, partitions=64, p_start=64)
    sched = cost_model.schedule(_run(low, high), "trn1")
    assert sched.start_us[1] == 0.0


def test_tensor_tensor_costs_2n_from_sbuf_and_n_with_psum_input():
    def tt(src_buffer):
        return trace.InstructionRecord(
            opcode="tensor_tensor",
            engine="vector",
            line="k.py:4",
            partitions=128,
            free_elements=1024,
            dtype="float32",
            reads=(A(1, src_buffer, 0, 128, 0, 4096), A(2, "sbuf", 0, 128, 0, 4096)),
            writes=(A(3, "sbuf", 0, 128, 0, 4096),),
        )

    assert cost_model.model_latency(_run(tt("sbuf")), "trn1") == pytest.approx(_us(2048, 1.12))
    assert cost_model.model_latency(_run(tt("psum")), "trn1") == pytest.approx(_us(1024, 1.12))


def test_back_to_back_dependent_instructions_on_one_engine_pay_the_static_overhead():
    # The second reads the first's output on the same engine: it starts when the engine frees (ready ==
    # free), and the documented 100-cycle overhead for an instruction depending on the previous one applies.
    first = _elementwise("tensor_scalar", "vector", 1, 2, free=1000)
    second = _elementwise("tensor_scalar", "vector", 2, 3, free=1000)
    independent = _elementwise("tensor_scalar", "vector", 4, 5, free=1000)
    overhead = _us(cost_model.DEPENDENT_OVERHEAD_CYCLES, 1.12)
    dependent = cost_model.schedule(_run(first, second), "trn1")
    assert dependent.start_us[1] == pytest.approx(_us(1000, 1.12) + overhead)
    assert cost_model.model_latency(_run(first, independent), "trn1") == pytest.approx(2 * _us(1000, 1.12))


@pytest.mark.parametrize("free", [1, 7, 130, 1000])
def test_two_input_vector_instructions_cost_2n(free):
    # [ARCH1]: two input tiles take roughly 2N VectorE cycles; tensor_tensor_scan reads data0 and data1.
    scan = trace.InstructionRecord(
        opcode="tensor_tensor_scan",
        engine="vector",
        line="k.py:5",
        partitions=128,
        free_elements=free,
        dtype="float32",
        reads=(A(1, "sbuf", 0, 128, 0, 4 * free), A(2, "psum", 0, 128, 0, 4 * free)),
        writes=(A(3, "sbuf", 0, 128, 0, 4 * free),),
        input_dtypes=("float32", "float32"),
    )
    one_input = dataclasses.replace(scan, reads=scan.reads[:1], input_dtypes=("float32",))
    assert cost_model.model_latency(_run(scan), "trn1") == pytest.approx(
        _us(max(cost_model.MIN_II_CYCLES, 2 * free), 1.12)
    )
    assert cost_model.model_latency(_run(one_input), "trn1") == pytest.approx(
        _us(max(cost_model.MIN_II_CYCLES, free), 1.12)
    )


def test_small_instruction_pays_min_initiation_interval():
    run = _run(_elementwise("activation", "scalar", 1, 2, free=3))
    assert cost_model.model_latency(run, "trn1") == pytest.approx(_us(cost_model.MIN_II_CYCLES, 1.4))


def test_trn2_vector_perf_mode_for_bf16_copies():
    copy = _elementwise("tensor_copy", "vector", 1, 2, free=4096, dtype="bfloat16")
    assert cost_model.model_latency(_run(copy), "trn1") == pytest.approx(_us(4096, 1.12))
    assert cost_model.model_latency(_run(copy), "trn2") == pytest.approx(_us(4096 / 4, 0.96))


@pytest.mark.parametrize("opcode", ["tensor_copy", "tensor_scalar"])
@pytest.mark.parametrize(
    "src_buffer, src_dtype, dtype, inner_contiguous, speedup",
    [
        ("sbuf", "float16", "bfloat16", True, 4),  # 1a+1b+1c (input and output dtypes need not match)
        ("sbuf", "bfloat16", "bfloat16", False, 2),  # 1a+1b, innermost elements strided
        ("psum", "bfloat16", "bfloat16", True, 2),  # 1b+1c with the input in PSUM
        ("psum", "bfloat16", "bfloat16", False, 1),  # PSUM and strided: neither case
        ("psum", "float32", "bfloat16", True, 1),  # fp32 PSUM eviction to bf16: the input is not 16-bit
        ("sbuf", "float32", "bfloat16", True, 1),
        ("sbuf", "bfloat16", "float32", True, 1),
    ],
)
def test_trn2_vector_perf_mode_needs_every_tensor_16_bit(
    opcode, src_buffer, src_dtype, dtype, inner_contiguous, speedup
):
    # Trainium2 architecture guide, "Vector Engine Performance Mode".
    record = _elementwise(
        opcode,
        "vector",
        1,
        2,
        free=4096,
        src_buffer=src_buffer,
        dtype=dtype,
        src_dtype=src_dtype,
        inner_contiguous=inner_contiguous,
    )
    assert cost_model.model_latency(_run(record), "trn2") == pytest.approx(_us(4096 / speedup, 0.96))
    assert cost_model.model_latency(_run(record), "trn1") == pytest.approx(_us(4096, 1.12))


def test_trn2_vector_perf_mode_needs_known_input_dtypes():
    record = dataclasses.replace(
        _elementwise("tensor_copy", "vector", 1, 2, free=4096, dtype="bfloat16"), input_dtypes=()
    )
    assert cost_model.model_latency(_run(record), "trn2") == pytest.approx(_us(4096, 0.96))


@pytest.mark.parametrize(
    "dtype1, dtype2, speedup", [("bfloat16", "float16", 2), ("bfloat16", "float32", 1), ("float32", "bfloat16", 1)]
)
def test_trn2_tensor_tensor_perf_mode_needs_both_inputs_16_bit(dtype1, dtype2, speedup):
    # 2x case 2a: both inputs in SBUF, all of input/output tensors in BF16/FP16 (output bf16 here).
    record = trace.InstructionRecord(
        opcode="tensor_tensor",
        engine="vector",
        line="k.py:4",
        partitions=128,
        free_elements=1024,
        dtype="bfloat16",
        reads=(A(1, "sbuf", 0, 128, 0, 4096), A(2, "sbuf", 0, 128, 0, 4096)),
        writes=(A(3, "sbuf", 0, 128, 0, 2048),),
        input_dtypes=(dtype1, dtype2),
    )
    assert cost_model.model_latency(_run(record), "trn2") == pytest.approx(_us(2048 / speedup, 0.96))


@pytest.mark.parametrize("target, engine_rate", [("trn1", 17.0), ("trn2", min(23.0, 2900.0 / 8 / 16))])
def test_one_large_dma_runs_at_sixteen_engines_bandwidth(target, engine_rate):
    nbytes = 128 * FULL_RATE_BYTES
    run = _run(_dma(1, 2, nbytes))
    expected_ns = nbytes / (16 * engine_rate) + cost_model.DMA_FIXED_LATENCY_NS
    assert cost_model.model_latency(run, target) == pytest.approx(expected_ns / 1e3)


def test_many_dmas_are_bandwidth_bound():
    nbytes = 128 * FULL_RATE_BYTES
    run = _run(*[_dma(1, 100 + i, nbytes, hbm_offset=i * nbytes) for i in range(12)])
    expected_ns = 12 * nbytes / (16 * 17.0) + cost_model.DMA_FIXED_LATENCY_NS
    assert cost_model.model_latency(run, "trn1") == pytest.approx(expected_ns / 1e3)


@pytest.mark.parametrize("partitions, engines", [(1, 1), (4, 1), (8, 1), (9, 2), (64, 8), (100, 13), (128, 16)])
def test_one_dma_engine_per_eight_partitions(partitions, engines):
    # NKI DMA overview: each engine serves 8 partition lanes; a [4, 4096] load runs on one engine.
    nbytes = partitions * FULL_RATE_BYTES
    run = _run(_dma(1, 2, nbytes, partitions=partitions))
    expected_ns = nbytes / (engines * 17.0) + cost_model.DMA_FIXED_LATENCY_NS
    assert cost_model.model_latency(run, "trn1") == pytest.approx(expected_ns / 1e3)


# Throughput relative to 32 KiB per partition, read off the NKI DMA overview figure (p_dim = 128).
DOCUMENTED_CURVE = [(32, 0.016), (256, 0.105), (512, 0.209), (1024, 0.423), (2048, 0.815), (4096, 0.965), (8192, 0.983)]


@pytest.mark.parametrize("per_partition, efficiency", DOCUMENTED_CURVE)
@pytest.mark.parametrize("target, engine_rate", [("trn1", 17.0), ("trn2", min(23.0, 2900.0 / 8 / 16))])
def test_dma_time_follows_the_documented_throughput_curve(per_partition, efficiency, target, engine_rate):
    nbytes = 128 * per_partition
    run = _run(_dma(1, 2, nbytes))
    expected_ns = nbytes / (16 * engine_rate * efficiency) + cost_model.DMA_FIXED_LATENCY_NS
    assert cost_model.model_latency(run, target) == pytest.approx(expected_ns / 1e3)


def test_small_dmas_cost_more_per_byte_than_large_ones():
    sizes = [4, 16, 32, 48, 100, 256, 384, 1000, 1024, 3000, 4096, 10000, 32768]
    per_byte = []
    for per_partition in sizes:
        engines, busy_ns = cost_model.dma_transfer_ns(_dma(1, 2, 128 * per_partition), cost_model.HARDWARE["trn1"])
        assert engines == 16
        per_byte.append(busy_ns / (128 * per_partition))
    assert all(a > b for a, b in zip(per_byte, per_byte[1:]))
    # 256 B per partition moves at about a tenth of the 32 KiB rate; 4 KiB nearly saturates.
    assert per_byte[sizes.index(256)] / per_byte[-1] == pytest.approx(1 / 0.105)
    assert per_byte[sizes.index(4096)] / per_byte[-1] == pytest.approx(1 / 0.965)


def test_below_the_smallest_measured_size_a_dma_costs_a_fixed_time():
    # Under 32 B per partition (the figure's smallest point) throughput is taken as proportional to size
    # (fixed cost per transfer): every smaller transfer is charged the 32 B time, an extrapolation.
    hw = cost_model.HARDWARE["trn1"]
    times = [cost_model.dma_transfer_ns(_dma(1, 2, 128 * b), hw)[1] for b in (1, 2, 4, 16, 32)]
    assert times == pytest.approx([times[-1]] * 5)
    assert times[-1] == pytest.approx(8 * 32 / (17.0 * 0.016))


def test_between_measured_sizes_efficiency_lies_between_neighbours():
    for (x0, y0), (x1, y1) in zip(
        cost_model.DMA_EFFICIENCY_BY_PARTITION_BYTES, cost_model.DMA_EFFICIENCY_BY_PARTITION_BYTES[1:]
    ):
        assert cost_model.dma_efficiency(x0) == pytest.approx(y0)
        assert y0 < cost_model.dma_efficiency((x0 + x1) / 2) < y1
    assert cost_model.dma_efficiency(1 << 20) == 1.0


def test_short_hbm_runs_set_the_dma_buffer_size():
    # 4 KiB per partition gathered from 256 B contiguous HBM pieces moves at the 256 B rate.
    hw = cost_model.HARDWARE["trn1"]
    gathered = cost_model.dma_transfer_ns(_dma(1, 2, 128 * 4096, hbm_run=256), hw)[1]
    rows = cost_model.dma_transfer_ns(_dma(1, 2, 128 * 4096), hw)[1]
    assert gathered == pytest.approx(8 * 4096 / (17.0 * 0.105))
    assert rows == pytest.approx(8 * 4096 / (17.0 * 0.965))
    # A fully contiguous HBM tile is still one buffer per SBUF partition.
    whole = cost_model.dma_transfer_ns(_dma(1, 2, 128 * 4096, hbm_run=128 * 4096), hw)[1]
    assert whole == pytest.approx(rows)


def test_hbm_to_hbm_copy_uses_its_contiguous_run():
    def copy(run_bytes):
        return trace.InstructionRecord(
            opcode="dma_copy",
            engine="dma",
            line="k.py:6",
            partitions=1,
            free_elements=32768,
            dtype="float32",
            reads=(A(1, "hbm", 0, 1, 0, 131072),),
            writes=(A(2, "hbm", 0, 1, 0, 131072),),
            dma=trace.DmaInfo(131072, "hbm", "hbm", run_bytes),
        )

    hw = cost_model.HARDWARE["trn1"]
    assert cost_model.dma_transfer_ns(copy(131072), hw) == (1, pytest.approx(131072 / 17.0))
    assert cost_model.dma_transfer_ns(copy(512), hw) == (1, pytest.approx(131072 / (17.0 * 0.209)))


def test_dma_waiting_on_compute_does_not_block_independent_dma():
    act = _elementwise("activation", "scalar", 1, 2, free=65536)
    store = _dma(2, 3, 128 * 65536 * 4, to_hbm=True)  # waits for the activation
    load = _dma(4, 5, 128 * 2048)  # independent, issued later
    sched = cost_model.schedule(_run(act, store, load), "trn1")
    assert sched.start_us[1] == pytest.approx(_us(65536, 1.4))
    assert sched.start_us[2] == 0.0


def test_stores_to_overlapping_hbm_spans_are_not_ordered():
    # Column tiles of one output matrix have overlapping flattened byte spans.
    stores = [_dma(10 + i, 99, 128 * 2048, to_hbm=True, hbm_offset=i * 1024) for i in range(2)]
    sched = cost_model.schedule(_run(*stores), "trn1")
    assert sched.start_us[1] < sched.finish_us[0]


def test_load_after_store_to_same_hbm_waits():
    store = _dma(10, 99, 128 * 2048, to_hbm=True)
    load = _dma(99, 11, 128 * 2048)
    sched = cost_model.schedule(_run(store, load), "trn1")
    assert sched.start_us[1] == pytest.approx(sched.finish_us[0])


def test_trn2_is_slower_per_matmul_but_faster_per_dma_than_trn1():
    matmuls = _run(*[_matmul(1, 2, 3) for _ in range(4)])
    assert cost_model.model_latency(matmuls, "trn2") / cost_model.model_latency(matmuls, "trn1") == pytest.approx(
        2.8 / 2.4
    )
    dmas = _run(*[_dma(1, 10 + i, 128 * 8192, hbm_offset=i * 128 * 8192) for i in range(8)])
    assert cost_model.model_latency(dmas, "trn2") < cost_model.model_latency(dmas, "trn1")


def test_roofline():
    # 1 GFLOP of bf16 on trn1: 1e9 / (128*128*2*2.8e9) s; 1 MB over min(410, 16*17) GB/s.
    assert cost_model.roofline_us(1e9, 0, "trn1") == pytest.approx(1e9 / (128 * 128 * 2 * 2.8e3))
    assert cost_model.roofline_us(0, 1e6, "trn1") == pytest.approx(1e6 / 272.0 / 1e3)
    assert cost_model.roofline_us(1e9, 0, "trn2", "float32") == pytest.approx(4 * 1e9 / (128 * 128 * 2 * 2.4e3))
    assert cost_model.roofline_us(0, 1e6, "trn2") == pytest.approx(1e6 / 362.5 / 1e3)


def test_bad_target_and_engine_raise():
    with pytest.raises(ValueError, match="target"):
        cost_model.model_latency(_run(), "trn9")
    bogus = trace.InstructionRecord("x", "warp", "k.py:9", 1, 1, "float32", (), ())
    with pytest.raises(ValueError, match="warp"):
        cost_model.model_latency(_run(bogus), "trn1")
    with pytest.raises(ValueError, match="flops"):
        cost_model.roofline_us(-1, 0, "trn1")
    with pytest.raises(ValueError, match="buffer_bytes"):
        cost_model.dma_efficiency(0)


def _all_reduce(src, dst, nbytes, ranks=4):
    """An nki.collectives all_reduce record over `ranks` ranks (HBM to HBM)."""
    return trace.InstructionRecord(
        opcode="all_reduce",
        engine="dma",
        line="k.py:4",
        partitions=1,
        free_elements=nbytes // 4,
        dtype="float32",
        reads=(A(src, "hbm", 0, 1, 0, nbytes),),
        writes=(A(dst, "hbm", 0, 1, 0, nbytes),),
        collective=trace.CollectiveInfo("all_reduce", nbytes, ranks, ranks),
    )


def test_unlimited_bandwidth_keeps_fixed_latencies_and_the_dependency_chain():
    """With unlimited DMA and link bandwidth a transfer takes its fixed latency only (16 MiB loads on the same
    engines no longer queue), a collective its hop latency, and compute and dependencies are as modeled."""
    loads = [_dma(10 + i, 20 + i, 128 * FULL_RATE_BYTES * 4) for i in range(4)]
    act = _elementwise("activation", "scalar", 23, 30, free=4096)  # reads the last load
    reduce = _all_reduce(40, 41, 1 << 20)
    run = _run(*loads, act, reduce, target="trn2")
    links = cost_model.collective_links("trn2", hop_latency_us=1.5)
    slow = cost_model.schedule(run, "trn2", links)
    fast = cost_model.schedule(run, "trn2", links, unlimited_bandwidth=True)
    fixed_us = cost_model.DMA_FIXED_LATENCY_NS / 1e3
    assert fast.finish_us[:4] == pytest.approx((fixed_us,) * 4)
    assert slow.finish_us[3] > 4 * fixed_us  # the loads queue on the engines at the modeled rate
    ghz = cost_model.HARDWARE["trn2"].scalar_ghz
    overhead = cost_model.DEPENDENT_OVERHEAD_CYCLES
    assert fast.start_us[4] == pytest.approx(fixed_us + _us(overhead, ghz))
    assert fast.finish_us[4] - fast.start_us[4] == pytest.approx(slow.finish_us[4] - slow.start_us[4])
    assert fast.finish_us[5] - fast.start_us[5] == pytest.approx(1.5)  # one mesh hop, no bytes on the links
    assert slow.finish_us[5] - slow.start_us[5] > 1.5
    assert fast.engine_busy_us["dma"] == 0.0 and fast.engine_busy_us["scalar"] == slow.engine_busy_us["scalar"]
    assert cost_model.dependency_floor_us(run, "trn2", links) == fast.latency_us < slow.latency_us
