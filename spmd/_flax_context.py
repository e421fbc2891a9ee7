"""The plan as flax's sharding context: the mesh flax sees, the logical rules it applies (completed for every name
a model may use, MaxText's activation names derived from the plan), and flax's DenseGeneral made to work under
them. :func:`spmd.activate` and spmd's own init tracing enter it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
from flax import linen as nn

from spmd import axes as names
from spmd._rules import is_activation_name

if TYPE_CHECKING:
    from spmd._plan import Plan

__all__ = ["flax_context", "flax_rules"]


@contextlib.contextmanager
def flax_context(plan: Plan, mesh: jax.sharding.Mesh, more: Iterable[str] = ()) -> Iterator[None]:
    """``mesh`` as the context mesh, :func:`flax_rules` as flax's rules, and DenseGeneral able to initialise.

    >>> import spmd, jax
    >>> with flax_context(spmd.Plan(batch_axes=("data",)), spmd.make_mesh({"data": -1})):
    ...     jax.sharding.get_abstract_mesh().axis_names
    ('data',)
    """
    with (
        _mesh_context(mesh),
        nn.logical_axis_rules(flax_rules(plan, mesh, more)),
        nn.intercept_methods(_dense_general_unconstrained),
    ):
        yield


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
