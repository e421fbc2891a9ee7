"""The active plan: lets model code name activation layouts by logical axis names."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
from flax import linen as nn
from jax.sharding import AxisType, NamedSharding, PartitionSpec

if TYPE_CHECKING:
    from spmd._plan import Plan

_ACTIVE: contextvars.ContextVar[tuple[Plan, jax.sharding.Mesh] | None] = contextvars.ContextVar(
    "spmd_active_plan", default=None
)


@contextlib.contextmanager
def activate(plan: Plan, mesh: jax.sharding.Mesh) -> Iterator[None]:
    """Makes ``plan`` resolve logical activation names inside model code (and flax's own constraints).

    >>> import spmd, jax.numpy as jnp
    >>> with spmd.activate(spmd.Plan(batch_axes=("data",)), spmd.make_mesh({"data": -1})):
    ...     y = spmd.constrain(jnp.ones((8, 4)), ("batch", "embed"))
    >>> y.shape
    (8, 4)
    """
    token = _ACTIVE.set((plan, mesh))
    try:
        # flax's nn.with_logical_constraint reads its own rule context, so it gets the plan's rules; it acts only
        # under a global mesh, which is left unset: with one, flax 0.12 also constrains every boxed parameter it
        # unboxes, and its DenseGeneral inside nn.scan then applies a rank-3 spec to a rank-2 value. Inside model
        # code, spmd.constrain is the constraint that always takes effect.
        with nn.logical_axis_rules(plan.flax_axis_rules(mesh)):
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
