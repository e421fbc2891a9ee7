"""Walking pytrees of arrays, abstract arrays and flax boxes with readable "/"-joined paths."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of a tree, seen abstractly: where it is, its shape and dtype, and its logical names.

    >>> leaf = Leaf(("mlp", "wi", "kernel"), (8, 32), "float32", 1024, ("embed", "mlp"))
    >>> leaf.path  # what path rules match against
    'mlp/wi/kernel'
    """

    keys: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    names: tuple[str | None, ...] | None  # logical axis names from a flax/nnx annotation, if any

    @functools.cached_property
    def path(self) -> str:  # cached: every rule of every part matches against it
        return "/".join(self.keys)


def is_box(x: Any) -> bool:
    """Flax metadata boxes and nnx Variables are treated as one array each."""
    return isinstance(x, (nn.meta.AxisMetadata, nnx.Variable))


def key_name(k: Any) -> str:
    """A pytree path entry as text: a dict key, an attribute name or a sequence index.

    >>> [key_name(k) for k in jax.tree_util.tree_flatten_with_path({"a": [0]})[0][0][0]]
    ['a', '0']
    """
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _names(box: Any) -> tuple[str | None, ...] | None:
    if isinstance(box, nn.meta.AxisMetadata):
        names = getattr(box, "names", None)
    else:
        meta = box.get_metadata()
        names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    return None if names is None else tuple(names)


def _value(x: Any) -> Any:
    if isinstance(x, nn.meta.AxisMetadata):
        return x.unbox()
    if isinstance(x, nnx.Variable):
        return x.get_value() if hasattr(x, "get_value") else x.value
    return x


def leaves_with_paths(tree: Any) -> tuple[list[Leaf], Any]:
    """Flattens ``tree`` (boxes count as leaves) into :class:`Leaf` records and the treedef to rebuild it.

    >>> w = nn.LogicallyPartitioned(np.zeros((8, 32), np.float32), ("embed", "mlp"))
    >>> leaves, treedef = leaves_with_paths({"mlp": {"w": w}, "b": np.zeros(4, np.float32)})
    >>> [(leaf.path, leaf.shape, leaf.nbytes, leaf.names) for leaf in leaves]
    [('b', (4,), 16, None), ('mlp/w', (8, 32), 1024, ('embed', 'mlp'))]
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)
    leaves = []
    for path, x in flat:
        value = _value(x)
        shape = tuple(int(d) for d in np.shape(value))
        dtype = getattr(value, "dtype", None)
        if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # not a typed PRNG key (nnx.Rngs)
            dtype = np.dtype(dtype or np.result_type(value))
        names = _names(x) if is_box(x) else None
        if names is not None and len(names) != len(shape):
            keys = "/".join(key_name(k) for k in path)
            raise ValueError(f"{keys}: annotation names {names} do not match its shape {shape}")
        leaves.append(
            Leaf(
                keys=tuple(key_name(k) for k in path),
                shape=shape,
                dtype=str(dtype),
                nbytes=int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                names=names,
            )
        )
    return leaves, treedef


def rebuild(treedef: Any, leaves: list[Any]) -> Any:
    return jax.tree_util.tree_unflatten(treedef, leaves)


def unbox(tree: Any) -> Any:
    """Replaces flax metadata boxes (``nn.LogicallyPartitioned``, ``nn.Partitioned``) and nnx Variables
    (``nnx.Param``, ...) by their values: an ``nnx.State`` keeps its structure with arrays in it, which
    ``nnx.merge`` takes back as it takes Variables.

    Unlike ``nn.meta.unbox`` this never adds a sharding constraint (which flax does when a global mesh is
    set), so it is a pure change of container, safe inside or outside ``jit``.

    >>> unbox({"w": nn.LogicallyPartitioned(np.ones(2), ("embed",)), "b": nnx.Param(np.zeros(2))})
    {'b': array([0., 0.]), 'w': array([1., 1.])}
    """

    def value(x: Any) -> Any:
        if isinstance(x, nnx.Variable):
            return unbox(_value(x))
        if not isinstance(x, nn.meta.AxisMetadata):
            return x
        return unbox(x.value if isinstance(x, nn.Partitioned) else x.unbox())

    return jax.tree.map(value, tree, is_leaf=is_box)
