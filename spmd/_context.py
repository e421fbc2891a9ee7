"""The active plan: lets model code name activation layouts by logical axis names."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
from flax import linen as nn
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from spmd import axes as names
from spmd._rules import is_activation_name
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
    eager sharding). Logical names the plan does not map are left unsplit; a dimension named ``batch`` (or
    MaxText's ``activation_batch``) goes over the plan's batch axes. Outside ``jax.jit`` the mesh is set with
    ``jax.set_mesh``, inside with its abstract mesh; a context mesh already set (a ``shard_map``'s) is kept.

    >>> import spmd, jax.numpy as jnp
    >>> with spmd.activate(spmd.Plan(batch_axes=("data",)), spmd.make_mesh({"data": -1})):
    ...     y = spmd.constrain(jnp.ones((8, 4)), ("batch", "embed"))
    >>> y.shape
    (8, 4)
    """
    token = _ACTIVE.set((plan, mesh))
    try:
        with (
            _mesh_context(mesh),
            nn.logical_axis_rules(flax_rules(plan, mesh)),
            nn.intercept_methods(_dense_general_unconstrained),
        ):
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
        with _mesh_context(mesh), nn.logical_axis_rules(flax_rules(plan, mesh, named)):
            with nn.intercept_methods(_dense_general_unconstrained):
                yield
    finally:
        _ACTIVE.reset(token)


# MaxText's names for a batch dimension of activations: the plan's batch axes split them, as they split ``batch``.
_BATCH_ALIASES = ("activation_batch", "activation_batch_no_exp", "activation_embed_and_logits_batch")


def flax_rules(plan: Plan, mesh: jax.sharding.Mesh, more: Iterable[str] = ()) -> list[tuple[str, Any]]:
    """The rules flax sees under :func:`activate`: the plan's; activation names derived from the names it shards;
    then every other name spmd knows (and each of ``more``), left whole.

    flax's nnx eager sharding keeps a name without a rule as a mesh axis name (and fails on it), where its linen
    constraints leave such a dimension whole: so every known name gets an entry. MaxText names an activation's
    dimensions ``activation_<name>``: a batch alias goes over the plan's batch axes, and ``activation_<name>``
    over the axes that split the parameters' ``<name>`` other than batch axes (tensor parallelism's, not fsdp's:
    those split parameters to gather them, while activations are split by the batch).

    >>> import spmd
    >>> plan = spmd.Plan(batch_axes=("fsdp",)) + spmd.Plan.from_logical_rules([("mlp", "tensor"), ("embed", "fsdp")])
    >>> rules = dict(flax_rules(plan, spmd.make_mesh({"fsdp": 4, "tensor": 2})))
    >>> rules["activation_batch"], rules["activation_mlp"], rules["activation_embed"], rules["heads"]
    ('fsdp', 'tensor', None, None)
    """
    rules = plan.flax_axis_rules(mesh)
    mapped = {name for name, _ in rules}
    batch = dict(rules).get(names.BATCH)
    out = rules + [(name, batch) for name in _BATCH_ALIASES if name not in mapped]
    for name, axes in plan.logical_rules():
        derived = "activation_" + name
        if derived not in mapped and not is_activation_name(name):
            model = tuple(a for a in axes if a not in plan.batch_axes)
            out.append((derived, None if not model else model[0] if len(model) == 1 else model))
            mapped.add(derived)
    known = [getattr(names, n) for n in names.__all__ if isinstance(getattr(names, n), str)]
    return out + [(name, None) for name in dict.fromkeys([*known, *sorted(more)]) if name not in mapped]


def _mesh_context(mesh: jax.sharding.Mesh) -> contextlib.AbstractContextManager:
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()  # the caller's, spmd's own Auto twin, or a shard_map's (manual axes)
    try:
        return jax.set_mesh(mesh)  # eager code (nnx's eager sharding) places real arrays: the devices are needed
    except ValueError:  # under jax.jit, where only the abstract mesh may be set
        return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def _dense_general_unconstrained(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
    """flax's DenseGeneral creates its kernel flat, then constrains that rank-2 value by the kernel's rank-3
    logical names (flax issue 3676); it runs that initialiser in ``apply`` too, to check the kernel's shape. Under
    a context mesh and rules, that constraint fails: inside DenseGeneral's own call (a kernel, a bias, one
    matmul, no constraint of the model's) flax's rules are set aside. The parameters it reads are laid out by the
    plan all the same: by the step's input shardings, the initialiser's output shardings, or :func:`spmd.shard`."""
    if isinstance(context.module, nn.DenseGeneral) and context.method_name == "__call__":
        with nn.logical_axis_rules(()):
            return next_fun(*args, **kwargs)
    return next_fun(*args, **kwargs)


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
