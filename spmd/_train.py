"""Sharded initialisation and a jitted, sharded training step built from a loss, an optimizer, a plan, a mesh."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd._context import activate
from spmd._pipeline import Pipeline, StagedModel
from spmd._plan import Layout, LeafLayout, Plan, PlanError
from spmd._shares import UnevenData
from spmd._subnet import Subnetworks
from spmd._tree import leaves_with_paths, unbox


class TrainState(NamedTuple):
    """What a training step carries from one step to the next."""

    step: jax.Array
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The plan applied to the training state: rows for parameters, gradients and optimizer state, and the
    shardings of the state and of the gradients (which ZeRO-2 splits while the parameters stay whole); the
    shardings are None when the layout was resolved for mesh sizes only (:func:`resolve_state`)."""

    params: Layout
    grads: Layout
    opt_state: Layout
    moments: Layout  # per parameter, the layout an optimizer moment mirroring it takes (ZeRO-1/2 split these)
    shardings: TrainState | None = None
    grad_shardings: Any = None


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

    >>> import spmd, optax, jax
    >>> params = {"w": jax.ShapeDtypeStruct((64, 64), "float32")}
    >>> layout = resolve_state(spmd.Plan(), params, optax.adam(1e-3), {"data": 8})
    >>> [len(layout.params.leaves), len(layout.opt_state.leaves)]  # Adam: a count and two moments
    [1, 3]
    """
    trained = annotated_params if trained is None else trained
    params = plan.resolve(annotated_params, mesh)
    grads = plan.resolve(trained, mesh, role="grads")
    moments = plan.resolve(trained, mesh, role="optimizer")
    # The optimizer state mirrors the stored (block-padded) arrays it trains.
    opt_abstract = jax.eval_shape(optimizer.init, stored_abstract(params if trained is annotated_params else grads))
    opt_state = plan.resolve(opt_abstract, mesh, params=trained)
    return StateLayout(params, grads, opt_state, moments)


def stored_abstract(layout: Layout) -> Any:
    """ShapeDtypeStructs of the arrays as stored (block-padded shapes), in the layout's tree structure."""
    return jax.tree.map(
        lambda row: jax.ShapeDtypeStruct(row.stored_shape, row.dtype),
        _rows_tree(layout),
        is_leaf=lambda x: isinstance(x, LeafLayout),
    )


def pad(tree: Any, layout: Layout) -> Any:
    """Pads each array with zeros up to its stored shape (a no-op for unpadded layouts)."""
    if not layout.padded:
        return tree
    return jax.tree.map(
        lambda x, row: (
            x
            if row.padded_shape is None
            else jnp.pad(x, [(0, p - n) for n, p in zip(row.shape, row.padded_shape, strict=True)])
        ),
        tree,
        _rows_tree(layout),
    )


def unpad(tree: Any, layout: Layout) -> Any:
    """Slices each stored array back to its parameter's shape (a no-op for unpadded layouts)."""
    if not layout.padded:
        return tree
    return jax.tree.map(
        lambda x, row: x if row.padded_shape is None else x[tuple(slice(0, n) for n in row.shape)],
        tree,
        _rows_tree(layout),
    )


def shard(tree: Any, plan: Plan, mesh: Mesh) -> Any:
    """Places the arrays of ``tree`` (flax boxes are unboxed) on ``mesh`` as ``plan`` says (padded where a
    block-aligned plan pads).

    >>> import spmd, numpy as np
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> spmd.shard({"w": np.ones((2, 3))}, spmd.Plan(), mesh)["w"].sharding.spec
    P(None, None)
    """
    layout = plan.resolve(tree, mesh)
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), layout.specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    return jax.device_put(pad(unbox(tree), layout), shardings)


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
        staged: StagedModel | None = None,
        narrow: Callable[[Mapping[str, int]], Callable[[Any, Any], jax.Array]] | None = None,
    ) -> None:
        plan.check_mesh(mesh)
        if plan.pipeline is not None and staged is None:
            raise PlanError(
                f"the plan runs a pipeline ({plan.pipeline.describe()}), which needs the model cut into stages: "
                f"pass staged=model.staged (the built-in GPTs have one; see spmd.StagedModel for your own)"
            )
        self.loss_fn, self.optimizer, self.plan, self.mesh = loss_fn, optimizer, plan, mesh
        self.donate, self.staged = donate, staged
        self.pipeline: Pipeline | None = None
        self.uneven = UnevenData(loss_fn, plan.uneven, mesh) if plan.uneven is not None else None
        self.subnet: Subnetworks | None = None
        if plan.subnet is not None:
            if plan.subnet.masking == "forward" and narrow is None:
                raise PlanError(
                    "subnetwork data parallelism with forward masking runs each worker's narrowed model: pass "
                    "narrow=lambda kept: loss of the model narrowed to kept (spmd.models.narrowed does it for the "
                    "built-in GPTs), or use masking='backward'"
                )
            self.subnet = Subnetworks(plan.subnet, mesh, loss_fn, narrow)
        self.layout: StateLayout | None = None
        self.compiled: jax.stages.Compiled | None = None
        self._batch_shardings: Any = None
        self._converters: tuple | None = None  # conversions to and from the model's layout, made when needed

    # -- layout and init ----------------------------------------------------------------------------------
    def prepare(self, annotated_params: Any) -> StateLayout:
        """Applies the plan to (abstract, possibly annotated) parameters and the optimizer state they imply.

        A pipeline plan stores the stacked layers per stage (``[stage, chunk, layer, ...]``, see
        :class:`spmd.Pipeline`); :meth:`params_of` gives them back in the model's own layout."""
        trained = None
        if self.plan.pipeline is not None:
            self.pipeline = Pipeline(
                self.staged, self.plan.pipeline, self.mesh, layers=_layers(annotated_params, self.staged)
            )
            annotated_params = self.pipeline.stack(annotated_params)
        if self.subnet is not None:
            self.subnet.prepare(annotated_params)
            trained = self.subnet.own(annotated_params)
            if self.subnet.spec.masking == "forward":
                annotated_params, trained = trained, None
        layout = resolve_state(self.plan, annotated_params, self.optimizer, self.mesh, trained=trained)
        named = lambda specs: jax.tree.map(  # noqa: E731
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
        replicated = NamedSharding(self.mesh, PartitionSpec())
        state = TrainState(replicated, named(layout.params.specs), named(layout.opt_state.specs))
        self.layout = dataclasses.replace(layout, shardings=state, grad_shardings=named(layout.grads.specs))
        self.compiled = None
        self._converters = None
        return self.layout

    def initializer(self, init_fn: Callable[[jax.Array], Any], rng: jax.Array) -> Callable[[jax.Array], TrainState]:
        """The jitted function creating the training state in its sharded layout (see :meth:`init`)."""
        self.prepare(jax.eval_shape(init_fn, rng))

        def create(rng: jax.Array) -> TrainState:
            params = init_fn(rng)
            if self.pipeline is not None:
                params = self.pipeline.stack(params)
            trained = None
            if self.subnet is not None:
                trained = unbox(self.subnet.own(params))
                if self.subnet.spec.masking == "forward":
                    params, trained = trained, None
            params = pad(unbox(params), self.layout.params)
            opt_state = self.optimizer.init(params if trained is None else trained)
            return TrainState(jnp.zeros((), jnp.int32), params, opt_state)

        return jax.jit(create, out_shardings=self.layout.shardings)

    def init(self, init_fn: Callable[[jax.Array], Any], rng: jax.Array) -> TrainState:
        """Creates the training state directly in its sharded layout: each device computes only its own shards,
        so no device ever holds a full replica of a sharded parameter. ``init_fn(rng)`` returns the parameters,
        optionally with flax logical annotations."""
        return self.initializer(init_fn, rng)(rng)

    # -- the step -----------------------------------------------------------------------------------------
    def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
        # Block-aligned layouts store padded arrays: the model sees them sliced, so their gradients come back
        # padded with zeros and the padding never changes.
        with activate(self.plan, self.mesh):
            if self.pipeline is not None:
                params = unpad(state.params, self.layout.params)
                loss, grads = self.pipeline.value_and_grad(params, batch, data_axes=self.data_axes)
                grads = pad(grads, self.layout.params)
            elif self.uneven is not None:
                loss, grads = self.uneven.value_and_grad(unpad(state.params, self.layout.params), batch)
                grads = pad(grads, self.layout.params)
            elif self.subnet is not None and self.subnet.spec.masking == "backward":
                return self._backward_masked(state, batch)
            elif self.subnet is not None:
                loss, grads = self.subnet.value_and_grad(state.params, batch)
            else:
                loss_of_stored = lambda params: self.loss_fn(unpad(params, self.layout.params), batch)  # noqa: E731
                loss, grads = jax.value_and_grad(loss_of_stored)(state.params)
        # Gradients take their planned layout (the parameters', or ZeRO-2's split one) before the update, so the
        # compiler reduces them straight into it.
        grads = jax.lax.with_sharding_constraint(grads, self.layout.grad_shardings)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), loss

    def _backward_masked(self, state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
        # Every worker keeps the full parameters; the owners update their parts with the part's optimizer state,
        # and the updated parts are gathered back into the full parameters.
        with activate(self.plan, self.mesh):
            loss, grads, mine = self.subnet.full_value_and_grad(state.params, batch)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, mine)
        params = self.subnet.rebuild(optax.apply_updates(mine, updates))
        return TrainState(state.step + 1, params, opt_state), loss

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Batch axes that split no parameter: a pipeline runs manual over them and reduces once per step."""
        self._need_layout()
        split = {
            a for row in self.layout.params.leaves for e in row.spec if e for a in ((e,) if isinstance(e, str) else e)
        }
        return tuple(a for a in self.plan.batch_axes if a not in split and self.mesh.shape[a] > 1)

    def params_of(self, state: TrainState) -> Any:
        """The model's parameters from a training state: block-aligned padding sliced off."""
        self._need_layout()
        params = unpad(state.params, self.layout.params)
        if self.subnet is not None and self.subnet.spec.masking == "forward":
            return self.subnet.full(params)
        return params if self.pipeline is None else self.pipeline.unstack(params)

    # -- the model's own layout (what checkpoints hold) --------------------------------------------------
    @property
    def stores_model_layout(self) -> bool:
        """Whether the state holds every array in the model's own layout: no pipeline stacking, no per-worker
        copies of owned parts, no block padding."""
        self._need_layout()
        padded = self.layout.params.padded or self.layout.grads.padded
        return self.pipeline is None and self.subnet is None and not padded

    def to_model_layout(self, state: TrainState) -> TrainState:
        """The state in the model's own layout, whatever the plan: parameters as the model has them and each
        optimizer moment shaped like its parameter (padding sliced off, pipeline stages unstacked, each owned
        part taken from its first owner). A state saved so restores under any plan (:meth:`from_model_layout`)."""
        return state if self.stores_model_layout else self._conversions[0](state)

    def from_model_layout(self, state: TrainState) -> TrainState:
        """The inverse of :meth:`to_model_layout`: the state as this plan stores it, in its shardings."""
        return state if self.stores_model_layout else self._conversions[1](state)

    def model_layout_abstract(self) -> TrainState:
        """ShapeDtypeStructs (with shardings) of :meth:`to_model_layout`'s result: targets to restore into."""
        if self.stores_model_layout:
            return self.abstract_state()
        return self._conversions[2]

    @property
    def _conversions(self) -> tuple[Callable, Callable, TrainState]:
        if self._converters is None:
            self._converters = self._convert_to_and_from_model()
        return self._converters

    def _convert_to_and_from_model(self) -> tuple[Callable, Callable, TrainState]:
        abstract = self.abstract_state()
        owned = self.subnet is not None and self.subnet.spec.masking == "forward"
        # The optimizer's moments mirror what is trained: the stored parameters, or with backward masking the
        # owned parts (laid out like the gradients).
        trained_rows = self.layout.grads if self.subnet is not None and not owned else self.layout.params

        def model_of(tree: Any, rows: Layout, per_worker: bool) -> Any:
            tree = unpad(tree, rows)
            if per_worker:
                tree = self.subnet.full(tree)
            return tree if self.pipeline is None else self.pipeline.unstack(tree)

        def stored_of(tree: Any, rows: Layout, per_worker: bool) -> Any:
            if self.pipeline is not None:
                tree = unbox(self.pipeline.stack(tree))
            if per_worker:
                tree = self.subnet.own(tree)
            return pad(tree, rows)

        def convert(state: TrainState, like: Any, f: Callable) -> TrainState:
            moments = lambda tree: f(tree, trained_rows, self.subnet is not None)  # noqa: E731
            return TrainState(
                state.step, f(state.params, self.layout.params, owned), _map_like(moments, state.opt_state, like)
            )

        to_model = jax.jit(lambda s: convert(s, stored_abstract(trained_rows), model_of))
        compiled = to_model.lower(abstract).compile()
        target = jax.tree.map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(to_model, abstract),
            compiled.output_shardings,
        )
        from_model = jax.jit(lambda s: convert(s, target.params, stored_of), out_shardings=self.layout.shardings)
        return compiled, from_model, target

    def batch_shardings(self, batch: Any) -> Any:
        if self.uneven is not None:  # any batch size: the shares, not an even split, place its examples
            return jax.tree.map(lambda _: NamedSharding(self.mesh, PartitionSpec()), batch)
        return self.plan.batch_shardings(batch, self.mesh)

    def abstract_state(self) -> TrainState:
        """The training state as ShapeDtypeStructs carrying their shardings (for lowering without arrays)."""
        self._need_layout()
        rows = lambda layout, sh: jax.tree.map(  # noqa: E731
            lambda leaf, s: jax.ShapeDtypeStruct(leaf.stored_shape, leaf.dtype, sharding=s),
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
        return self.compiled(state, place(batch, self._batch_shardings))

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
    staged: StagedModel | None = None,
    narrow: Callable[[Mapping[str, int]], Callable[[Any, Any], jax.Array]] | None = None,
) -> TrainStep:
    """Builds a :class:`TrainStep` (see there for an example); a pipeline plan needs ``staged``, a subnetwork
    plan with forward masking ``narrow``."""
    return TrainStep(loss_fn, optimizer, plan, mesh, donate=donate, staged=staged, narrow=narrow)


def place(tree: Any, shardings: Any) -> Any:
    """Host arrays (the same global values on every process) as global arrays: on one process a ``device_put``;
    across processes each process hands over only the rows its own devices hold
    (``jax.make_array_from_process_local_data``).

    >>> import spmd, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> place({"x": np.arange(16.0)}, {"x": NamedSharding(mesh, P("data"))})["x"].shape
    (16,)
    """

    def one(x: Any, sharding: NamedSharding) -> jax.Array:
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        x = np.asarray(x)
        spans = [
            [s.indices(n)[:2] for s, n in zip(index, x.shape, strict=True)]
            for index in sharding.addressable_devices_indices_map(x.shape).values()
        ]
        local = tuple(slice(min(s[d][0] for s in spans), max(s[d][1] for s in spans)) for d in range(x.ndim))
        return jax.make_array_from_process_local_data(sharding, x[local], x.shape)

    return jax.tree.map(one, tree, shardings)


def _layers(annotated_params: Any, staged: StagedModel) -> int:
    """The number of stacked layers: the leading dimension of the arrays under ``staged.layers_key``."""
    try:
        sub = functools.reduce(lambda tree, k: tree[k], staged.layers_key, annotated_params)
    except (KeyError, TypeError):
        raise PlanError(f"pipeline: no stacked layers at {'/'.join(staged.layers_key)} in the parameters") from None
    leaves, _ = leaves_with_paths(sub)
    sizes = {leaf.shape[0] if leaf.shape else 0 for leaf in leaves}
    if len(sizes) != 1 or 0 in sizes:
        raise PlanError(f"pipeline: the arrays at {'/'.join(staged.layers_key)} must share a leading layer dimension")
    return sizes.pop()


def _map_like(f: Callable[[Any], Any], tree: Any, like: Any) -> Any:
    """Applies ``f`` to every subtree of ``tree`` with the structure and shapes of ``like`` (an optimizer
    state's moments mirror the parameters), leaving the rest (counts, schedules) as it is."""
    structure, shapes = jax.tree.structure(like), [np.shape(x) for x in jax.tree.leaves(like)]

    def mirrors(node: Any) -> bool:
        return jax.tree.structure(node) == structure and [np.shape(x) for x in jax.tree.leaves(node)] == shapes

    return jax.tree.map(lambda node: f(node) if mirrors(node) else node, tree, is_leaf=mirrors)


def _rows_tree(layout: Layout) -> Any:
    """The layout's rows in the specs' tree structure."""
    _, treedef = jax.tree.flatten(layout.specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.tree.unflatten(treedef, list(layout.leaves))
