"""Instruction records: what the emulator tells profilers and the cost model.

The executing side (tensors, ISA ops) appends one `InstructionRecord` per ISA
instruction or DMA to the `KernelRun` of the kernel being simulated; when the
kernel returns, every registered listener receives the finished run. The
profile and the cost model only ever see these records, never emulator state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")


@dataclasses.dataclass(frozen=True)
class Access:
    """A rectangular region of one storage that an instruction reads or writes.

    `storage` identifies the allocation (unique per kernel run); partitions are
    [p_start, p_stop); bytes within each partition are [b_start, b_stop). For
    HBM tensors (no partition dim) p_start=0, p_stop=1 and the byte range spans
    the flattened region touched.
    """

    storage: int
    buffer: str  # "hbm" | "sbuf" | "psum"
    p_start: int
    p_stop: int
    b_start: int
    b_stop: int


@dataclasses.dataclass(frozen=True)
class MatmulInfo:
    contraction: int  # K rows on the partition dim (<= 128)
    stationary_free: int  # <= 128
    moving_free: int  # <= 512
    input_dtype: str  # numpy dtype name of the operands, e.g. "bfloat16", "float32"
    is_transpose: bool = False


@dataclasses.dataclass(frozen=True)
class DmaInfo:
    nbytes: int  # bytes written (destination side)
    src_buffer: str
    dst_buffer: str
    contiguous_bytes: int  # length of the longest contiguous run on the HBM side
    transpose: bool = False
    # Bytes read (source side); differs from nbytes when the DMA casts (bf16 HBM -> fp32 SBUF reads
    # half of what it writes). None: same as nbytes.
    src_nbytes: int | None = None

    @property
    def bytes_read(self) -> int:
        return self.nbytes if self.src_nbytes is None else self.src_nbytes


@dataclasses.dataclass(frozen=True)
class CollectiveInfo:
    """What a `nki.collectives` call moves, for the cost model's link model (cost_model.collective_ns)."""

    kind: str  # "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute"
    nbytes: int  # bytes of this rank's source tensors (summed over coalesced tensors)
    group_size: int  # ranks in this rank's rank-list (for a permute: 2 when it sends or receives, else 1)
    num_ranks: int  # ranks of the launch (simulate_spmd's num_ranks)


@dataclasses.dataclass(frozen=True)
class InstructionRecord:
    opcode: str  # "nc_matmul", "dma_copy", "tensor_copy", "activation", ...
    engine: str  # one of ENGINES
    line: str  # "file.py:LINE" of the kernel source that issued it
    partitions: int  # active partitions (1 for HBM<->HBM DMA)
    free_elements: int  # elements processed per partition
    dtype: str  # numpy dtype name of the data processed (dst for copies)
    reads: tuple[Access, ...]
    writes: tuple[Access, ...]
    matmul: MatmulInfo | None = None
    dma: DmaInfo | None = None
    # numpy dtype names of the input data tensors, in argument order (per-partition scalar operands such
    # as bias, scale or tensor_scalar's operands excluded); () when not recorded.
    input_dtypes: tuple[str, ...] = ()
    # Whether dst and every input data tensor have physically contiguous elements along their innermost
    # free dimension (a condition of trn2's VectorE performance mode).
    inner_contiguous: bool = True
    # Set on the one record of a collective (engine "dma"; dma is None): what it exchanges between ranks.
    collective: CollectiveInfo | None = None


@dataclasses.dataclass
class KernelRun:
    name: str
    target: str  # "trn1" | "trn2"
    grid: tuple[int, ...] = ()
    records: list[InstructionRecord] = dataclasses.field(default_factory=list)
    rank: int = 0  # this run's rank under simulate_spmd (0 for a plain launch)
    num_ranks: int = 1


_listeners: list[Callable[[KernelRun], None]] = []


def add_listener(fn: Callable[[KernelRun], None]) -> None:
    _listeners.append(fn)


def remove_listener(fn: Callable[[KernelRun], None]) -> None:
    _listeners.remove(fn)


def kernel_finished(run: KernelRun) -> None:
    for fn in list(_listeners):
        fn(run)
