"""The serving engine: continuous batching of requests over a paged KV cache, scheduled on the host.

A background thread loops: apply cancellations, admit waiting requests (FIFO) while rows (and
`EngineOptions.prefill_ahead` more) and blocks allow, run one prefill step, when a row would otherwise go empty,
for every admitted request whose prompt (all but its last token) is not yet cached (each row its next
chunk, padded to a length bucket, a long prompt in chunks of the largest bucket; `models.paged.paged_prefill`: no
logits, so the step does not read the LM head), then one decode step for every decoding row, which feeds each row
its one uncached token (a new row's last prompt token, the others' last output) and samples its next: one jitted
call for the whole batch, each row at its own position: on the emulator and Trainium, for a
model `models.decode` covers, one `decode_step` over the same pools (`models.paged.paged_decode_step`, the weights
stacked once per engine: one looped kernel launch, K/V read through each row's block table); on XLA, and for other
models, the model's own layers (`paged_step`). The scheduler thread runs under the kernel backend in effect where
`start()` was called (JAX's config contexts are per thread). Rows are virtual: the batch of a step is its requests
padded to a batch bucket, so any request can sit in any row and a finished request's row is free at once. Blocks come
from a free list; when a decode step needs a block and none is free, the newest running request is preempted (its
blocks freed, it waits at the head of the queue and is recomputed from its prompt and the tokens it already
produced), so no other request is harmed. Each jitted shape compiles once per (batch bucket, tokens, table-width
bucket). An optional `on_step` hook sees each step's schedule (`StepRecord`), so a run's schedule can be replayed
elsewhere (benchmarks/serving.py prices it on the Trainium cost model).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_neuronmm.backend import effective_backend, get_backend, use_backend
from jax_neuronmm.models.decode import stack_weights
from jax_neuronmm.models.decoder import CausalLM
from jax_neuronmm.models.paged import (
    PagedBatch,
    PagedKVCache,
    RowSampling,
    paged_decode_step,
    paged_plan,
    paged_prefill,
    paged_step,
)
from jax_neuronmm.serving.detokenize import Detokenizer

SHUTDOWN = "the engine is shutting down"  # the error of requests a shutdown ends


class QueueFull(RuntimeError):
    """The engine's waiting queue is at its bound (`EngineOptions.max_waiting`)."""


class ContextExceeded(ValueError):
    """A request's prompt (plus the tokens it asks for) does not fit the context or the cache."""


class EngineStopped(RuntimeError):
    """The engine is not running (not started, or shut down)."""


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}), expected an integer")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}: got {value}, expected an integer in [{low}, {'inf' if high is None else high}]")
    return int(value)


def _check_float(name: str, value, low: float, high: float, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: got {value!r} ({type(value).__name__}), expected a number")
    value = float(value)
    if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
        raise ValueError(f"{name}: got {value}, expected a number in {'(' if open_low else '['}{low}, {high}]")
    return value


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling: temperature 0 is greedy; top_k 0 and top_p 1 are off; seed None draws one; stop
    strings and stop_token_ids end the request (as does the model's end-of-sequence id unless ignore_eos)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        _check_int("max_tokens", self.max_tokens, 1)
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, open_low=True)
        _check_int("top_k", self.top_k, 0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**64 - 1)
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise TypeError(f"stop: got {self.stop!r}, expected a sequence of strings")
        for i in self.stop_token_ids:
            _check_int("stop_token_ids", i, 0)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """max_batch: rows decoded together. block_size / num_blocks: the KV pool (default: enough blocks for
    max_batch full-context rows). max_model_len: the context served (default the model's, else 2048).
    prefill_buckets: prompt-chunk lengths that compile (longer prompts go in chunks of the largest).
    batch_buckets: decode batch sizes that compile (default powers of two up to max_batch; the largest must be
    max_batch). max_waiting: queued requests beyond which `submit` raises QueueFull.
    prefill_ahead: requests admitted and prefilled beyond the max_batch decoding rows (they hold KV blocks, not
    rows). A prefill step runs only when a row would otherwise go empty, and then takes up to 1 + prefill_ahead
    waiting prompts, so the next rows to free start decoding without a step of their own: a prefill step reads
    every layer's weights whatever its rows hold, and on Trainium, where that read is most of a short prompt's
    cost, one read then serves several prompts. 0: a prompt is prefilled only when its row frees. None:
    KERNEL_PREFILL_AHEAD where decode steps run as the looped kernel (Trainium, the emulator), 0 on XLA, where a
    prefill step costs its padded tokens' compute, so prompts sharing one only add padding."""

    max_batch: int = 16
    block_size: int = 16
    num_blocks: int | None = None
    max_model_len: int | None = None
    prefill_buckets: tuple[int, ...] = (16, 32, 64, 128, 256)
    batch_buckets: tuple[int, ...] | None = None
    max_waiting: int = 256
    prefill_ahead: int | None = None

    def __post_init__(self):
        _check_int("max_batch", self.max_batch, 1)
        _check_int("block_size", self.block_size, 1)
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        if not self.prefill_buckets:
            raise ValueError("prefill_buckets: got an empty tuple, expected lengths >= 1")
        for bucket in self.prefill_buckets:
            _check_int("prefill_buckets", bucket, 1)
        if self.batch_buckets is not None:
            for size in self.batch_buckets:
                _check_int("batch_buckets", size, 1, self.max_batch)
            if max(self.batch_buckets) != self.max_batch:
                raise ValueError(f"batch_buckets: got {self.batch_buckets}, expected the largest to be max_batch")
        _check_int("max_waiting", self.max_waiting, 0)
        if self.prefill_ahead is not None:
            _check_int("prefill_ahead", self.prefill_ahead, 0)


@dataclasses.dataclass
class Event:
    """What a request produced since its last event: text (detokenized, whole characters only) and token_ids;
    the last event has finished True and finish_reason "stop", "length", "abort" (cancelled) or "error"."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One jitted step as the scheduler ran it. kind: "prefill" (a prompt chunk per active row, nothing sampled) or
    "decode" (one token per active row, each sampling its next); rows: the batch bucket computed (padding rows
    included); tokens: T per row; lengths: each active row's cached tokens before the step; counts: its real tokens in
    the step; blocks: its block ids, in table order; table_width: the block table's columns (blocks a row's attention
    reads)."""

    kind: str
    rows: int
    tokens: int
    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    table_width: int


@dataclasses.dataclass
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]
    order: int
    seeds: tuple[int, int]
    detokenizer: Detokenizer | None
    outputs: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # tokens of seq whose K/V are in the cache

    decoded: bool = False  # all of seq but its last token cached: decode steps feed it seq[cached]

    @property
    def seq(self) -> list[int]:
        return self.prompt + self.outputs


def _buckets(limit: int) -> list[int]:
    """Powers of two below limit, then limit itself."""
    sizes = [1 << i for i in range(max(limit, 1).bit_length()) if (1 << i) < limit]
    return sizes + [limit]


# EngineOptions.prefill_ahead's default where decode steps run as the looped kernel: the largest value that helped
# every configuration of the serving reports' modeled sweep.
KERNEL_PREFILL_AHEAD = 2

# Fewest cached tokens a block table covers: narrower tables would add compiled shapes for little saving.
MIN_TABLE_TOKENS = 64


def _table_widths(max_blocks: int, block_size: int) -> list[int]:
    """Block-table widths that compile: powers of two from MIN_TABLE_TOKENS' worth of blocks, then max_blocks. A
    step's cost grows with the blocks its rows read, so a step reads at most twice the blocks its longest row
    needs (or MIN_TABLE_TOKENS), not the whole context."""
    floor = min(-(-MIN_TABLE_TOKENS // block_size), max_blocks)
    widths = {max_blocks}
    width = 1 << (floor - 1).bit_length()
    while width < max_blocks:
        widths.add(width)
        width *= 2
    return sorted(widths)


def _bucket(value: int, sizes: Sequence[int]) -> int:
    return next(size for size in sizes if size >= value)


class Engine:
    """Continuous batching for `model` (a `models.CausalLM`, with its tokenizer for text): `submit` requests,
    receive `Event`s through their callback (called on the engine thread), `cancel` them. `start()` /
    `shutdown()` run the scheduler thread (the engine is also a context manager). on_step, when given, is called
    on the engine thread with each step's `StepRecord` after the step ran."""

    def __init__(
        self,
        model: CausalLM,
        options: EngineOptions | None = None,
        *,
        on_step: Callable[[StepRecord], None] | None = None,
    ):
        if not isinstance(model, CausalLM):
            raise TypeError(f"model: got {type(model).__name__}, expected a jax_neuronmm.models CausalLM")
        if on_step is not None and not callable(on_step):
            raise TypeError(f"on_step: got {type(on_step).__name__}, expected a callable taking a StepRecord")
        self.model = model
        self.options = options = options or EngineOptions()
        self._on_step = on_step
        known = model.config.max_position_embeddings
        self.max_model_len = options.max_model_len or known or 2048
        if known is not None and self.max_model_len > known:
            raise ValueError(f"max_model_len: got {self.max_model_len}, beyond the model's context of {known}")
        self.block_size = options.block_size
        self.max_blocks = -(-self.max_model_len // self.block_size)
        self.num_blocks = options.num_blocks or self.max_blocks * options.max_batch
        self.tokenizer = model.tokenizer
        self.eos_token_ids = frozenset(model.eos_token_ids)
        self._graphdef, self._state = nnx.split(model)
        self._cache = PagedKVCache.create(model, self.num_blocks, self.block_size)
        # Decode steps as one decode_step (None: models.decode does not cover the model; its own layers decode).
        self._plan = paged_plan(model, self.block_size)
        self._weights = None if self._plan is None else stack_weights(model, self._plan)
        self._backend = get_backend()  # start() takes its caller's
        self._batch_sizes = sorted(options.batch_buckets or _buckets(options.max_batch))
        self._table_widths = _table_widths(self.max_blocks, self.block_size)
        self._prefill_sizes = sorted(set(options.prefill_buckets))
        self._free = collections.deque(range(self.num_blocks))
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._inbox: list[_Request] = []
        self._cancels: collections.deque[str] = collections.deque()  # appended without the lock (see cancel)
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._prefill_ahead = 0  # options.prefill_ahead, resolved on the engine thread under its backend (_run)
        self._stop_reason = SHUTDOWN
        self._ids = itertools.count()
        self._stats = {
            "waiting": 0,
            "running": 0,
            "free_blocks": self.num_blocks,
            "preemptions": 0,
            "aborted": 0,
            "steps": 0,
        }

    # --- the API (any thread) ---------------------------------------------------------------------------------

    def start(self) -> Engine:
        with self._lock:
            if self._thread is None:
                self._stopping = False
                self._backend = get_backend()  # the caller's: use_backend is per thread
                self._thread = threading.Thread(target=self._run, name="jax_neuronmm-engine", daemon=True)
                self._thread.start()
        return self

    def stop_soon(self, reason: str = SHUTDOWN) -> None:
        """Asks the scheduler to stop after its current step without waiting (safe in a signal handler's path):
        every unfinished request then gets a final "error" event whose error is `reason`."""
        with self._lock:
            if not self._stopping:
                self._stopping, self._stop_reason = True, reason
            self._lock.notify_all()

    def shutdown(self, reason: str = SHUTDOWN) -> None:
        """Stops the scheduler and waits for it; unfinished requests end as `stop_soon` says."""
        self.stop_soon(reason)
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ids after checking it and params fit: ContextExceeded when the prompt plus
        max_tokens is beyond max_model_len, ValueError for an empty prompt or an id outside the vocabulary."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: got {type(params).__name__}, expected SamplingParams")
        prompt = [_check_int("prompt", i, 0, self.model.config.vocab_size - 1) for i in prompt_ids]
        if not prompt:
            raise ValueError("prompt: got no tokens, expected at least one")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ContextExceeded(
                f"prompt, max_tokens: {len(prompt)} prompt tokens + {params.max_tokens} new tokens exceed the context "
                f"of {self.max_model_len} tokens"
            )
        if self._blocks_for(len(prompt) + params.max_tokens) > self.num_blocks:
            raise ContextExceeded(
                f"prompt, max_tokens: {len(prompt) + params.max_tokens} tokens exceed the KV cache's "
                f"{self.num_blocks * self.block_size} slots"
            )
        return prompt

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, on_event: Callable[[Event], None]) -> str:
        """Queues a request; returns its id. Raises as `check_request` does, QueueFull when max_waiting requests
        already wait, EngineStopped when the engine is not running."""
        prompt = self.check_request(prompt_ids, params)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        seed %= 2**64
        request_id = f"req-{next(self._ids)}"
        detokenizer = None if self.tokenizer is None else Detokenizer(self.tokenizer, prompt, params.stop)
        with self._lock:
            if self._thread is None or self._stopping:
                raise EngineStopped("the engine is not running")
            if self._stats["waiting"] + len(self._inbox) >= self.options.max_waiting:
                raise QueueFull(f"{self.options.max_waiting} requests are already waiting")
            order = next(self._ids)
            request = _Request(
                request_id, prompt, params, on_event, order, (seed & 0xFFFFFFFF, seed >> 32), detokenizer
            )
            self._inbox.append(request)
            self._lock.notify_all()
        return request_id

    def cancel(self, request_id: str) -> None:
        """Ends the request before the next step: its row and blocks are freed; it gets a final "abort" event.
        Never blocks (a server's event loop calls it): the id goes on a deque that the scheduler drains before
        every step; an id that is not running or waiting is ignored."""
        self._cancels.append(request_id)
        if self._lock.acquire(blocking=False):  # wake an idle scheduler; a busy one drains the deque anyway
            self._lock.notify_all()
            self._lock.release()

    def stats(self) -> dict:
        """waiting / running requests, free_blocks, and the preemptions, aborted (cancelled) requests and steps so
        far (as of the last step)."""
        with self._lock:
            return dict(self._stats)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]):
        """Submits every prompt at once and waits; returns each request's list of events (for scripts and tests)."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        done = [threading.Event() for _ in prompts]
        events: list[list[Event]] = [[] for _ in prompts]

        def collect(i):
            def on_event(event):
                events[i].append(event)
                if event.finished:
                    done[i].set()

            return on_event

        for i, (prompt, p) in enumerate(zip(prompts, params)):
            self.submit(prompt, p, collect(i))
        for flag in done:
            flag.wait()
        return events

    # --- the scheduler thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        with use_backend(self._backend):
            ahead = self.options.prefill_ahead
            if ahead is None:
                ahead = KERNEL_PREFILL_AHEAD if self._decodes_through_kernels() else 0
            self._prefill_ahead = ahead
            self._loop()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._cancels or self._waiting or self._running):
                    self._lock.wait()
                if self._stopping:
                    break
                self._waiting.extend(self._inbox)
                self._inbox.clear()
                cancels = set()
                while self._cancels:
                    cancels.add(self._cancels.popleft())
            try:
                self._cancel(cancels)
                self._admit()
                self._prefill()
                self._decode()
            except Exception as error:  # a failed step must not hang its requests or stop the engine
                for request in self._running + list(self._waiting):
                    self._finish(request, "error", error=f"{type(error).__name__}: {error}")
                self._waiting.clear()
            self._publish()
        for request in self._running + list(self._waiting) + self._inbox:
            self._finish(request, "error", error=self._stop_reason)
        self._waiting.clear()
        self._inbox.clear()
        self._publish()

    def _publish(self) -> None:
        with self._lock:
            self._stats.update(waiting=len(self._waiting), running=len(self._running), free_blocks=len(self._free))

    def _emit(self, request: _Request, text: str, ids: list[int], **final) -> None:
        event = Event(request.id, text, ids, len(request.prompt), len(request.outputs), **final)
        try:
            request.on_event(event)
        except Exception:  # noqa: BLE001 - a consumer's failure (a closed connection) must not stop the engine
            pass

    def _finish(self, request: _Request, reason: str, *, error: str | None = None, text: str = "", ids=()) -> None:
        if request in self._running:
            self._running.remove(request)
        self._free.extend(request.blocks)
        request.blocks = []
        if request.detokenizer is not None and reason in ("stop", "length"):
            text += request.detokenizer.flush()
        self._publish()  # whoever sees the final event sees the freed row and blocks in stats()
        self._emit(request, text, list(ids), finished=True, finish_reason=reason, error=error)

    def _cancel(self, cancels: set[str]) -> None:
        if not cancels:
            return
        for request in [r for r in self._running if r.id in cancels]:
            self._stats["aborted"] += 1
            self._finish(request, "abort")
        for request in [r for r in self._waiting if r.id in cancels]:
            self._stats["aborted"] += 1
            self._waiting.remove(request)
            self._publish()
            self._emit(request, "", [], finished=True, finish_reason="abort")

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.options.max_batch + self._prefill_ahead:
            request = self._waiting[0]
            if len(self._free) < self._blocks_for(len(request.seq) + 1):
                if self._running:
                    return  # wait for blocks; FIFO, so nothing overtakes it
                self._waiting.popleft()
                self._finish(request, "error", error="the KV cache cannot hold this request (num_blocks too small)")
                continue
            self._waiting.popleft()
            request.cached, request.decoded = 0, False
            self._running.append(request)

    def _grow(self, request: _Request, tokens: int) -> bool:
        """Gives request blocks for `tokens` cached tokens, preempting the newest other requests when the free
        list is empty; False when request itself was preempted."""
        while len(request.blocks) < self._blocks_for(tokens):
            if not self._free:
                victim = max(self._running, key=lambda r: r.order)
                self._preempt(victim)
                if victim is request:
                    return False
                continue
            request.blocks.append(self._free.popleft())
        return True

    def _preempt(self, request: _Request) -> None:
        self._running.remove(request)
        self._free.extend(request.blocks)
        request.blocks, request.cached, request.decoded = [], 0, False
        self._waiting.appendleft(request)
        self._stats["preemptions"] += 1

    def _table(self, requests: Sequence[_Request], rows: int, need_blocks: int) -> np.ndarray:
        width = _bucket(max(need_blocks, 1), self._table_widths)
        table = np.zeros((rows, width), np.int32)
        for row, request in enumerate(requests):
            table[row, : len(request.blocks)] = request.blocks[:width]
        return table

    def _sampling(self, requests: Sequence[_Request], rows: int) -> RowSampling:
        temperature = np.zeros(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        top_p = np.ones(rows, np.float32)
        seeds = np.zeros((rows, 2), np.uint32)
        steps = np.zeros(rows, np.int32)
        for row, request in enumerate(requests):
            p = request.params
            temperature[row], top_k[row], top_p[row] = p.temperature, p.top_k, p.top_p
            seeds[row] = request.seeds
            steps[row] = len(request.outputs)
        return RowSampling(*(jnp.asarray(a) for a in (temperature, top_k, top_p, seeds, steps)))

    def _decodes_through_kernels(self) -> bool:
        """Decode steps take `paged_decode_step` where kernels run it (the emulator, Trainium) and the model covers
        it; on the XLA backend the model's own layers are faster (decode_step's scan over stacked layers carries the
        pools through every layer)."""
        return self._plan is not None and effective_backend(jax.devices()[0].platform) != "xla"

    def _step(self, tokens: np.ndarray, requests, lengths, counts, need_blocks) -> np.ndarray | None:
        """One jitted step: a prefill chunk per row (counts given) through `paged_prefill`, returning None; a decode
        step (counts None: one token per row) through `paged_decode_step` where `_decodes_through_kernels`, else
        through `paged_step`, returning the next tokens [rows]."""
        rows = tokens.shape[0]
        table = self._table(requests, rows, need_blocks)
        record = None
        if self._on_step is not None:
            active = len(requests)
            record = StepRecord(
                "decode" if counts is None else "prefill",
                rows,
                tokens.shape[1],
                tuple(int(n) for n in lengths[:active]),
                (1,) * active if counts is None else tuple(int(n) for n in counts[:active]),
                tuple(tuple(r.blocks[: table.shape[1]]) for r in requests),
                table.shape[1],
            )
        table = jnp.asarray(table)
        lengths = jnp.asarray(lengths, jnp.int32)
        tokens = jnp.asarray(tokens)
        next_tokens = None
        if counts is not None:
            batch = PagedBatch(table, lengths, jnp.asarray(counts, jnp.int32))
            self._cache = paged_prefill(self._graphdef, self._state, tokens, self._cache, batch)
        elif self._decodes_through_kernels():
            next_tokens, self._cache = paged_decode_step(
                self._graphdef,
                self._state,
                self._weights,
                tokens,
                self._cache,
                table,
                lengths,
                self._sampling(requests, rows),
                plan=self._plan,
            )
        else:
            batch = PagedBatch(table, lengths, (lengths >= 0).astype(jnp.int32))
            sampling = self._sampling(requests, rows)
            next_tokens, self._cache = paged_step(self._graphdef, self._state, tokens, self._cache, batch, sampling)
        self._stats["steps"] += 1
        if next_tokens is not None:
            next_tokens = np.asarray(jax.device_get(next_tokens))
        if record is not None:
            self._on_step(record)
        return next_tokens

    def _prefill(self) -> None:
        """One prefill step for every admitted request whose sequence, all but its last token, is not cached (each
        row its next chunk of at most the largest bucket, padded to the bucket of the longest): one pass over the
        weights for all of them, as when several rows free in the same step. The last token is left to the row's
        first decode step, which samples from it: the prefill step computes no logits. Only when a row would go
        empty (fewer prefilled requests than max_batch); then for those rows, or, with requests admitted ahead,
        as many as fill the largest batch bucket they reach."""
        empty = self.options.max_batch - sum(r.decoded for r in self._running)
        if empty <= 0:
            return  # every row decodes: requests admitted ahead wait for a row to free
        unprefilled = [r for r in self._running if not r.decoded]
        # The rows that would go empty, and beyond them as many as fill a batch bucket: a padding row computes a
        # whole chunk for nothing.
        fill = max([size for size in self._batch_sizes if size <= len(unprefilled)], default=1)
        largest = self._prefill_sizes[-1]
        chunks = []
        for request in unprefilled[: max(min(empty, len(unprefilled)), fill)]:
            count = min(len(request.seq) - 1 - request.cached, largest)
            if count == 0:
                request.decoded = True  # a one-token prompt: nothing to prefill
            elif request in self._running and self._grow(request, request.cached + count):
                chunks.append((request, count))
        chunks = [(r, n) for r, n in chunks if r in self._running]  # a later _grow may have preempted an earlier one
        if not chunks:
            return
        rows = _bucket(len(chunks), self._batch_sizes)
        tokens = np.zeros((rows, _bucket(max(n for _, n in chunks), self._prefill_sizes)), np.int32)
        lengths = np.full(rows, -1, np.int32)
        counts = np.zeros(rows, np.int32)
        for row, (request, count) in enumerate(chunks):
            tokens[row, :count] = request.seq[request.cached : request.cached + count]
            lengths[row], counts[row] = request.cached, count
        requests = [r for r, _ in chunks]
        self._step(tokens, requests, lengths, counts, max(len(r.blocks) for r in requests))
        for request, count in chunks:
            request.cached += count
            request.decoded = request.cached == len(request.seq) - 1

    def _rows(self) -> list[_Request]:
        """The requests of the next decode step: the first max_batch prefilled ones, in admission order."""
        return [r for r in self._running if r.decoded][: self.options.max_batch]

    def _decode(self) -> None:
        grown = set()
        while pending := [r for r in self._rows() if r.id not in grown]:
            for request in pending:  # a preempted row lets a request admitted ahead in: it grows next round
                grown.add(request.id)
                if request in self._running:  # an earlier _grow may have preempted it
                    self._grow(request, request.cached + 1)
        requests = self._rows()
        if not requests:
            return
        rows = _bucket(len(requests), self._batch_sizes)
        tokens = np.zeros((rows, 1), np.int32)
        lengths = np.full(rows, -1, np.int32)
        for row, request in enumerate(requests):
            tokens[row, 0], lengths[row] = request.seq[request.cached], request.cached
        need = max(len(r.blocks) for r in requests)
        next_tokens = self._step(tokens, requests, lengths, None, need)
        for row, request in enumerate(requests):
            request.cached += 1
            self._accept(request, int(next_tokens[row]))

    def _accept(self, request: _Request, token: int) -> None:
        """Appends a sampled token, streams its text, and finishes the request when it should stop."""
        request.outputs.append(token)
        p = request.params
        stop_id = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        text = ""
        if request.detokenizer is not None and not stop_id:
            text = request.detokenizer.add(token)
        if stop_id or (request.detokenizer is not None and request.detokenizer.stopped):
            self._finish(request, "stop", text=text, ids=[token])
        elif len(request.outputs) >= p.max_tokens or len(request.seq) >= self.max_model_len:
            self._finish(request, "length", text=text, ids=[token])
        else:
            self._emit(request, text, [token])
