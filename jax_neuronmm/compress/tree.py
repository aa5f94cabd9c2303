"""Walking parameter trees: Linen variables (nested dicts / FrozenDict), NNX `State`, lists and tuples.

A leaf is addressed by its tuple of keys (str for mapping keys, int for mapping int keys and list positions) and
named by those keys joined with "/". NNX `Variable` leaves are unwrapped to their arrays and re-wrapped with the
same variable type and metadata.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np


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
