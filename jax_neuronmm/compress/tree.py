"""Walking parameter trees: Linen variables (nested dicts / FrozenDict), NNX `State`, lists and tuples.

A leaf is addressed by its tuple of keys (str for mapping keys, int for mapping int keys and list positions) and
named by those keys joined with "/". NNX `Variable` leaves are unwrapped to their arrays and re-wrapped with the
same variable type and metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def iter_leaves(node, keys: tuple = ()) -> Iterator[tuple[tuple, object]]:
    """(keys, leaf) for every leaf below node, in tree order; NNX Variables count as leaves."""
    if isinstance(node, Mapping):
        for key, child in node.items():
            yield from iter_leaves(child, keys + (key,))
    elif isinstance(node, (list, tuple)):
        for index, child in enumerate(node):
            yield from iter_leaves(child, keys + (index,))
    else:
        yield keys, node


def rebuild(node, replace: Callable[[tuple, object], list[tuple[object, object]]], keys: tuple = ()):
    """node with every leaf replaced by the (key, new leaf) pairs replace(keys, leaf) returns, under its parent.

    One leaf may so become several (kernel → u, v). Containers keep their types; an NNX State is rebuilt through
    its flat form, so the result has the structure `nnx.state(...)` gives and merges with a graphdef.
    """
    if isinstance(node, nnx.State):
        flat = [(path[:-1] + (key,), new) for path, leaf in nnx.to_flat_state(node) for key, new in replace(path, leaf)]
        return nnx.from_flat_state(flat)
    if isinstance(node, Mapping):
        entries = {}
        for key, child in node.items():
            if isinstance(child, (Mapping, list, tuple)):
                entries[key] = rebuild(child, replace, keys + (key,))
            else:
                entries.update(replace(keys + (key,), child))
        return type(node)(entries)
    if isinstance(node, (list, tuple)):
        children = []
        for index, child in enumerate(node):
            if isinstance(child, (Mapping, list, tuple)):
                children.append(rebuild(child, replace, keys + (index,)))
            else:
                children += [new for _, new in replace(keys + (index,), child)]
        return type(node)(children)
    return replace(keys, node)[0][1]


def join(keys) -> str:
    """The "/"-joined name of a key path."""
    return "/".join(str(key) for key in keys)


def unwrap(leaf):
    """The array inside an NNX Variable, or the leaf itself."""
    return leaf.get_value() if hasattr(leaf, "get_value") else leaf


def wrap_like(original, array):
    """array in the container of `original`: the same NNX Variable type and metadata; JAX array if it held one."""
    inner = unwrap(original)
    value = jnp.asarray(array) if isinstance(inner, jax.Array) else np.asarray(array)
    return original.replace(value) if hasattr(original, "get_value") else value


def nest(flat: Mapping[tuple, object]) -> dict:
    """Nested dicts from {key path: leaf}."""
    root: dict = {}
    for keys, leaf in flat.items():
        node = root
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = leaf
    return root
