"""The active plan: lets model code name activation layouts by logical axis names."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from spmd._flax_context import flax_context
from spmd._sequence_order import tracking_order
from spmd._tree import leaves_with_paths

if TYPE_CHECKING:
    from spmd._plan import Plan

_ACTIVE: contextvars.ContextVar[tuple[Plan, jax.sharding.Mesh] | None] = contextvars.ContextVar(
    "spmd_active_plan", default=None
)


@contextlib.contextmanager
def activate(plan: Plan, mesh: jax.sharding.Mesh) -> Iterator[None]:
    """Makes ``plan`` the sharding context: model code names activation layouts by logical names, and flax sees
    the plan as its own context: ``mesh`` as the context mesh and the plan's logical rules as flax's rules.

    So inside, ``spmd.constrain``, flax's ``nn.with_logical_constraint`` and a bare
    ``jax.lax.with_sharding_constraint(x, PartitionSpec(...))`` all take effect, and an nnx model annotated with
    ``nnx.with_partitioning`` is created with its variables already laid out by the plan's logical rules (flax's
    eager sharding). Names of :mod:`spmd.axes` the plan does not map are left unsplit (nnx takes any other name
    without a rule for a mesh axis: give it one); a dimension named ``batch`` (or MaxText's
    ``activation_batch``) goes over the plan's batch axes. Outside ``jax.jit`` the mesh is set with
    ``jax.set_mesh``, inside with its abstract mesh; a context mesh already set (a ``shard_map``'s) is kept.

    >>> import spmd, jax.numpy as jnp
    >>> with spmd.activate(spmd.Plan(batch_axes=("data",)), spmd.make_mesh({"data": -1})):
    ...     y = spmd.constrain(jnp.ones((8, 4)), ("batch", "embed"))
    >>> y.shape
    (8, 4)
    """
    token = _ACTIVE.set((plan, mesh))
    try:
        with flax_context(plan, mesh), tracking_order():
            yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def initialising(plan: Plan, mesh: jax.sharding.Mesh, params: Any = None) -> Iterator[None]:
    """Where spmd traces a user's init function: the plan is flax's context as under :func:`activate` (the
    model's own bare ``PartitionSpec`` constraints find their mesh, nnx finds its names' rules), except that
    ``spmd.constrain`` does not act: init runs the model on an example batch that need not split (often one
    row), which ``spmd.constrain`` would refuse. The created parameters take the plan's layout from the jitted
    initialiser's output shardings, which cover every part of the plan (fsdp and path rules too). Every logical
    name in ``params`` (abstract parameters, as annotated) has a rule: the plan's, or none -- left whole.

    >>> import spmd, jax.numpy as jnp
    >>> plan, mesh = spmd.Plan(batch_axes=("data",)), spmd.make_mesh({"data": -1})
    >>> with initialising(plan, mesh):
    ...     spmd.constrain(jnp.ones((1, 4)), ("batch", None)).shape  # one row: left as it is
    (1, 4)
    """
    named = {n for leaf in leaves_with_paths(params)[0] for n in leaf.names or () if isinstance(n, str)}
    token = _ACTIVE.set(None)
    try:
        with flax_context(plan, mesh, named):
            yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[Plan, jax.sharding.Mesh] | None:
    """The (plan, mesh) made active by :func:`activate`, or None."""
    return _ACTIVE.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains an activation's layout by logical axis names under the active plan; a no-op without one.

    ``names`` has one entry per dimension (e.g. ``("batch", "seq", "embed")``); ``"batch"`` maps to the plan's
    batch axes, other names through its logical rules, and unknown names stay unsharded.

    >>> import spmd, jax.numpy as jnp
    >>> spmd.constrain(jnp.ones((2, 3)), ("batch", None)).shape  # no active plan: unchanged
    (2, 3)
    """
    current = _ACTIVE.get()
    if current is None:
        return x
    plan, mesh = current
    if len(names) != x.ndim:
        raise ValueError(
            f"spmd.constrain: {len(names)} names {tuple(names)} for an array of shape {x.shape}; "
            f"give one logical name (or None) per dimension"
        )
    # Inside a shard_map over some axes (a pipeline's stages and data shards) the constraint names the context's
    # mesh, in which those axes are manual: ``x`` is one device's part along them, so they leave the spec.
    context = jax.sharding.get_abstract_mesh()
    if context.empty or not context.manual_axes:
        spec = plan.activation_spec(tuple(names), x.shape, mesh)
        target = mesh if context.empty or context == mesh.abstract_mesh else context
        return _constrained(x, NamedSharding(target, spec))
    manual = set(context.manual_axes)
    local = {a: 1 if a in manual else n for a, n in mesh.shape.items()}
    spec = plan.activation_spec(tuple(names), x.shape, local)
    spec = PartitionSpec(*[_without(entry, manual) for entry in spec])
    return _constrained(x, NamedSharding(context, spec))


def _constrained(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` laid out as ``sharding`` says: a constraint the compiler propagates from over Auto axes; over
    Explicit axes, where the layout is part of the array's type, a ``reshard`` (a constraint would be refused)."""
    if AxisType.Explicit in sharding.mesh.axis_types:
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _without(entry: Any, manual: set[str]) -> Any:
    if entry is None:
        return None
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in manual)
    return None if not kept else kept[0] if len(kept) == 1 else kept
