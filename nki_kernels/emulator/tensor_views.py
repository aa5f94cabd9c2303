"""The view-building methods of NKI tensors (access patterns, dtype views, rearrange, permute, reshape, select):
each returns a new (shape, strides, offset) view over the same storage, or raises at the offending index; never
clips. NkiTensor inherits them."""

from __future__ import annotations

import math
import operator

import numpy as np

from . import context, dtypes
from .errors import NkiHardwareError


def default_strides(shape):
    """Row-major strides, in elements, of a contiguous array of `shape`."""
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def index_error(tensor, what):
    """Raises NkiHardwareError naming the kernel line, the bad index and the tensor."""
    raise NkiHardwareError(
        f"indexing at {context.caller_line()}: {what} of tensor {tensor.describe()} "
        f"(out-of-bounds indices are never clipped)"
    )


class TensorViews:
    """Mixin of NkiTensor: the views it offers beyond plain indexing (`self._view` builds each)."""

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """Explicit access pattern [[stride, count], ...] over this tensor's storage, in elements of `dtype`
        (default this view's; another size reinterprets the bytes, the base offset rescaled to it).

        scalar_offset: a one-element index tile; adds value * self.strides[indirect_dim] to the start.
        vector_offset: a [P, 1] index tile, P = the pattern's first count; partition p of the result starts at
        vector_offset[p] * self.strides[indirect_dim] (replacing the first pattern dimension's own stride); or a
        [128, M] tile for 128·M rows, read column-major (DMA batching).
        """
        if self.dynamic and (scalar_offset is not None or vector_offset is not None):
            index_error(self, "an indirect access of a view that is already indirect")
        new_dtype = self.dtype if dtype is None else dtypes.as_dtype(dtype)
        base = self.offset * self.dtype.itemsize
        if base % new_dtype.itemsize:
            index_error(self, f"reinterpretation as {new_dtype.name} at byte offset {base} (not aligned)")
        base //= new_dtype.itemsize
        strides = tuple(operator.index(p[0]) for p in pattern)
        shape = tuple(operator.index(p[1]) for p in pattern)
        if any(n < 1 for n in shape):
            index_error(self, f"access pattern {pattern} with a count below 1")
        start = base + (0 if offset is None else operator.index(offset))
        unit = (
            self.strides[indirect_dim] * self.dtype.itemsize // new_dtype.itemsize
            if (scalar_offset is not None or vector_offset is not None)
            else 0
        )
        if scalar_offset is not None:
            start += index_values(scalar_offset, "scalar_offset", 1)[0] * unit
        available = self.storage.size * self.storage.dtype.itemsize // new_dtype.itemsize
        if vector_offset is not None:
            rows = index_values(vector_offset, "vector_offset", shape[0])
            if isinstance(vector_offset, TensorViews) and vector_offset.ndim == 2 and vector_offset.shape[1] > 1:
                # A [128, M] index tile (DMA batching) is read column-major: row j = index[j % 128, j // 128].
                if vector_offset.shape[0] != 128:
                    index_error(self, f"a [P, M > 1] vector_offset {vector_offset.describe()} needs P == 128")
                rows = rows.reshape(vector_offset.shape).T.reshape(-1)
            inner = np.zeros(shape[1:], dtype=np.int64)
            for axis, (n, s) in enumerate(zip(shape[1:], strides[1:])):
                inner = inner + (np.arange(n, dtype=np.int64) * s).reshape((n,) + (1,) * (len(shape) - 2 - axis))
            gather = start + rows.reshape((-1,) + (1,) * (len(shape) - 1)) * unit + inner
            outside = (gather < 0) | (gather >= available)
            view = self._view(shape, strides, start, new_dtype, gather=np.where(outside, 0, gather))
            if outside.any():  # reading or writing these raises, unless a DMA skips them (oob_mode.skip)
                view.oob = outside
            view.index = vector_offset
            return view
        low = start + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
        high = start + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
        if low < 0 or high >= available:
            index_error(
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
            return type(self)(
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
        if isinstance(index, TensorViews):
            if self.dynamic:
                index_error(self, "a dynamic select of a view that is already indirect")
            if dim == 0 and self.is_on_chip:
                raise ValueError("select: a dynamic index cannot select the partition dimension of an on-chip tensor")
            value = int(index_values(index, "index", 1)[0])
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
            free = default_strides(shape[1:])
            return self._view(shape, (self.strides[0],) + free, self.offset)
        if not self.is_contiguous():
            raise ValueError("reshape: this view is not contiguous")
        return self._view(shape, default_strides(shape), self.offset)

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


def index_values(index, what, count):
    """The int64 values of an index tile of `count` elements (zeros when numerics are off); a single index may
    also be an int or a register (nisa.register_alloc, a loop variable)."""
    if not isinstance(index, TensorViews):
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
