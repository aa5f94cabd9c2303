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


def _default_strides(shape):
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _index_error(tensor, what):
    raise NkiHardwareError(
        f"indexing at {context.caller_line()}: {what} of tensor {tensor.describe()} "
        f"(out-of-bounds indices are never clipped)"
    )


_item_assignment = None  # (view, value) -> None, installed by isa.py


def install_item_assignment(assign):
    """Sets the instructions `tile[key] = value` runs; isa.py calls this, since the instructions build on
    tensors and tensors cannot import them."""
    global _item_assignment
    _item_assignment = assign


class NkiTensor(NKIObject):
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
        self.strides = _default_strides(self.shape) if strides is None else tuple(strides)
        self.offset = offset
        self._array = None
        self._access = None
        self.gather = gather
        self.dynamic = indirect or gather is not None
        self.oob = None  # per-element mask of indirect elements outside the storage (see ap)

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
            _index_error(
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
            _index_error(self, f"{len(key)} indices for a {self.ndim}-D tensor")
        on_chip = self.is_on_chip
        shape, strides = [], []
        offset = self.offset
        for dim, k in enumerate(key):
            n, s = self.shape[dim], self.strides[dim]
            if isinstance(k, slice):
                step = 1 if k.step is None else operator.index(k.step)
                if step < 1:
                    _index_error(self, f"slice step {step} on dim {dim} (steps must be >= 1)")
                start = 0 if k.start is None else operator.index(k.start)
                stop = n if k.stop is None else operator.index(k.stop)
                if start < 0:
                    start += n
                if stop < 0:
                    stop += n
                if not 0 <= start < stop <= n:
                    _index_error(self, f"slice {k.start}:{k.stop} on dim {dim} (size {n})")
                shape.append(-(-(stop - start) // step))
                strides.append(s * step)
                offset += start * s
            elif isinstance(k, DynSlice):
                if k.size < 1 or not 0 <= k.start or k.start + k.size > n:
                    _index_error(self, f"{k!r} on dim {dim} (size {n})")
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
                    _index_error(self, f"index {k} on dim {dim} (size {n})")
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

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Explicit access pattern [[stride, count], ...] over this tensor's storage, in elements of `dtype`
        (default this view's; another size reinterprets the bytes, the base offset rescaled to it).

        scalar_offset: a one-element index tile; adds value * self.strides[indirect_dim] to the start.
        vector_offset: a [P, 1] index tile, P = the pattern's first count; partition p of the result starts at
        vector_offset[p] * self.strides[indirect_dim] (replacing the first pattern dimension's own stride).
        """
        if self.dynamic and (scalar_offset is not None or vector_offset is not None):
            _index_error(self, "an indirect access of a view that is already indirect")
        new_dtype = self.dtype if dtype is None else dtypes.as_dtype(dtype)
        base = self.offset * self.dtype.itemsize
        if base % new_dtype.itemsize:
            _index_error(self, f"reinterpretation as {new_dtype.name} at byte offset {base} (not aligned)")
        base //= new_dtype.itemsize
        strides = tuple(operator.index(p[0]) for p in pattern)
        shape = tuple(operator.index(p[1]) for p in pattern)
        if any(n < 1 for n in shape):
            _index_error(self, f"access pattern {pattern} with a count below 1")
        start = base + (0 if offset is None else operator.index(offset))
        unit = (
            self.strides[indirect_dim] * self.dtype.itemsize // new_dtype.itemsize
            if (scalar_offset is not None or vector_offset is not None)
            else 0
        )
        if scalar_offset is not None:
            start += _index_values(scalar_offset, "scalar_offset", 1)[0] * unit
        available = self.storage.size * self.storage.dtype.itemsize // new_dtype.itemsize
        if vector_offset is not None:
            rows = _index_values(vector_offset, "vector_offset", shape[0])
            inner = np.zeros(shape[1:], dtype=np.int64)
            for axis, (n, s) in enumerate(zip(shape[1:], strides[1:])):
                inner = inner + (np.arange(n, dtype=np.int64) * s).reshape((n,) + (1,) * (len(shape) - 2 - axis))
            gather = start + rows.reshape((-1,) + (1,) * (len(shape) - 1)) * unit + inner
            outside = (gather < 0) | (gather >= available)
            view = self._view(shape, strides, start, new_dtype, gather=np.where(outside, 0, gather))
            if outside.any():  # reading or writing these raises, unless a DMA skips them (oob_mode.skip)
                view.oob = outside
            return view
        low = start + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
        high = start + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
        if low < 0 or high >= available:
            _index_error(
                self,
                f"access pattern {pattern} at offset {start} reaching elements {low}..{high} (storage has {available})",
            )
        return self._view(shape, strides, start, new_dtype, indirect=self.dynamic or scalar_offset is not None)

    def indirect(self, index, num_elem=None):
        """Tensor indirection (gather/scatter views for compute engines) exists from NeuronCore-v4 (trn3) on."""
        raise NotImplementedError(
            f"{self.describe()}.indirect(): tensor indirection needs NeuronCore-v4 (trn3); "
            f"the emulator targets trn1 and trn2 (use .ap(vector_offset=...) with a DMA)"
        )

    def vector_select(self, dim, vector_offset):
        """Per-partition indirect selection of an HBM tensor's dim 0: row p of the result is
        self[vector_offset[p]]; the result's dim 0 has vector_offset.shape[0] rows."""
        if dim != 0:
            raise ValueError(f"vector_select: dim must be 0, got {dim}")
        if self.is_on_chip:
            raise ValueError(f"vector_select: only HBM tensors, got {self.describe()}")
        pattern = [[self.strides[0], vector_offset.shape[0]]] + [
            [s, n] for s, n in zip(self.strides[1:], self.shape[1:])
        ]
        return self.ap(pattern, offset=0, vector_offset=vector_offset, indirect_dim=0)

    def view(self, dtype):
        """The same bytes as `dtype`: the last dimension scales by the ratio of the dtype sizes."""
        dtype = dtypes.as_dtype(dtype)
        old, new = self.dtype.itemsize, dtype.itemsize
        if old == new:
            return self._view(self.shape, self.strides, self.offset, dtype)
        if self.gather is not None or self.dynamic:
            raise ValueError(f"view: {self.describe()} is indirect (dtype views need a direct view)")
        if self.shape[-1] != 1 and self.strides[-1] != 1:
            raise ValueError(f"view: the last dimension of {self.describe()} must be contiguous")
        last = self.shape[-1] * old
        if last % new or (self.offset * old) % new or any((s * old) % new for s in self.strides[:-1]):
            raise ValueError(
                f"view: {self.describe()} cannot be reinterpreted as {dtype.name} (last dimension of "
                f"{last} bytes or strides not divisible by {new})"
            )
        strides = tuple(s * old // new for s in self.strides[:-1]) + (1,)
        return self._view(self.shape[:-1] + (last // new,), strides, self.offset * old // new, dtype)

    reinterpret_cast = view

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None):
        """einops-style split / reorder / merge: `t.rearrange(('b', ('h', 'w')), ('b', 'w', 'h'), {'h': 4})`."""
        fixed = dict(fixed_sizes or {})
        if len(src_pattern) != self.ndim:
            raise ValueError(
                f"rearrange: src_pattern {src_pattern} has {len(src_pattern)} entries for a {self.ndim}-D tensor"
            )
        view = self
        names = []
        dim = 0
        for entry in src_pattern:
            group = (entry,) if isinstance(entry, str) else tuple(entry)
            if len(group) > 1:
                sizes = [fixed.get(name, -1) for name in group]
                view = view.reshape_dim(dim, sizes)
            for name in group:
                fixed[name] = view.shape[dim]
                names.append(name)
                dim += 1
        flat_dst = [name for entry in dst_pattern for name in ((entry,) if isinstance(entry, str) else entry)]
        if sorted(flat_dst) != sorted(names):
            raise ValueError(f"rearrange: dst_pattern {dst_pattern} must name the dims of src_pattern {src_pattern}")
        view = view.permute(tuple(names.index(name) for name in flat_dst))
        dim = 0
        for entry in dst_pattern:
            count = 1 if isinstance(entry, str) else len(entry)
            if count > 1:
                view = view.flatten_dims(dim, dim + count - 1)
            elif count == 0:
                view = view.expand_dim(dim)
                count = 1
            dim += 1
        return view

    def _check_dim(self, dim, what):
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"{what}: dim {dim} out of range for a {self.ndim}-D tensor")
        dim %= self.ndim
        if dim == 0 and self.is_on_chip:
            raise ValueError(f"{what}: dim 0 is the partition dimension of an on-chip tensor")
        return dim

    def permute(self, dims):
        dims = tuple(dims)
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute: {dims} is not a permutation of range({self.ndim})")
        if (self.is_on_chip or self.gather is not None) and dims[0] != 0:
            raise ValueError("permute: the partition dimension of an on-chip tensor must stay first")
        if self.gather is not None:
            return NkiTensor(
                tuple(self.shape[d] for d in dims),
                self.dtype,
                self.storage,
                self.buffer,
                self.name,
                strides=tuple(self.strides[d] for d in dims),
                offset=self.offset,
                gather=self.gather.transpose(dims),
            )
        return self._view(tuple(self.shape[d] for d in dims), tuple(self.strides[d] for d in dims), self.offset)

    def broadcast(self, dim, size):
        dim = self._check_dim(dim, "broadcast")
        if self.shape[dim] != 1:
            raise ValueError(f"broadcast: dim {dim} has size {self.shape[dim]}, expected 1")
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = size, 0
        return self._view(tuple(shape), tuple(strides), self.offset)

    def expand_dim(self, dim):
        if self.is_on_chip and dim == 0:
            raise ValueError("expand_dim: cannot insert before the partition dimension of an on-chip tensor")
        return self._view(
            self.shape[:dim] + (1,) + self.shape[dim:], self.strides[:dim] + (1,) + self.strides[dim:], self.offset
        )

    def squeeze_dim(self, dim):
        dim = self._check_dim(dim, "squeeze_dim")
        if self.shape[dim] != 1:
            raise ValueError(f"squeeze_dim: dim {dim} has size {self.shape[dim]}, expected 1")
        return self._view(
            self.shape[:dim] + self.shape[dim + 1 :], self.strides[:dim] + self.strides[dim + 1 :], self.offset
        )

    def slice(self, dim, start, end, step=1):
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim, index):
        """Remove dim at `index`: an int, or a one-element index tile (dynamic selection, resolved from its
        value; an indirect view)."""
        dim = dim % self.ndim
        if isinstance(index, NkiTensor):
            if self.dynamic:
                _index_error(self, "a dynamic select of a view that is already indirect")
            if dim == 0 and self.is_on_chip:
                raise ValueError("select: a dynamic index cannot select the partition dimension of an on-chip tensor")
            value = int(_index_values(index, "index", 1)[0])
            view = self.select(dim, value)
            view.dynamic = True
            return view
        key = [slice(None)] * self.ndim
        key[dim] = index
        view = self[tuple(key)]
        if self.is_on_chip and dim == 0:
            raise ValueError("select: cannot remove the partition dimension of an on-chip tensor")
        return view

    def reshape(self, shape):
        shape = tuple(operator.index(n) for n in shape)
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(self.size // known if n == -1 else n for n in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"reshape: cannot reshape {list(self.shape)} into {list(shape)}")
        if self.is_on_chip:
            if shape[0] != self.shape[0]:
                raise ValueError("reshape: the partition dimension of an on-chip tensor must be preserved")
            if not self.is_contiguous():
                raise ValueError("reshape: the free dimensions of this view are not contiguous")
            free = _default_strides(shape[1:])
            return self._view(shape, (self.strides[0],) + free, self.offset)
        if not self.is_contiguous():
            raise ValueError("reshape: this view is not contiguous")
        return self._view(shape, _default_strides(shape), self.offset)

    def reshape_dim(self, dim, shape):
        """Split dim into `shape` (one entry may be -1); always a valid view, whatever the strides."""
        dim = dim % self.ndim
        shape = [operator.index(n) for n in shape]
        n = self.shape[dim]
        if shape.count(-1) > 1:
            raise ValueError(f"reshape_dim: at most one -1 in {shape}")
        if -1 in shape:
            known = math.prod(m for m in shape if m != -1)
            if known == 0 or n % known:
                raise ValueError(f"reshape_dim: cannot split size {n} into {shape}")
            shape[shape.index(-1)] = n // known
        if math.prod(shape) != n:
            raise ValueError(f"reshape_dim: {shape} does not multiply to dim {dim}'s size {n}")
        if dim == 0 and self.is_on_chip and len(shape) != 1:
            raise ValueError("reshape_dim: cannot split the partition dimension of an on-chip tensor")
        strides = []
        step = self.strides[dim]
        for m in reversed(shape):
            strides.append(step)
            step *= m
        return self._view(
            self.shape[:dim] + tuple(shape) + self.shape[dim + 1 :],
            self.strides[:dim] + tuple(reversed(strides)) + self.strides[dim + 1 :],
            self.offset,
        )

    def flatten_dims(self, start_dim, end_dim):
        if self.is_on_chip and start_dim == 0:
            raise ValueError("flatten_dims: start_dim must be > 0 for an on-chip tensor")
        merged = math.prod(self.shape[start_dim : end_dim + 1])
        for d in range(start_dim, end_dim):
            if self.shape[d + 1] != 1 and self.strides[d] != self.strides[d + 1] * self.shape[d + 1]:
                raise ValueError(f"flatten_dims: dims {start_dim}..{end_dim} are not contiguous in memory")
        return self._view(
            self.shape[:start_dim] + (merged,) + self.shape[end_dim + 1 :],
            self.strides[:start_dim] + (self.strides[end_dim],) + self.strides[end_dim + 1 :],
            self.offset,
        )


def _index_values(index, what, count):
    """The int64 values of an index tile of `count` elements (zeros when numerics are off); a single index may
    also be an int or a register (nisa.register_alloc, a loop variable)."""
    if not isinstance(index, NkiTensor):
        if count == 1:
            try:
                return np.array([operator.index(index)], dtype=np.int64)
            except TypeError:
                pass
        raise TypeError(f"{what}: expected an NKI index tensor, an int or a register, got {type(index).__name__}")
    if dtypes.is_float(index.dtype):
        raise TypeError(f"{what}: index tensor {index.describe()} must have an integer dtype")
    if index.size != count:
        raise ValueError(f"{what}: index tensor {index.describe()} must have {count} element(s)")
    values = index.array()
    if values is None:
        return np.zeros(count, dtype=np.int64)
    return np.asarray(values, dtype=np.int64).reshape(-1)


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
