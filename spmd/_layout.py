"""Layouts: a plan applied to a tree (one row per array), and to a whole training state.

A :class:`Layout` is what :meth:`spmd.Plan.resolve` returns: the PartitionSpecs in the tree's structure and a
:class:`LeafLayout` row per array (the report's per-parameter table). A :class:`StateLayout` holds the layouts of
the three roles of a training state — parameters, gradients, optimizer state — which ZeRO plans split differently.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from spmd._rules import PlanWarning, entry, to_spec, user_stacklevel
from spmd._tree import Leaf

if TYPE_CHECKING:
    from spmd._plan import Plan

__all__ = ["LeafLayout", "Layout", "StateLayout", "pad", "resolve_state", "stored_abstract", "unpad"]


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one array is laid out: the report's per-parameter row.

    >>> import spmd, numpy as np
    >>> row = spmd.Plan.from_rules([("w", ("data",))]).resolve({"w": np.zeros(8)}, {"data": 4}).leaves[0]
    >>> row.spec, row.bytes, row.bytes_per_device, row.replicas
    (P('data',), 64, 16, 1)
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: PartitionSpec
    names: tuple[str | None, ...] | None
    sources: tuple[str | None, ...]  # per dimension, the plan part that chose its axes
    bytes: int
    bytes_per_device: int
    replicas: int
    note: str | None = None
    padded_shape: tuple[int, ...] | None = None  # what is stored, when block alignment pads a dimension

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the array the training state holds: the padded shape, or the shape."""
        return self.padded_shape or self.shape

    @property
    def padding_bytes_per_device(self) -> int:
        """Bytes per device that block alignment adds (zero without padding)."""
        if self.padded_shape is None:
            return 0
        return self.bytes_per_device - self.bytes_per_device * math.prod(self.shape) // math.prod(self.padded_shape)

    @property
    def axes(self) -> frozenset[str]:
        """Every mesh axis splitting the array."""
        return frozenset(a for e in self.spec for a in entry(e, self.path))

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "padded_shape": None if self.padded_shape is None else list(self.padded_shape),
            "dtype": self.dtype,
            "spec": [None if e is None else e if isinstance(e, str) else list(e) for e in self.spec],
            "bytes": self.bytes,
            "bytes_per_device": self.bytes_per_device,
            "replicas": self.replicas,
            "names": None if self.names is None else list(self.names),
            "note": self.note,
        }


@dataclasses.dataclass(frozen=True)
class Layout:
    """The result of applying a plan to a tree: specs in the tree's structure plus a row per array.

    >>> import spmd, numpy as np
    >>> layout = spmd.Plan().resolve({"a": np.zeros(4), "b": np.zeros((2, 2))}, {"data": 2})
    >>> layout.specs, layout.bytes_per_device
    ({'a': P(None,), 'b': P(None, None)}, 64)
    """

    specs: Any
    leaves: tuple[LeafLayout, ...]
    unused_rules: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    advice: tuple[str, ...] = ()  # what the plan's parts could not do as asked (warned, and in the report)

    @property
    def bytes_per_device(self) -> int:
        return sum(leaf.bytes_per_device for leaf in self.leaves)

    @property
    def bytes(self) -> int:
        return sum(leaf.bytes for leaf in self.leaves)

    @property
    def padded(self) -> bool:
        """Whether block alignment padded any array (the training step then pads and slices)."""
        return any(leaf.padded_shape is not None for leaf in self.leaves)

    def rows(self) -> Any:
        """The rows in the specs' tree structure."""
        _, treedef = jax.tree.flatten(self.specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        return jax.tree.unflatten(treedef, list(self.leaves))


def row(
    leaf: Leaf,
    entries: Sequence[tuple[str, ...]],
    sources: Sequence[str | None],
    sizes: Mapping[str, int] | None,
    note: str | None = None,
    pads: Mapping[int, int] | None = None,
) -> LeafLayout:
    """The layout row of ``leaf`` split by ``entries`` (chosen by ``sources``) on a mesh of ``sizes``."""
    entries = tuple(entries) + ((),) * (len(leaf.shape) - len(entries))
    sources = tuple(sources) + (None,) * (len(leaf.shape) - len(sources))
    spec = to_spec(entries)
    padded = tuple(pads.get(d, n) for d, n in enumerate(leaf.shape)) if pads else None
    stored_bytes = leaf.nbytes if padded is None else leaf.nbytes // math.prod(leaf.shape) * math.prod(padded)
    ways = 1 if sizes is None else math.prod(sizes[a] for e in entries for a in e)
    devices = 1 if sizes is None else math.prod(sizes.values())
    return LeafLayout(
        path=leaf.path,
        shape=leaf.shape,
        dtype=leaf.dtype,
        spec=spec,
        names=leaf.names,
        sources=sources,
        note=note,
        padded_shape=padded,
        bytes=leaf.nbytes,
        bytes_per_device=stored_bytes // ways,
        replicas=devices // ways,
    )


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The plan applied to the training state: rows for parameters, gradients and optimizer state (and, per
    parameter, the layout an optimizer moment mirroring it takes: ZeRO-1/2 split these).

    >>> import spmd, optax, jax
    >>> params = {"w": jax.ShapeDtypeStruct((64, 64), "float32")}
    >>> layout = resolve_state(spmd.Plan(), params, optax.adam(1e-3), {"data": 8})
    >>> [len(layout.params.leaves), len(layout.opt_state.leaves)]  # Adam: a count and two moments
    [1, 3]
    """

    params: Layout
    grads: Layout
    opt_state: Layout
    moments: Layout
    trained: Layout  # the arrays the optimizer updates, as stored: the parameters, or an executor's own arrays


def resolve_state(
    plan: Plan,
    annotated_params: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh | Mapping[str, int],
    *,
    trained: Any = None,
) -> StateLayout:
    """Applies ``plan`` to (abstract, possibly annotated) parameters and the optimizer state they imply, on a mesh
    or on mesh sizes alone (no devices needed: the cost model plans for meshes that are not present).

    ``trained``: the arrays the gradients and the optimizer state are kept for, when they are not the stored
    parameters themselves (subnetwork data parallelism with backward masking keeps them per part).
    See :class:`StateLayout` for more.

    >>> import optax, jax, strategies
    >>> params = {"w": jax.ShapeDtypeStruct((64, 64), "float32")}
    >>> layout = resolve_state(strategies.zero1(), params, optax.adam(1e-3), {"data": 8})  # no devices needed
    >>> layout.params.leaves[0].spec, [r.spec for r in layout.opt_state.leaves]  # ZeRO-1 splits Adam's moments
    (P(None, None), [P(), P('data', None), P('data', None)])
    """
    trained = annotated_params if trained is None else trained
    # The parameters, gradients and optimizer state are resolved apart, each time with the same rules: what the
    # plan warns about is said once, at the user's line; other warnings pass through as they were raised.
    said: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", PlanWarning)
            params = plan.resolve(annotated_params, mesh)
            grads = plan.resolve(trained, mesh, role="grads")
            moments = plan.resolve(trained, mesh, role="optimizer")
            # The optimizer updates the stored (block-padded) parameters, or the executor's own arrays, and its
            # state mirrors them; their gradients are stored so too.
            stored = params if trained is annotated_params else grads
            opt_state = plan.resolve(jax.eval_shape(optimizer.init, stored_abstract(stored)), mesh, params=trained)
    finally:  # said even when a later resolution fails
        for message in dict.fromkeys(str(w.message) for w in said if issubclass(w.category, PlanWarning)):
            warnings.warn(message, PlanWarning, stacklevel=user_stacklevel())
        for w in said:
            if not issubclass(w.category, PlanWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return StateLayout(params, grads, opt_state, moments, stored)


def stored_abstract(layout: Layout) -> Any:
    """ShapeDtypeStructs of the arrays as stored (block-padded shapes), in the layout's tree structure.

    >>> import spmd, numpy as np
    >>> stored_abstract(spmd.Plan().resolve({"w": np.zeros(3)}))
    {'w': ShapeDtypeStruct(shape=(3,), dtype=float64)}
    """
    return jax.tree.map(
        lambda r: jax.ShapeDtypeStruct(r.stored_shape, r.dtype),
        layout.rows(),
        is_leaf=lambda x: isinstance(x, LeafLayout),
    )


def pad(tree: Any, layout: Layout) -> Any:
    """Pads each array with zeros up to its stored shape (a no-op for unpadded layouts).

    >>> import strategies, numpy as np
    >>> layout = strategies.fsdp(min_bytes=0, block=8).resolve({"w": np.ones((4, 16))}, {"fsdp": 4})
    >>> pad({"w": np.ones((4, 16))}, layout)["w"].shape, unpad(pad({"w": np.ones((4, 16))}, layout), layout)["w"].shape
    ((4, 32), (4, 16))
    """
    if not layout.padded:
        return tree
    return jax.tree.map(
        lambda x, r: (
            x
            if r.padded_shape is None
            else jnp.pad(x, [(0, p - n) for n, p in zip(r.shape, r.padded_shape, strict=True)])
        ),
        tree,
        layout.rows(),
    )


def unpad(tree: Any, layout: Layout) -> Any:
    """Slices each stored array back to its parameter's shape (a no-op for unpadded layouts; see :func:`pad`)."""
    if not layout.padded:
        return tree
    return jax.tree.map(
        lambda x, r: x if r.padded_shape is None else x[tuple(slice(0, n) for n in r.shape)], tree, layout.rows()
    )
