"""Creating nnx modules already laid out by a plan: every part of it, on the devices, never whole on one."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import jax
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding

from spmd._context import active, initialising
from spmd._mesh import auto_twin, traced_auto
from spmd._rules import PlanError

if TYPE_CHECKING:
    from spmd._plan import Plan

__all__ = ["create"]

T = TypeVar("T")


def create(factory: Callable[[], T], plan: Plan | None = None, mesh: jax.sharding.Mesh | None = None) -> T:
    """Calls ``factory()``, which builds nnx modules (a model, its ``nnx.Optimizer``, a tuple of them), so that
    every variable is created already laid out by ``plan`` on ``mesh`` (by default the plan and mesh of
    :func:`spmd.activate`).

    Each device computes only its own shards, and every part of the plan applies: fsdp and path rules too,
    which name no logical axis, so that flax's eager sharding (by logical names, and on a whole array first)
    cannot apply them. The factory runs twice: once on shapes, to plan the layout, then inside ``jax.jit``.

    >>> import spmd, strategies, optax
    >>> from flax import nnx
    >>> mesh = spmd.make_mesh({"fsdp": -1})
    >>> def build():
    ...     model = nnx.Linear(16, 64, rngs=nnx.Rngs(0))
    ...     return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    >>> model, optimizer = spmd.create(build, strategies.fsdp(min_bytes=0), mesh)
    >>> model.kernel[...].sharding.spec, optimizer.opt_state[0].mu["kernel"][...].sharding.spec
    (P(None, 'fsdp'), P(None, 'fsdp'))
    """
    plan, mesh = _plan_and_mesh(plan, mesh)
    # Shapes first, with no mesh in context: the model's logical names then need no rule yet.
    with jax.set_mesh(None), nn.logical_axis_rules(()), nnx.use_eager_sharding(False):
        graphdef, abstract = nnx.split(nnx.eval_shape(factory))
    layout = plan.resolve(abstract, mesh)
    padded = [r.path for r in layout.leaves if r.padded_shape is not None]
    if padded:
        raise PlanError(
            f"spmd.create: the plan pads {padded[0]} (a block-aligned layout), which a module cannot hold; "
            "create the module whole and train it with spmd.TrainStep, which stores the padding"
        )
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.specs)

    def make() -> Any:
        with initialising(plan, auto_twin(mesh), abstract):
            return nnx.split(factory())[1]

    state = jax.jit(traced_auto(make, mesh, layout.specs), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def _plan_and_mesh(plan: Plan | None, mesh: jax.sharding.Mesh | None) -> tuple[Plan, jax.sharding.Mesh]:
    current = active()
    plan = plan if plan is not None else current[0] if current else None
    mesh = mesh if mesh is not None else current[1] if current else None
    if plan is None or mesh is None:
        raise ValueError("spmd.create: give plan= and mesh=, or call it under spmd.activate(plan, mesh)")
    return plan, mesh
