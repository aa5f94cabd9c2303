"""serving.engine: continuous batching over the paged cache. A greedy request's tokens equal `models.generate`'s
whatever shares the batch and whenever it arrives (chunked prefill, preemption when blocks run out included);
on the emulator each decode step of a model `models.decode` covers is one looped decode_step kernel launch (others
decode through their own layers); cancel frees its blocks; per-request sampling is reproducible; incremental
detokenization never breaks a character and honours stop strings."""

import dataclasses
import threading

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx
from test_models_paged import _model, _randomize

import jax_neuronmm
from jax_neuronmm.models import Llama, LlamaConfig, generate
from jax_neuronmm.serving import engine as engine_module
from jax_neuronmm.serving.detokenize import Detokenizer
from jax_neuronmm.serving.engine import (
    ContextExceeded,
    Engine,
    EngineOptions,
    QueueFull,
    SamplingParams,
    StepRecord,
)

VOCAB = 97
# 12 blocks of 5 slots for four rows of up to 40 tokens: the mixed batches below run out of blocks and preempt.
OPTIONS = EngineOptions(
    max_batch=4, block_size=5, num_blocks=12, max_model_len=40, prefill_buckets=(4, 8), batch_buckets=(4,)
)


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig.preset("tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=136, num_layers=2)
    return _randomize(Llama(config, rngs=nnx.Rngs(0), eos_token_ids=(3,)), seed=0)


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, OPTIONS) as engine:
        yield engine


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _tokens(events):
    assert events[-1].finished and events[-1].error is None, events[-1]
    return [t for e in events for t in e.token_ids]


def _references(model, prompts, n):
    """generate's greedy continuations of each prompt (one call, left padded: each row decodes as it would alone)."""
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = True
    return np.asarray(generate(model, ids, n, pad_mask=mask))[:, width:].tolist()


def test_greedy_requests_equal_generate_in_a_mixed_batch(model, engine, rng):
    # Prompts of 1..19 tokens (beyond the largest prefill bucket: chunked), six requests for four rows, two of
    # them sampling, and more arriving while the first decode.
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (3, 19, 1, 9, 12, 6)]
    counts = [9, 6, 12, 5, 8, 7]
    params = [_greedy(n) for n in counts]
    params[1] = SamplingParams(max_tokens=6, temperature=1.5, top_k=20, seed=1, ignore_eos=True)
    params[4] = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.8, seed=2, ignore_eos=True)
    events = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def sink(i):
        def on_event(event):
            events[i].append(event)
            if event.finished:
                done[i].set()

        return on_event

    first_token = threading.Event()
    engine.submit(prompts[0], params[0], lambda e: (sink(0)(e), first_token.set()))
    engine.submit(prompts[1], params[1], sink(1))
    first_token.wait(timeout=120)
    for i in range(2, len(prompts)):
        engine.submit(prompts[i], params[i], sink(i))
    for flag in done:
        assert flag.wait(timeout=300)
    want = _references(model, prompts, max(counts))
    for i, n in enumerate(counts):
        got = _tokens(events[i])
        assert len(got) == n and events[i][-1].finish_reason == "length"
        if params[i].temperature == 0:
            assert got == want[i][:n], i
    # Seeded sampling depends on the seed only: the same request alone draws the same tokens.
    again = engine.generate([prompts[1], prompts[4]], [params[1], params[4]])
    assert _tokens(again[0]) == _tokens(events[1]) and _tokens(again[1]) == _tokens(events[4])


def test_preemption_when_blocks_run_out_keeps_greedy_tokens(model, engine, rng):
    # Four rows growing to 26..28 tokens need 24 blocks of the 12: the newest rows are preempted and recomputed.
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (8, 5, 10, 7)]
    preemptions = engine.stats()["preemptions"]
    results = engine.generate(prompts, _greedy(18))
    stats = engine.stats()
    assert stats["preemptions"] > preemptions and stats["free_blocks"] == 12 and stats["running"] == 0
    for events, want in zip(results, _references(model, prompts, 18)):
        assert _tokens(events) == want


def _biased_llama():
    """A Llama with attention biases, which the decode-step kernels do not take (models.decode.unsupported_reason)."""
    config = LlamaConfig.preset(
        "tiny", vocab_size=VOCAB, hidden_size=64, intermediate_size=136, num_layers=2, attention_bias=True
    )
    return _randomize(Llama(config, rngs=nnx.Rngs(1)), seed=1)


@pytest.mark.parametrize("name", ["llama", "gemma", "biased llama"])
def test_each_decode_step_is_one_kernel_launch_on_the_emulator(name, rng):
    """Three requests of different lengths decode together on the emulator, each row at its own position (one
    prompt chunked, rows crossing 5-slot blocks, the Gemma 3's 4-token sliding window shorter than every row): each
    decode step is exactly one decode_step_kernel launch (a prefill chunk runs the model's own dense layers: no
    kernel), or none for a model the kernels do not cover, and the greedy tokens equal generate's."""
    model = _biased_llama() if name == "biased llama" else _model(name, jnp.float32)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (3, 11, 6)]
    counts = [7, 4, 9]
    options = EngineOptions(
        max_batch=4, block_size=5, num_blocks=16, max_model_len=40, prefill_buckets=(8,), batch_buckets=(4,)
    )
    with jax_neuronmm.use_backend("emulator"), jax_neuronmm.profile() as prof:
        records = []
        with Engine(model, options, on_step=records.append) as engine:  # started under the emulator: so is its thread
            results = engine.generate(prompts, [_greedy(n) for n in counts])
            stats = engine.stats()
    decode_steps = sum(r.kind == "decode" for r in records)
    assert stats["preemptions"] == 0 and stats["steps"] == len(records) and decode_steps >= max(counts) - 1
    # prefill_ahead's default follows the decode steps: the kernel's where it runs them, none on XLA (test below)
    kernel = name != "biased llama"
    assert engine._prefill_ahead == (engine_module.KERNEL_PREFILL_AHEAD if kernel else 0)
    launches = 0 if name == "biased llama" else decode_steps
    assert [run.name for run in prof.runs] == ["decode_step_kernel"] * launches
    for events, want, n in zip(results, _references(model, prompts, max(counts)), counts):
        assert _tokens(events) == want[:n]


def test_stops_cancel_and_limits(model, engine, rng):
    prompt = rng.integers(0, VOCAB, size=6).tolist()
    free = engine.stats()["free_blocks"]
    full = _tokens(engine.generate([prompt], _greedy(12))[0])
    stop_id = full[4]
    (stopped,) = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_id,)))
    assert _tokens(stopped) == full[: full.index(stop_id) + 1] and stopped[-1].finish_reason == "stop"
    # Cancel after the first token: a final "abort" event and every block back on the free list.
    events, finished = [], threading.Event()

    def on_event(event):
        events.append(event)
        if len(events) == 1:
            engine.cancel(event.request_id)
        if event.finished:
            finished.set()

    engine.submit(prompt, _greedy(30), on_event)
    assert finished.wait(timeout=120)
    assert events[-1].finish_reason == "abort" and len(events) < 30
    assert engine.stats()["free_blocks"] == free
    with pytest.raises(ContextExceeded, match="context of 40"):
        engine.submit(prompt, _greedy(35), on_event)
    with pytest.raises(ValueError, match="prompt"):
        engine.submit([], _greedy(3), on_event)
    with pytest.raises(ValueError, match="prompt"):
        engine.submit([VOCAB], _greedy(3), on_event)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(TypeError, match="max_tokens"):
        SamplingParams(max_tokens=2.5)


def test_end_of_sequence_stops_unless_ignored(model, engine, rng):
    for _ in range(20):  # a prompt whose greedy continuation meets the model's eos (id 3)
        prompt = rng.integers(0, VOCAB, size=4).tolist()
        full = _tokens(engine.generate([prompt], _greedy(30))[0])
        if 3 in full:
            break
    else:
        pytest.skip("no continuation reached the end-of-sequence id")
    (events,) = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))
    assert _tokens(events) == full[: full.index(3) + 1] and events[-1].finish_reason == "stop"


def test_step_records_replay_the_schedule(model, rng):
    # Four requests for two rows (prompts chunked past the 8-token bucket): the records account for every prompt token
    # (all but the last in prefill chunks, the last in the row's first decode step) and every output, requests waiting
    # to prefill share a step, and each decode row reads exactly the blocks that hold its tokens.
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (3, 13, 9, 6)]
    counts = [6, 3, 8, 5]
    options = EngineOptions(max_batch=2, block_size=5, max_model_len=40, prefill_buckets=(4, 8))
    records = []
    with Engine(model, options, on_step=records.append) as engine:
        results = engine.generate(prompts, [_greedy(n) for n in counts])
    assert all(isinstance(r, StepRecord) for r in records)
    prefills = [r for r in records if r.kind == "prefill"]
    decodes = [r for r in records if r.kind == "decode"]
    assert sum(sum(r.counts) for r in prefills) == sum(len(p) - 1 for p in prompts)
    assert all(r.rows in (1, 2) and r.tokens in (4, 8) and max(r.counts) <= r.tokens for r in prefills)
    # The first two requests arrive together: their prompts share one prefill step (one pass over the weights).
    assert len(prefills[0].counts) == 2 and prefills[0].rows == 2
    for r in prefills:
        assert len(r.counts) == len(r.lengths) <= r.rows and min(r.counts) >= 1
    assert sum(len(r.lengths) for r in decodes) == sum(counts)  # a prefill samples nothing, a decode row its next
    assert max(len(r.lengths) for r in decodes) == 2
    for r in decodes:
        assert r.tokens == 1 and r.rows in (1, 2) and len(r.lengths) <= r.rows and r.counts == (1,) * len(r.lengths)
        for length, blocks in zip(r.lengths, r.blocks):
            assert len(blocks) == -(-(length + 1) // 5) <= r.table_width and len(set(blocks)) == len(blocks)
    for events, n in zip(results, counts):
        assert len(_tokens(events)) == n
    with pytest.raises(TypeError, match="on_step"):
        Engine(model, options, on_step=[])


def test_prefill_ahead_shares_prefill_steps_and_never_widens_the_decode_batch(model, rng):
    # Seven requests for three rows, finishing at different steps: admitted ahead, prompts are prefilled several to a
    # step only when a row would go empty (fewer prefill steps than one per freed row), decode steps still hold at
    # most three rows, every prompt token is prefilled once, and greedy tokens equal generate's either way.
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 9, 3, 7, 11, 4, 6)]
    counts = [3, 7, 4, 9, 2, 6, 5]
    want = _references(model, prompts, max(counts))
    schedules = {}
    for ahead in (0, 2):
        options = EngineOptions(
            max_batch=3, block_size=5, max_model_len=40, prefill_buckets=(8, 16), prefill_ahead=ahead
        )
        records = []
        with Engine(model, options, on_step=records.append) as engine:
            results = engine.generate(prompts, [_greedy(n) for n in counts])
        for events, n, w in zip(results, counts, want):
            assert _tokens(events) == w[:n]
        decodes = [r for r in records if r.kind == "decode"]
        assert max(len(r.lengths) for r in decodes) == 3 and sum(len(r.lengths) for r in decodes) == sum(counts)
        prefills = [r for r in records if r.kind == "prefill"]
        assert sum(sum(r.counts) for r in prefills) == sum(len(p) - 1 for p in prompts)
        schedules[ahead] = records
    prefills = {ahead: [r for r in records if r.kind == "prefill"] for ahead, records in schedules.items()}
    assert len(prefills[2]) < len(prefills[0]) and max(len(r.counts) for r in prefills[2][1:]) == 3
    with pytest.raises(ValueError, match="prefill_ahead"):
        EngineOptions(prefill_ahead=-1)
    with Engine(model, dataclasses.replace(options, prefill_ahead=None)) as engine:  # XLA: none by default
        engine.generate(prompts[:1], _greedy(1))
        assert engine._prefill_ahead == 0


def test_steps_read_the_blocks_their_rows_need_not_the_whole_context(model, rng):
    # A 400-token context (80 blocks of 5) served to short rows: a step's table is the power of two at or above
    # its longest row's blocks (at least MIN_TABLE_TOKENS' worth), never all 80 columns, and greedy tokens still
    # equal generate's when the rows cross into a wider table.
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (7, 2, 11)]
    options = EngineOptions(max_batch=4, block_size=5, max_model_len=400, prefill_buckets=(4, 8))
    records = []
    with Engine(model, options, on_step=records.append) as engine:
        results = engine.generate(prompts, _greedy(80))
    floor = -(-engine_module.MIN_TABLE_TOKENS // 5)
    for r in records:
        need = max(len(b) for b in r.blocks)
        assert r.table_width == max(1 << (need - 1).bit_length(), 1 << (floor - 1).bit_length()), r
        assert r.table_width < 80
    assert {r.table_width for r in records} == {16, 32}  # rows reach 91 tokens = 19 blocks
    for events, want in zip(results, _references(model, prompts, 80)):
        assert _tokens(events) == want


def test_full_queue_raises(model):
    with Engine(model, EngineOptions(max_batch=1, max_model_len=40, max_waiting=0)) as engine:
        with pytest.raises(QueueFull):
            engine.submit([1, 2], _greedy(2), lambda e: None)


def _byte_tokenizer():
    """One token per byte (byte-level, no merges): every multi-byte character spans several tokens."""
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token=None))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return tokenizer


def test_detokenizer_never_breaks_a_character_and_honours_stop_strings():
    tokenizer = _byte_tokenizer()
    text = "naïve café → 你好, ok ✓ done"
    ids = tokenizer.encode(text).ids
    assert len(ids) > len(text)  # multi-byte characters really are split
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.add(i) for i in ids] + [detokenizer.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > 10  # streamed, not all at the end
    stopping = Detokenizer(tokenizer, stop=("你好", "zzz"))
    out = ""
    for i in ids:
        out += stopping.add(i)
        if stopping.stopped:
            break
    assert stopping.stopped and out == "naïve café → "
