"""NKI tensors: storages in HBM / SBUF / PSUM and strided views of them.

Layout: a storage is a flat row-major array of its allocation shape. On-chip storages (SBUF, PSUM) put
the partition dimension first, so partition p holds elements [p * part_stride, (p + 1) * part_stride).
A view is (shape, strides, offset) in elements over one storage, exactly what `.ap()` patterns address.
Indexing never clips: an index outside the tensor raises NkiHardwareError.
"""

from __future__ import annotations

import enum
import math
import operator

import numpy as np

from . import context, dtypes
from .errors import NkiHardwareError
from .tensor_views import TensorViews, default_strides, index_error
from .trace import Access


class MemoryRegion(enum.Enum):
    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"


_KIND = {
    MemoryRegion.sbuf: "sbuf",
    MemoryRegion.psum: "psum",
    MemoryRegion.private_hbm: "hbm",
    MemoryRegion.shared_hbm: "hbm",
}
_REGION_BY_NAME = {
    "sbuf": MemoryRegion.sbuf,
    "psum": MemoryRegion.psum,
    "hbm": MemoryRegion.private_hbm,
    "private_hbm": MemoryRegion.private_hbm,
    "shared_hbm": MemoryRegion.shared_hbm,
}

# PSUM location state, per element: which kind of instruction last wrote it.
PSUM_UNWRITTEN, PSUM_BY_MATMUL, PSUM_BY_OTHER = 0, 1, 2
# Set to zero by a non-matmul instruction (nl.zeros, memset 0): a later nc_matmul with accumulate=None starts its
# accumulation group there (the documented PSUM-accumulation pattern); accumulate=True onto it is still undefined.
PSUM_ZEROED = 3


def as_region(buffer):
    if isinstance(buffer, MemoryRegion):
        return buffer
    region = _REGION_BY_NAME.get(buffer) if isinstance(buffer, str) else None
    if region is None:
        raise ValueError(f"buffer: expected nl.sbuf, nl.psum, nl.hbm, nl.private_hbm or nl.shared_hbm, got {buffer!r}")
    return region


class NKIObject:
    """`nl.NKIObject`: base class of NKI kernel dataclasses and configuration objects (and of NkiTensor).

    Keyword arguments become attributes; dataclass subclasses bring their own __init__.
    """

    def __init__(self, **kwargs):
        for key, value in kwargs.items():
            setattr(self, key, value)


class DynSlice:
    """`nl.ds(start, size)`: the slice start:start+size."""

    __slots__ = ("start", "size")

    def __init__(self, start, size):
        self.start = operator.index(start)
        self.size = operator.index(size)

    def __repr__(self):
        return f"nl.ds({self.start}, {self.size})"


class Storage:
    """One allocation. Accounts itself in the kernel's live SBUF / PSUM totals until garbage collected."""

    __slots__ = (
        "id",
        "kind",
        "shape",
        "dtype",
        "flat",
        "size",
        "part_stride",
        "bytes_per_partition",
        "psum_banks",
        "psum_state",
        "ctx",
        "name",
        "__weakref__",
    )

    def __init__(self, ctx, shape, dtype, kind, name="", data=None):
        self.ctx = ctx
        self.id = ctx.new_storage_id()
        self.kind = kind
        self.shape = shape
        self.dtype = dtype
        self.name = name
        self.size = math.prod(shape)
        self.part_stride = self.size // shape[0] if kind != "hbm" else self.size
        self.bytes_per_partition = self.part_stride * dtype.itemsize
        self.psum_banks = 0
        self.psum_state = None
        if not ctx.numerics:
            self.flat = None
        elif data is not None:
            self.flat = data.reshape(-1)
        else:
            self.flat = np.full(self.size, dtypes.fill_value(dtype), dtype=dtype)
        if kind == "sbuf":
            ctx.sbuf_live += self.bytes_per_partition
        elif kind == "psum":
            self.psum_banks = -(-self.bytes_per_partition // context.PSUM_BANK_BYTES)
            ctx.psum_banks_live += self.psum_banks
            self.psum_state = np.zeros(self.size, dtype=np.uint8)

    def __del__(self):
        ctx = self.ctx
        if ctx.active:
            if self.kind == "sbuf":
                ctx.sbuf_live -= self.bytes_per_partition
            elif self.kind == "psum":
                ctx.psum_banks_live -= self.psum_banks


_item_assignment = None  # (view, value) -> None, installed by isa.py


def install_item_assignment(assign):
    """Sets the instructions `tile[key] = value` runs; isa.py calls this, since the instructions build on
    tensors and tensors cannot import them."""
    global _item_assignment
    _item_assignment = assign


class NkiTensor(TensorViews, NKIObject):
    """A view of a storage: `shape`, `strides` and `offset` in elements of the view's `dtype` (which may
    reinterpret the storage's bytes, `view`), `buffer` (an nl memory region).

    Indirect views (dynamic `select`, `vector_select`, `ap` with scalar / vector offsets) resolve their offsets
    from the index tile's values when the view is created, which is when a kernel builds it for the instruction
    that uses it. A per-partition (vector) offset gives a view that is no strided pattern: it carries the flat
    element index of every element (`gather`), read by gathering and written by scattering.
    """

    __slots__ = (
        "shape",
        "strides",
        "offset",
        "dtype",
        "buffer",
        "name",
        "storage",
        "_array",
        "_access",
        "gather",
        "dynamic",
        "oob",
        "index",
    )

    def __class_getitem__(cls, shape):
        """`nt.tensor[128, 512]` (and `nt.tensor[shape, dtype]`) in annotations: the tensor type itself."""
        return cls

    def __init__(
        self,
        shape,
        dtype,
        storage,
        buffer=MemoryRegion.sbuf,
        name="",
        *,
        strides=None,
        offset=0,
        gather=None,
        indirect=False,
    ):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.storage = storage
        self.buffer = buffer
        self.name = name
        self.strides = default_strides(self.shape) if strides is None else tuple(strides)
        self.offset = offset
        self._array = None
        self._access = None
        self.gather = gather
        self.dynamic = indirect or gather is not None
        self.oob = None  # per-element mask of indirect elements outside the storage (see ap)
        self.index = None  # the vector_offset index tile of an indirect view (see ap), for the DMAs' checks

    # -- basic properties -------------------------------------------------------------------------
    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def kind(self):
        """'hbm', 'sbuf' or 'psum'."""
        return self.storage.kind

    @property
    def part_stride(self):
        """Elements of this view's dtype in one partition row of its storage (the whole storage for HBM)."""
        storage = self.storage
        return storage.part_stride * storage.dtype.itemsize // self.dtype.itemsize

    @property
    def storage_elements(self):
        """Elements of this view's dtype in its storage."""
        return self.storage.size * self.storage.dtype.itemsize // self.dtype.itemsize

    @property
    def is_on_chip(self):
        return self.storage.kind != "hbm"

    def describe(self):
        label = f"'{self.name}' " if self.name else ""
        return f"{label}{list(self.shape)} {self.dtype.name} in {self.storage.kind}"

    def __repr__(self):
        return f"NkiTensor({self.describe()})"

    def is_contiguous(self):
        dims = range(1, self.ndim) if self.is_on_chip else range(self.ndim)
        expected = 1
        for d in reversed(dims):
            if self.shape[d] != 1 and self.strides[d] != expected:
                return False
            expected *= self.shape[d]
        return True

    def get_pattern(self):
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def is_indirect(self):
        return self.dynamic

    # -- numpy view and access region (used by instructions) --------------------------------------
    def array(self):
        """The numpy view of this tensor's elements (None when numerics are off)."""
        if self.oob is not None:
            index_error(
                self,
                "an indirect (vector_offset) access out of bounds; nisa.dma_copy with "
                "oob_mode=nisa.oob_mode.skip skips such elements",
            )
        if self.gather is not None:
            return self.gathered()
        if self._array is None:
            flat = self.storage.flat
            if flat is None:
                return None
            size = self.dtype.itemsize
            self._array = np.ndarray(
                self.shape,
                self.dtype,
                buffer=flat,
                offset=self.offset * size,
                strides=tuple(s * size for s in self.strides),
            )
        return self._array

    def gathered(self):
        """A copy of an indirect view's elements (out-of-bounds ones read as element 0; see `oob`)."""
        flat = self.storage.flat
        return None if flat is None else flat.view(self.dtype)[self.gather]

    def write(self, values):
        """Store values (already of this view's dtype and shape) into the view's elements (an indirect view's
        out-of-bounds elements are skipped)."""
        if self.gather is not None:
            flat = self.storage.flat.view(self.dtype)
            if self.oob is None:
                flat[self.gather] = values
            else:
                keep = ~self.oob
                flat[self.gather[keep]] = np.broadcast_to(values, self.shape)[keep]
        else:
            self.array()[...] = values

    def psum_state(self):
        """Per-element PSUM write state (PSUM_* constants) of this view, writable."""
        if self.gather is not None or self.dtype.itemsize != self.storage.dtype.itemsize:
            raise NotImplementedError(f"{self.describe()}: indirect or reinterpreted views of PSUM are not emulated")
        return np.ndarray(
            self.shape, np.uint8, buffer=self.storage.psum_state, offset=self.offset, strides=self.strides
        )

    def access(self):
        if self._access is None:
            storage = self.storage
            size = self.dtype.itemsize
            offset = self.offset
            if self.gather is not None:  # the span of the gathered elements
                low, high = (int(self.gather.min()), int(self.gather.max())) if self.gather.size else (0, 0)
                if storage.kind == "hbm":
                    self._access = Access(storage.id, "hbm", 0, 1, low * size, (high + 1) * size)
                else:
                    part_stride = self.part_stride
                    self._access = Access(
                        storage.id, storage.kind, low // part_stride, high // part_stride + 1, 0, part_stride * size
                    )
            elif storage.kind == "hbm" and self.dynamic:
                # A runtime offset (scalar_offset) can land anywhere in the tensor on hardware: order the access
                # against every access of it, not just the slots this emulated run's index value happened to hit.
                self._access = Access(storage.id, "hbm", 0, 1, 0, storage.size * storage.dtype.itemsize)
            elif storage.kind == "hbm":
                extent = sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + 1
                self._access = Access(storage.id, "hbm", 0, 1, offset * size, (offset + extent) * size)
            else:
                part_stride = self.part_stride
                free_extent = sum((n - 1) * s for n, s in zip(self.shape[1:], self.strides[1:])) + 1
                first = offset % part_stride
                last_partition = (offset + (self.shape[0] - 1) * self.strides[0]) // part_stride
                self._access = Access(
                    storage.id,
                    storage.kind,
                    offset // part_stride,
                    last_partition + 1,
                    first * size,
                    (first + free_extent) * size,
                )
        return self._access

    def contiguous_bytes(self):
        """Bytes in the longest row-major contiguous run of this view (innermost dimensions)."""
        run = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n == 1:
                continue
            if s != run:
                break
            run *= n
        return run * self.dtype.itemsize

    # -- views --------------------------------------------------------------------------------------
    def _view(self, shape, strides, offset, dtype=None, gather=None, indirect=None):
        if self.gather is not None:
            raise NotImplementedError(f"{self.describe()}: a view of a per-partition indirect view is not emulated")
        return NkiTensor(
            shape,
            self.dtype if dtype is None else dtype,
            self.storage,
            self.buffer,
            self.name,
            strides=strides,
            offset=offset,
            gather=gather,
            indirect=self.dynamic if indirect is None else indirect,
        )

    def __getitem__(self, key):
        if not isinstance(key, tuple):
            key = (key,)
        n_ellipsis = sum(1 for k in key if k is Ellipsis)
        if n_ellipsis > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        if n_ellipsis:
            at = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:at] + (slice(None),) * fill + key[at + 1 :]
        if len(key) > self.ndim:
            index_error(self, f"{len(key)} indices for a {self.ndim}-D tensor")
        on_chip = self.is_on_chip
        shape, strides = [], []
        offset = self.offset
        for dim, k in enumerate(key):
            n, s = self.shape[dim], self.strides[dim]
            if isinstance(k, slice):
                step = 1 if k.step is None else operator.index(k.step)
                if step < 1:
                    index_error(self, f"slice step {step} on dim {dim} (steps must be >= 1)")
                start = 0 if k.start is None else operator.index(k.start)
                stop = n if k.stop is None else operator.index(k.stop)
                if start < 0:
                    start += n
                if stop < 0:
                    stop += n
                if not 0 <= start < stop <= n:
                    index_error(self, f"slice {k.start}:{k.stop} on dim {dim} (size {n})")
                shape.append(-(-(stop - start) // step))
                strides.append(s * step)
                offset += start * s
            elif isinstance(k, DynSlice):
                if k.size < 1 or not 0 <= k.start or k.start + k.size > n:
                    index_error(self, f"{k!r} on dim {dim} (size {n})")
                shape.append(k.size)
                strides.append(s)
                offset += k.start * s
            else:
                try:
                    i = operator.index(k)
                except TypeError:
                    raise TypeError(
                        f"NKI tensors are indexed by ints, slices, nl.ds(...) or '...'; got {k!r}"
                    ) from None
                if i < 0:
                    i += n
                if not 0 <= i < n:
                    index_error(self, f"index {k} on dim {dim} (size {n})")
                offset += i * s
                if on_chip and dim == 0:  # the partition dim is kept at size 1
                    shape.append(1)
                    strides.append(s)
        shape.extend(self.shape[len(key) :])
        strides.extend(self.strides[len(key) :])
        minimum = 2 if on_chip else 1
        while len(shape) < minimum:
            shape.append(1)
            strides.append(1)
        return self._view(tuple(shape), tuple(strides), offset)

    def __setitem__(self, key, value):
        """`tile[key] = value` (the language guide's style): runs the copy or memset instruction that
        `isa` installs (see install_item_assignment)."""
        _item_assignment(self[key], value)


def allocate(shape, dtype, buffer, name="", data=None):
    """A fresh tensor (NaN / sentinel filled unless `data` given) in the running kernel."""
    ctx = context.current("nl.ndarray")
    region = as_region(buffer)
    kind = _KIND[region]
    try:
        shape = tuple(operator.index(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    except TypeError:
        raise TypeError(f"shape: expected a tuple of ints, got {shape!r}") from None
    if not shape or any(n < 1 for n in shape):
        raise ValueError(f"shape: expected positive sizes, got {shape}")
    dtype = dtypes.as_dtype(dtype)
    if kind != "hbm":
        line = context.caller_line()
        if len(shape) < 2:
            raise NkiHardwareError(
                f"nl.ndarray at {line}: on-chip tensor {name!r} must be at least 2-D "
                f"(partition dim first), got shape {list(shape)}"
            )
        if shape[0] > context.PMAX:
            raise NkiHardwareError(
                f"nl.ndarray at {line}: partition dim {shape[0]} of {kind} tensor {name!r} "
                f"exceeds {context.PMAX} partitions"
            )
        free_bytes = math.prod(shape[1:]) * dtype.itemsize
        if kind == "psum" and free_bytes > context.PSUM_BANKS * context.PSUM_BANK_BYTES:
            raise NkiHardwareError(
                f"nl.ndarray at {line}: PSUM tensor {name!r} needs {free_bytes} bytes per "
                f"partition, over the 16 KiB of PSUM"
            )
    if region is MemoryRegion.shared_hbm and data is None:
        # SPMD programs share shared_hbm tensors: the i-th allocation of every program is the same tensor.
        ctx = context.current()
        index = ctx.shared_hbm_cursor
        ctx.shared_hbm_cursor += 1
        if index < len(ctx.shared_hbm):
            storage = ctx.shared_hbm[index]
            if storage.shape == shape and storage.dtype == dtype:
                return NkiTensor(shape, dtype, storage, region, name)
        storage = Storage(ctx, shape, dtype, kind, name)
        ctx.shared_hbm.append(storage)
        return NkiTensor(shape, dtype, storage, region, name)
    return NkiTensor(shape, dtype, Storage(ctx, shape, dtype, kind, name, data), region, name)
