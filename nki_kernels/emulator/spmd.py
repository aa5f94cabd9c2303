"""Several NeuronCores on the emulator: one kernel run on N ranks that exchange data through `nki.collectives`.

    outs = simulate_spmd(kernel, num_ranks=4)((x0, w0), (x1, w1), (x2, w2), (x3, w3))
    outs[r]  # what rank r's launch returned

Each rank runs on its own thread with its own KernelContext (its own SBUF, PSUM and HBM); the k-th collective call
of every rank meets the k-th of every other. Mismatched calls raise NkiCollectiveError and a call no other rank can
meet raises NkiDeadlockError, each naming file:line, so nothing waits forever. docs/emulator.md ("Several ranks:
rendezvous") gives the full rules.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import sys
import threading
import time

from . import context, trace
from . import kernel as _kernel
from .errors import NkiCollectiveError, NkiDeadlockError

# Seconds a rank waits in one collective for the others before the launch is reported as deadlocked.
DEFAULT_TIMEOUT_S = 60.0
# Seconds the launching thread still waits for ranks after one of them failed (a rank busy outside any
# collective only notices at its next collective call).
_ABORT_GRACE_S = 2.0


@dataclasses.dataclass
class Call:
    """One rank's arrival at a collective: what must match across ranks (`key`), its line and its data."""

    opcode: str
    line: str
    key: tuple
    payload: object = None


class _Aborted(Exception):
    """Raised in a rank whose launch another rank already failed (the launch raises that failure)."""


class _Step:
    __slots__ = ("calls", "arrived", "read")

    def __init__(self, num_ranks):
        self.calls = [None] * num_ranks
        self.arrived = 0
        self.read = 0


class World:
    """The ranks of one launch and their rendezvous. A World of one rank exchanges with itself, no waiting."""

    def __init__(self, num_ranks, timeout_s=DEFAULT_TIMEOUT_S, name="kernel"):
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s
        self.name = name
        self._cond = threading.Condition()
        self._steps: dict[int, _Step] = {}
        self._calls = [0] * num_ranks  # collectives each rank has entered
        self._waiting: list[Call | None] = [None] * num_ranks
        self._returned: list[str | None] = [None] * num_ranks  # file:line of a rank's return from the kernel
        self._threads: list[threading.Thread | None] = [None] * num_ranks
        self.failure: BaseException | None = None  # the first failure; every rank stops at its next collective
        self.failed_rank: int | None = None

    # -- rank lifecycle (called by run_spmd's rank threads) ----------------------------------------------------
    def fail(self, rank, exc):
        with self._cond:
            if self.failure is None:
                self.failure, self.failed_rank = exc, rank
            self._cond.notify_all()

    def returned(self, rank, body_frame):
        """Rank `rank` returned from the kernel; body_frame: its last program's kernel-body frame (None when the
        body made no NKI call), whose f_lineno is now the line of the return."""
        with self._cond:
            self._returned[rank] = context.frame_line(body_frame) if body_frame is not None else "<unknown>"
            self._cond.notify_all()

    # -- the rendezvous -------------------------------------------------------------------------------------------
    def exchange(self, rank, call):
        """Every rank's Call of this step (a list indexed by rank), once all ranks have arrived; see the module
        docstring for the errors."""
        if self.num_ranks == 1:
            return [call]
        with self._cond:
            if self.failure is not None:
                raise _Aborted()
            step = self._calls[rank]
            self._calls[rank] += 1
            slot = self._steps.setdefault(step, _Step(self.num_ranks))
            slot.calls[rank] = call
            slot.arrived += 1
            self._waiting[rank] = call
            self._cond.notify_all()
            deadline = time.monotonic() + self.timeout_s
            while slot.arrived < self.num_ranks:
                if self.failure is not None:
                    raise _Aborted()
                gone = [r for r in range(self.num_ranks) if self._returned[r] is not None and self._calls[r] <= step]
                remaining = deadline - time.monotonic()
                if gone or remaining <= 0:
                    missing = [r for r in range(self.num_ranks) if slot.calls[r] is None]
                    error = NkiDeadlockError(self._deadlock_message(rank, step, call, missing, timed_out=not gone))
                    if self.failure is None:
                        self.failure, self.failed_rank = error, rank
                    self._cond.notify_all()
                    raise error
                self._cond.wait(min(remaining, 0.25))
            self._waiting[rank] = None
            slot.read += 1
            if slot.read == self.num_ranks:
                del self._steps[step]
            calls = list(slot.calls)
        _check_same_collective(step, calls)
        return calls

    def _position(self, rank):
        """Where `rank` is now: its collective, its return line, or the kernel line its thread is executing."""
        if self._waiting[rank] is not None:
            call = self._waiting[rank]
            return f"waits in {call.opcode} at {call.line} (its collective #{self._calls[rank]})"
        if self._returned[rank] is not None:
            return f"returned from the kernel at {self._returned[rank]} after {self._calls[rank]} collective(s)"
        thread = self._threads[rank]
        frame = sys._current_frames().get(thread.ident) if thread is not None else None
        line = context.kernel_line(frame) if frame is not None else "<unknown>"
        return f"is running at {line} after {self._calls[rank]} collective(s)"

    def _deadlock_message(self, rank, step, call, missing, timed_out):
        why = (
            f"still missing after {self.timeout_s:g} s (timeout_s of simulate_spmd)"
            if timed_out
            else "can never arrive"
        )
        lines = [
            f"deadlock in kernel {self.name} on {self.num_ranks} ranks: rank {rank} waits in {call.opcode} at "
            f"{call.line} (collective #{step + 1}), which rank(s) {missing} {why}:"
        ]
        lines += [f"  rank {r} {self._position(r)}" for r in range(self.num_ranks) if r != rank]
        return "\n".join(lines)


def _check_same_collective(step, calls):
    """NkiCollectiveError unless every rank's call of this step is the same collective (same key)."""
    if all(c.key == calls[0].key for c in calls):
        return
    described = "\n".join(f"  rank {r}: {c.opcode} at {c.line} ({_describe_key(c.key)})" for r, c in enumerate(calls))
    raise NkiCollectiveError(
        f"ranks reached different collectives at their collective #{step + 1} (every rank must issue the same "
        f"collectives in the same order):\n{described}"
    )


def _describe_key(key):
    return ", ".join(f"{name}={value}" for name, value in key[1:])


def rank_and_world(what):
    """(rank, World) of the kernel being simulated; a plain launch is rank 0 of a World of one."""
    ctx = context.current(what)
    if ctx.world is None:
        ctx.world = World(1, name=ctx.run.name)
    return ctx.rank, ctx.world


def _check_num_ranks(num_ranks):
    try:
        n = operator.index(num_ranks)
    except TypeError:
        raise TypeError(f"num_ranks: expected an int, got {num_ranks!r}") from None
    if n < 1:
        raise ValueError(f"num_ranks: expected at least 1 rank, got {n}")
    return n


def simulate_spmd(kernel, num_ranks, timeout_s=DEFAULT_TIMEOUT_S):
    """Run kernel (jit-decorated or plain) on `num_ranks` emulated NeuronCores; see the module docstring.

    The returned function takes one tuple of positional arguments per rank (numpy arrays are copied into that
    rank's HBM) and keyword arguments shared by every rank; it returns the list of each rank's outputs.
    timeout_s: seconds a rank waits in one collective before the launch is reported deadlocked.
    """
    if not isinstance(kernel, _kernel.Kernel):
        kernel = _kernel.Kernel(kernel)
    num_ranks = _check_num_ranks(num_ranks)
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")

    @functools.wraps(kernel.fn)
    def simulated(*per_rank_args, **kwargs):
        if len(per_rank_args) != num_ranks:
            raise TypeError(
                f"simulate_spmd({kernel.fn.__qualname__}, num_ranks={num_ranks}): expected one tuple of arguments "
                f"per rank ({num_ranks}), got {len(per_rank_args)}"
            )
        for r, args in enumerate(per_rank_args):
            if not isinstance(args, (tuple, list)):
                raise TypeError(
                    f"simulate_spmd: the arguments of rank {r} must be a tuple (one entry per kernel argument), "
                    f"got {type(args).__name__}"
                )
        return run_spmd(kernel, [tuple(a) for a in per_rank_args], kwargs, timeout_s)

    return simulated


def run_spmd(kernel, per_rank_args, kwargs, timeout_s=DEFAULT_TIMEOUT_S):
    """Run kernel on len(per_rank_args) ranks, one thread each; the list of each rank's outputs."""
    num_ranks = len(per_rank_args)
    numerics = context.numerics_enabled()
    target = context.resolve_target()
    world = World(num_ranks, timeout_s, kernel.fn.__qualname__)
    contexts = [_kernel.new_context(kernel, numerics, target, rank, world) for rank in range(num_ranks)]
    outputs: list = [None] * num_ranks

    def rank_main(rank):
        try:
            outputs[rank] = _kernel.run_in_context(kernel, contexts[rank], per_rank_args[rank], kwargs)
            world.returned(rank, contexts[rank].body_frame)
        except _Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 -- handed to the launching thread, which raises it
            world.fail(rank, exc)

    with _kernel.launching(numerics):
        threads = [
            threading.Thread(target=rank_main, args=(r,), name=f"nki-rank-{r}", daemon=True) for r in range(num_ranks)
        ]
        world._threads = threads
        for thread in threads:
            thread.start()
        failed_at = None
        while any(t.is_alive() for t in threads):
            for thread in threads:
                thread.join(0.05)
            if world.failure is not None:
                failed_at = failed_at or time.monotonic()
                if time.monotonic() - failed_at > _ABORT_GRACE_S:
                    break  # a rank busy outside any collective; it stops at its next one
        if world.failure is not None:
            failure = world.failure
            if not isinstance(failure, (NkiDeadlockError, NkiCollectiveError)) and num_ranks > 1:
                failure.add_note(f"(raised on rank {world.failed_rank} of {num_ranks} under simulate_spmd)")
            raise failure
        for ctx in contexts:
            trace.kernel_finished(ctx.run)
    return outputs


__all__ = ["DEFAULT_TIMEOUT_S", "World", "rank_and_world", "run_spmd", "simulate_spmd"]
