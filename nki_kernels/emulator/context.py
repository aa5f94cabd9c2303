"""State of the kernel being simulated: target, numerics on/off, live on-chip memory, trace records.

Liveness rule (what the SBUF/PSUM capacity checks count): an on-chip tensor is live from the moment
`nl.ndarray` (or any call that creates a tile) allocates it until the last Python reference to it or
to one of its views is dropped, or the kernel (one SPMD program) returns. Capacity is checked when an
instruction executes, not at allocation, so a tile rebound to a fresh allocation in a loop
(`t = nl.ndarray(...)`) does not count twice. SBUF use is the sum over live SBUF tensors of their bytes
per partition; each PSUM tensor takes whole 2 KiB banks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import numpy as np

from nki_kernels import hardware

from . import trace
from .errors import NkiHardwareError

# The chip's sizes, from the one module of hardware facts (isa.py, tensor.py, language.py read them here).
SBUF_BYTES_PER_PARTITION = hardware.SBUF_BYTES_PER_PARTITION
PSUM_BANK_BYTES = hardware.PSUM_BANK_BYTES
PSUM_BANKS = hardware.PSUM_BANKS
PMAX = hardware.PMAX

_EMULATOR_DIR = os.path.dirname(os.path.abspath(__file__))

_target_override: list[str] = []
_count_only_depth = [0]


def resolve_target(target=None):
    """trn1 or trn2: the argument, else the innermost `use_target`, else NEURON_PLATFORM_TARGET_OVERRIDE, else trn2."""
    if target is None:
        if _target_override:
            return _target_override[-1]
        target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    return hardware.canonical_target(target)


@contextlib.contextmanager
def use_target(target):
    """Simulate kernels (and size `nl.tile_size`) for `target` ('trn1' or 'trn2') inside the block."""
    _target_override.append(resolve_target(target))
    try:
        yield
    finally:
        _target_override.pop()


@contextlib.contextmanager
def count_only():
    """Inside the block kernels skip all numerics: shapes, hardware rules and trace records only.

    Kernels called with numpy arrays return NaN-filled arrays of the right shapes and dtypes.
    """
    _count_only_depth[0] += 1
    try:
        yield
    finally:
        _count_only_depth[0] -= 1


def numerics_enabled():
    return _count_only_depth[0] == 0


_basenames: dict[str, str] = {}


def frame_line(frame):
    """file.py:LINE of a frame (the line it is executing, or for a finished frame the line it returned from)."""
    filename = frame.f_code.co_filename
    base = _basenames.get(filename)
    if base is None:
        base = _basenames[filename] = os.path.basename(filename)
    return f"{base}:{frame.f_lineno}"


def _in_emulator(frame):
    return frame.f_code.co_filename.startswith(_EMULATOR_DIR)


def caller_line():
    """file.py:LINE of the innermost frame outside the emulator (the kernel source line)."""
    frame = sys._getframe(1)
    while frame is not None and _in_emulator(frame):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return frame_line(frame)


def kernel_body_frame():
    """The frame of the kernel body on this thread's stack (the function the emulator's run_in_context called),
    or None outside it. Walks this thread's own stack only: another thread's frames may be freed under it."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_back is not None:
        if not _in_emulator(frame) and frame.f_back.f_code.co_name == "run_in_context":
            return frame
        frame = frame.f_back
    return None


def kernel_line(frame):
    """file.py:LINE of the kernel code a thread is executing, given its innermost frame: the deepest frame of the
    kernel's own code (the body and the helpers it calls, not the emulator or what the emulator calls)."""
    chain = []
    while frame is not None:
        chain.append(frame)
        frame = frame.f_back
    # The kernel body is the frame that the emulator's run_in_context called; its code runs inward from there
    # until the next emulator frame.
    for k in range(len(chain) - 1):
        if not _in_emulator(chain[k]) and chain[k + 1].f_code.co_name == "run_in_context":
            i = k
            while i > 0 and not _in_emulator(chain[i - 1]):
                i -= 1
            return frame_line(chain[i])
    return "<unknown>"


class KernelContext:
    """One kernel call (all its SPMD programs): records, live memory, program ids.

    rank / world: this launch's rank and the `spmd.World` of ranks it exchanges collectives with (None: a
    plain launch, one rank).
    """

    def __init__(self, name, target, grid, numerics, rank=0, world=None):
        self.target = target
        self.rank = rank
        self.world = world
        self.numerics = numerics
        self.grid = grid
        self.program_index = (0,) * len(grid)
        self.run = trace.KernelRun(
            name=name, target=target, grid=tuple(grid), rank=rank, num_ranks=1 if world is None else world.num_ranks
        )
        self.sbuf_capacity = SBUF_BYTES_PER_PARTITION[target]
        self.sbuf_live = 0
        self.psum_banks_live = 0
        self.next_storage_id = 0
        self.shared_hbm = []  # shared_hbm storages, matched by allocation order across programs
        self.shared_hbm_cursor = 0
        self.active = True
        self.activation_registers = np.zeros((PMAX, 1), dtype=np.float32)  # ScalarE reduce registers
        self.vector_registers = np.zeros((PMAX, 1), dtype=np.float32)  # VectorE accumulation registers
        # Random bits of rng / dropout / nl.rand: numpy's PCG64 seeded by set_rng_seed / nl.random_seed (0 until
        # then); the same seed gives the same numbers, not the hardware's XORWOW sequence.
        self.random = np.random.default_rng(0)
        # The running program's kernel-body frame, found by `current` on the rank's own thread (under
        # simulate_spmd only): after the body returns, its f_lineno is the line of the return.
        self.body_frame = None

    def new_storage_id(self):
        self.next_storage_id += 1
        return self.next_storage_id

    def check_capacity(self, opcode, line):
        if self.sbuf_live > self.sbuf_capacity:
            raise NkiHardwareError(
                f"{opcode} at {line}: live SBUF tensors need {self.sbuf_live} bytes per partition, over the "
                f"{self.sbuf_capacity} bytes of {self.target} (a tensor is live until its last reference is dropped)"
            )
        if self.psum_banks_live > PSUM_BANKS:
            raise NkiHardwareError(
                f"{opcode} at {line}: live PSUM tensors need {self.psum_banks_live} banks of 2 KiB per partition, "
                f"over the {PSUM_BANKS} banks of PSUM (a tensor is live until its last reference is dropped)"
            )


# Kernels being simulated, per thread: a launch from another thread (a concurrent host callback) is a new
# launch, not a kernel called from inside this one.
_threads = threading.local()


def _stack() -> list[KernelContext]:
    if not hasattr(_threads, "stack"):
        _threads.stack = []
    return _threads.stack


def current(what="this call"):
    """The context of the kernel being simulated; NKI calls outside a kernel are an error."""
    stack = _stack()
    if not stack:
        raise RuntimeError(f"{what} is only valid inside an NKI kernel being simulated (call the @nki.jit kernel)")
    ctx = stack[-1]
    if ctx.world is not None and ctx.body_frame is None:
        ctx.body_frame = kernel_body_frame()
    return ctx


def current_or_none():
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def running(ctx):
    _stack().append(ctx)
    try:
        yield ctx
    finally:
        _stack().pop()
        ctx.active = False
