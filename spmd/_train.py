"""Sharded initialisation and a jitted, sharded training step built from a loss, an optimizer, a plan, a mesh."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd._context import activate
from spmd._plan import Layout, Plan
from spmd._tree import unbox


class TrainState(NamedTuple):
    """What a training step carries from one step to the next."""

    step: jax.Array
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The plan applied to the training state: rows for parameters, gradients and optimizer state, and the
    shardings of the state and of the gradients (which ZeRO-2 splits while the parameters stay whole)."""

    params: Layout
    grads: Layout
    opt_state: Layout
    moments: Layout  # per parameter, the layout an optimizer moment mirroring it takes (ZeRO-1/2 split these)
    shardings: TrainState
    grad_shardings: Any


def shard(tree: Any, plan: Plan, mesh: Mesh) -> Any:
    """Places the arrays of ``tree`` (flax boxes are unboxed) on ``mesh`` as ``plan`` says.

    >>> import spmd, numpy as np
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> spmd.shard({"w": np.ones((2, 3))}, spmd.Plan(), mesh)["w"].sharding.spec
    P(None, None)
    """
    return jax.device_put(unbox(tree), plan.shardings(tree, mesh))


class TrainStep:
    """A training step whose inputs and outputs are laid out by a plan; the first call compiles it.

    ``loss_fn(params, batch) -> scalar``. Parameters are created already sharded by :meth:`init`, the state
    buffers are donated, and gradients are constrained to the parameters' layout before the update.

    >>> import spmd, optax, jax, jax.numpy as jnp
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> n = mesh.shape["data"]
    >>> step = spmd.train_step(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), optax.sgd(0.1),
    ...                        spmd.Plan(batch_axes=("data",)), mesh)
    >>> state = step.init(lambda rng: {"w": jax.random.normal(rng, (3, 2))}, jax.random.key(0))
    >>> state, loss = step(state, {"x": jnp.ones((2 * n, 3))})
    >>> int(state.step), loss.shape
    (1, ())
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], jax.Array],
        optimizer: optax.GradientTransformation,
        plan: Plan,
        mesh: Mesh,
        *,
        donate: bool = True,
    ) -> None:
        plan.check_mesh(mesh)
        self.loss_fn, self.optimizer, self.plan, self.mesh = loss_fn, optimizer, plan, mesh
        self.donate = donate
        self.layout: StateLayout | None = None
        self.compiled: jax.stages.Compiled | None = None
        self._batch_shardings: Any = None

    # -- layout and init ----------------------------------------------------------------------------------
    def prepare(self, annotated_params: Any) -> StateLayout:
        """Applies the plan to (abstract, possibly annotated) parameters and the optimizer state they imply."""
        abstract = jax.eval_shape(unbox, annotated_params)
        params = self.plan.resolve(annotated_params, self.mesh)
        grads = self.plan.resolve(annotated_params, self.mesh, role="grads")
        moments = self.plan.resolve(annotated_params, self.mesh, role="optimizer")
        opt_abstract = jax.eval_shape(self.optimizer.init, abstract)
        opt_state = self.plan.resolve(opt_abstract, self.mesh, params=annotated_params)
        named = lambda specs: jax.tree.map(  # noqa: E731
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
        replicated = NamedSharding(self.mesh, PartitionSpec())
        state = TrainState(replicated, named(params.specs), named(opt_state.specs))
        self.layout = StateLayout(params, grads, opt_state, moments, state, named(grads.specs))
        self.compiled = None
        return self.layout

    def initializer(self, init_fn: Callable[[jax.Array], Any], rng: jax.Array) -> Callable[[jax.Array], TrainState]:
        """The jitted function creating the training state in its sharded layout (see :meth:`init`)."""
        self.prepare(jax.eval_shape(init_fn, rng))

        def create(rng: jax.Array) -> TrainState:
            params = unbox(init_fn(rng))
            return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))

        return jax.jit(create, out_shardings=self.layout.shardings)

    def init(self, init_fn: Callable[[jax.Array], Any], rng: jax.Array) -> TrainState:
        """Creates the training state directly in its sharded layout: each device computes only its own shards,
        so no device ever holds a full replica of a sharded parameter. ``init_fn(rng)`` returns the parameters,
        optionally with flax logical annotations."""
        return self.initializer(init_fn, rng)(rng)

    # -- the step -----------------------------------------------------------------------------------------
    def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
        with activate(self.plan, self.mesh):
            loss, grads = jax.value_and_grad(self.loss_fn)(state.params, batch)
        # Gradients take their planned layout (the parameters', or ZeRO-2's split one) before the update, so the
        # compiler reduces them straight into it.
        grads = jax.lax.with_sharding_constraint(grads, self.layout.grad_shardings)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), loss

    def batch_shardings(self, batch: Any) -> Any:
        return self.plan.batch_shardings(batch, self.mesh)

    def abstract_state(self) -> TrainState:
        """The training state as ShapeDtypeStructs carrying their shardings (for lowering without arrays)."""
        self._need_layout()
        rows = lambda layout, sh: jax.tree.map(  # noqa: E731
            lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s),
            _rows_tree(layout),
            sh,
            is_leaf=lambda x: hasattr(x, "bytes_per_device"),
        )
        sh = self.layout.shardings
        return TrainState(
            jax.ShapeDtypeStruct((), jnp.int32, sharding=sh.step),
            rows(self.layout.params, sh.params),
            rows(self.layout.opt_state, sh.opt_state),
        )

    def lower(self, batch: Any) -> jax.stages.Lowered:
        """Lowers the step for a batch (arrays or ShapeDtypeStructs) without running it."""
        self._need_layout()
        self._batch_shardings = self.batch_shardings(batch)
        abstract_batch = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=s), batch, self._batch_shardings
        )
        out = (self.layout.shardings, NamedSharding(self.mesh, PartitionSpec()))
        jitted = jax.jit(
            self._step,
            in_shardings=(self.layout.shardings, self._batch_shardings),
            out_shardings=out,
            donate_argnums=(0,) if self.donate else (),
        )
        return jitted.lower(self.abstract_state(), abstract_batch)

    def compile(self, batch: Any) -> jax.stages.Compiled:
        """Compiles the step once for this batch shape; later calls reuse the executable."""
        self.compiled = self.lower(batch).compile()
        return self.compiled

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
        if self.compiled is None:
            self.compile(batch)
        return self.compiled(state, jax.device_put(batch, self._batch_shardings))

    def _need_layout(self) -> None:
        if self.layout is None:
            raise RuntimeError("TrainStep: call .init(init_fn, rng) or .prepare(abstract_params) first")


def train_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    optimizer: optax.GradientTransformation,
    plan: Plan,
    mesh: Mesh,
    *,
    donate: bool = True,
) -> TrainStep:
    """Builds a :class:`TrainStep` (see there for an example)."""
    return TrainStep(loss_fn, optimizer, plan, mesh, donate=donate)


def _rows_tree(layout: Layout) -> Any:
    """The layout's rows in the specs' tree structure."""
    _, treedef = jax.tree.flatten(layout.specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.tree.unflatten(treedef, list(layout.leaves))
