"""A jitted, sharded training step built from a loss, an optimizer, a plan, a mesh and the model's parameters."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import subjaxprs
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd._accumulate import accumulated
from spmd._context import activate, initialising
from spmd._executor import Executor, Task, plain
from spmd._keys import BaseKey, StepKey, named
from spmd._layout import StateLayout, pad, resolve_state, unpad
from spmd._mesh import auto_twin, retyped, traced_auto
from spmd._offload import check_host_memory, offloaded, on_device, on_host
from spmd._plan import Plan
from spmd._precision import cast_params, check_compute, to_stored_dtype
from spmd._resolve import check_unused_axes
from spmd._rules import PlanError
from spmd._tree import unbox

if TYPE_CHECKING:
    from spmd._pipeline import StagedModel

__all__ = ["TrainState", "TrainStep", "place", "shard"]


class TrainState(NamedTuple):
    """What a training step carries from one step to the next: the step count, the parameters as the plan
    stores them, and the optimizer state.

    >>> TrainState(0, {"w": 1.0}, ()).params
    {'w': 1.0}
    """

    step: jax.Array
    params: Any
    opt_state: Any


def _named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _dtype(x: Any) -> Any:
    return getattr(x, "dtype", None) or jnp.result_type(x)


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs for the arrays of ``tree``, flax boxes (and their logical names) kept."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x)), tree)


def _signature(tree: Any) -> tuple:
    """What a compiled program depends on: the tree's structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), np.dtype(_dtype(x))) for x in leaves)


class TrainStep:
    """A training step whose inputs and outputs are laid out by a plan, built once for a model's parameters.

    ``loss_fn(params, batch) -> scalar``; ``params``: the model's parameters, abstract or not, optionally with
    flax logical annotations (``jax.eval_shape(model.init, key)``). The plan's execution mode is built once,
    and the layout of the whole training state resolved: nothing about the step changes afterwards. A pipeline
    plan needs ``staged`` (the model cut into stages), forward-masked subnetworks and uneven tensor shares ``narrow``.
    Parameters are created already sharded by :meth:`init`, the state buffers are donated, and gradients are
    constrained to their planned layout before the update. Each batch shape compiles once. With
    ``skip_nonfinite``, a step whose loss or gradients hold NaN or inf leaves the parameters and optimizer state
    as they were (the step count still advances, as the data has) and returns a NaN loss.

    A loss that draws random numbers (dropout) names them: ``loss_fn(params, batch, *, key, step)``, either
    keyword alone or both, read from its signature; ``key`` is ``jax.random.fold_in(seed, step)``, so each step
    draws other numbers and a sharded step draws what one device draws (see :mod:`spmd._keys`). Where the plan's
    execution calls the loss on parts of a batch (uneven data: its microbatches of the global batch in order;
    subnetworks: each worker's rows), part ``i`` gets ``fold_in(key, i)``; a reference computed on one device
    does the same.

    >>> import spmd, optax, jax, jax.numpy as jnp
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> n = mesh.shape["data"]
    >>> init = lambda rng: {"w": jax.random.normal(rng, (3, 2))}
    >>> step = spmd.TrainStep(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), optax.sgd(0.1),
    ...                       spmd.Plan(batch_axes=("data",)), mesh, params=jax.eval_shape(init, jax.random.key(0)))
    >>> state = step.init(init, jax.random.key(0))
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
        params: Any,
        donate: bool = True,
        staged: StagedModel | None = None,
        narrow: Callable[[Mapping[str, int]], Callable[[Any, Any], jax.Array]] | None = None,
        skip_nonfinite: bool = False,
        seed: int | jax.Array | None = None,
    ) -> None:
        plan.check_mesh(mesh)
        # The seed is configuration, as the model and the plan are, not state: the key of a step is a pure
        # function of (seed, step), the step count is in the training state, so a run restored from any
        # checkpoint (old ones included) with the same seed draws what the uninterrupted run would have drawn.
        self.base_key, self.draws = _randomness(loss_fn, seed)
        self.loss_fn, self.optimizer, self.plan, self.mesh, self.donate = loss_fn, optimizer, plan, mesh, donate
        # The step's arrays live on ``mesh`` (Explicit axes stay Explicit); its inside is traced over Auto axes.
        self.traced_mesh = auto_twin(mesh)
        self.skip_nonfinite = skip_nonfinite
        self.model_params = _abstract(params)  # the model's own layout, with its annotations
        task = Task(loss_fn, plan, self.traced_mesh, self.model_params, staged, narrow)
        built = plain(task) if plan.execution is None else plan.execution.executor(task)
        self.executor: Executor = accumulated(built, task, plan.accumulate)  # the gradient wrapped, if it asks
        if self.draws and not self.executor.keyed:
            raise TypeError(
                f"TrainStep: the loss takes key= or step=, but the plan's {plan.execution.describe()} does not call "
                f"loss_fn with them (its executor is not keyed; a pipeline runs staged=, whose functions take no "
                f"key): train the model with dropout under a plan without this mode, or turn its dropout off here"
            )
        stored = to_stored_dtype(self.executor.to_stored(self.model_params), plan.precision)
        trained = self.executor.to_trained(stored)
        self.layout: StateLayout = resolve_state(
            plan, stored, optimizer, mesh, trained=None if trained is stored else trained
        )
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_shardings = _named(mesh, self.layout.opt_state.specs)
        # An offloaded optimizer state lives in host memory between steps (created, donated, saved there); the
        # step moves it to the device for the update, and its outputs' shardings write it back.
        check_host_memory(mesh, plan.offload)
        self.offloads_optimizer = offloaded(plan.offload, "optimizer")
        if self.offloads_optimizer:
            opt_shardings = on_host(opt_shardings)
        self.shardings = TrainState(replicated, _named(mesh, self.layout.params.specs), opt_shardings)
        self._opt_on_device = on_device(_named(self.traced_mesh, self.layout.opt_state.specs))
        self.grad_shardings = _named(self.traced_mesh, self.layout.grads.specs)
        self.param_shardings = _named(self.traced_mesh, self.layout.params.specs)
        # Per batch signature: the program, the batch's shardings, and whether it rematerialises.
        self._compiled: dict[tuple, tuple[jax.stages.Compiled, Any, bool]] = {}
        check_unused_axes(plan, mesh, self.layout)  # once the step is built: a plan that fails says only why

    # -- the state ----------------------------------------------------------------------------------------
    def initializer(self, init_fn: Callable[[jax.Array], Any]) -> Callable[[jax.Array], TrainState]:
        """The jitted function creating the training state in its sharded layout from a key (see :meth:`init`)."""
        ex, layout = self.executor, self.layout

        def create(rng: jax.Array) -> TrainState:
            with initialising(self.plan, self.traced_mesh, self.model_params):
                created = init_fn(rng)
            stored = to_stored_dtype(ex.to_stored(created), self.plan.precision)
            params = pad(unbox(stored), layout.params)
            opt_state = self.optimizer.init(pad(unbox(ex.to_trained(stored)), layout.trained))
            return TrainState(jnp.zeros((), jnp.int32), params, opt_state)

        return jax.jit(traced_auto(create, self.mesh, self._specs()), out_shardings=self.shardings)

    def init(self, init_fn: Callable[[jax.Array], Any], rng: jax.Array) -> TrainState:
        """Creates the training state directly in its sharded layout: each device computes only its own shards,
        so no device ever holds a full replica of a sharded parameter. ``init_fn(rng)`` returns the parameters
        the step was built for (the same tree, shapes and dtypes), optionally with flax logical annotations."""
        with initialising(self.plan, self.traced_mesh, self.model_params):
            made = _signature(unbox(jax.eval_shape(init_fn, rng)))
        if made != _signature(unbox(self.model_params)):
            raise PlanError(
                "TrainStep.init: init_fn makes other parameters than the step was built for (params=); build the "
                "step from jax.eval_shape(init_fn, rng)"
            )
        return self.initializer(init_fn)(rng)

    def abstract_state(self) -> TrainState:
        """The training state as ShapeDtypeStructs carrying their shardings (for lowering without arrays)."""

        def rows(layout: Any, shardings: Any) -> Any:
            return jax.tree.map(
                lambda leaf, s: jax.ShapeDtypeStruct(leaf.stored_shape, leaf.dtype, sharding=s),
                layout.rows(),
                shardings,
                is_leaf=lambda x: hasattr(x, "bytes_per_device"),
            )

        sh = self.shardings
        return TrainState(
            jax.ShapeDtypeStruct((), jnp.int32, sharding=sh.step),
            rows(self.layout.params, sh.params),
            rows(self.layout.opt_state, sh.opt_state),
        )

    def _specs(self) -> TrainState:
        return jax.tree.map(lambda s: s.spec, self.shardings)

    def params_of(self, state: TrainState) -> Any:
        """The model's parameters from a training state, in the model's own layout (on the step's mesh)."""
        return self.on_auto_axes(lambda params: self.executor.to_model(unpad(params, self.layout.params)), state.params)

    def on_auto_axes(self, convert: Callable[[Any], Any], tree: Any) -> Any:
        """``convert(tree)`` run over the step's mesh with Auto axes, its result back on the step's mesh: for
        conversions of the state outside the step (a pipeline's stages unstacked, block padding sliced off),
        whose indexing a mesh with Explicit axes would ask to annotate array by array. Eager; no data moves
        for the relabelling (:func:`spmd._mesh.retyped`)."""
        return retyped(convert(retyped(tree, self.traced_mesh)), self.mesh)

    # -- the step -----------------------------------------------------------------------------------------
    def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
        ex, layout = self.executor, self.layout
        # Block-aligned layouts store padded arrays: the executor sees them sliced, so their gradients come back
        # padded with zeros and the padding never changes. A precision policy narrows each stored shard first
        # (before any all-gather); the executor never knows.
        stored = unpad(cast_params(state.params, self.plan.precision, self.param_shardings), layout.params)
        with activate(self.plan, self.traced_mesh):
            if self.draws:
                key = None if self.base_key is None else self.base_key.at(state.step)
                loss, grads = ex.value_and_grad(stored, batch, StepKey(key, state.step))
            else:
                loss, grads = ex.value_and_grad(stored, batch)
        # Gradients take their planned layout (the parameters', or ZeRO-2's split one) before the update, so the
        # compiler reduces them straight into it.
        trained = ex.to_trained(state.params)
        if self.plan.precision is not None:  # the optimizer updates the stored (master) dtype
            grads = jax.tree.map(lambda g, t: g.astype(_dtype(t)), grads, unpad(trained, layout.trained))
        grads = jax.lax.with_sharding_constraint(pad(grads, layout.trained), self.grad_shardings)
        kept = jax.device_put(state.opt_state, self._opt_on_device) if self.offloads_optimizer else state.opt_state
        updates, opt_state = self.optimizer.update(grads, kept, trained)
        params = ex.from_trained(optax.apply_updates(trained, updates))
        if self.skip_nonfinite:
            # Unlike optax.apply_if_finite, the loss counts too, and the optimizer state keeps its structure,
            # so a checkpoint resumes under either setting.
            finite = [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]
            ok = jnp.logical_and(jnp.isfinite(loss), jnp.all(jnp.stack(finite)) if finite else True)
            keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
            params, opt_state = jax.tree.map(keep, params, state.params), jax.tree.map(keep, opt_state, kept)
            loss = jnp.where(ok, loss, jnp.nan)  # a step skipped for its gradients alone says so too
        return TrainState(state.step + 1, params, opt_state), loss

    def batch_shardings(self, batch: Any) -> Any:
        """A ``NamedSharding`` per array of a global ``batch`` (arrays or ShapeDtypeStructs, each with a leading
        batch dimension): the leading dimension split over the plan's batch axes, the rest whole; or the whole
        array on every device when the executor takes its own share (uneven data parallelism, which takes any
        batch size). A batch size the batch axes do not divide is an error naming the multiple to use. Across
        processes, :func:`spmd.global_batch` builds the batch onto these shardings from each process's rows.

        >>> import spmd, optax, jax, numpy as np
        >>> mesh = spmd.make_mesh({"data": -1})
        >>> params = {"w": jax.ShapeDtypeStruct((3,), np.float32)}
        >>> step = spmd.TrainStep(lambda p, b: (b["x"] @ p["w"]).mean(), optax.sgd(0.1),
        ...                       spmd.Plan(batch_axes=("data",)), mesh, params=params)
        >>> step.batch_shardings({"x": jax.ShapeDtypeStruct((mesh.size, 3), np.float32)})["x"].spec
        P('data', None)
        """
        if not self.executor.splits_batch:
            return jax.tree.map(lambda _: NamedSharding(self.mesh, PartitionSpec()), batch)
        return self.plan.batch_shardings(batch, self.mesh)

    def lower(self, batch: Any) -> jax.stages.Lowered:
        """Lowers the step for a batch (arrays or ShapeDtypeStructs) without running it."""
        return self.trace(batch).lower()

    def trace(self, batch: Any) -> jax.stages.Traced:
        """Traces the step for a batch (arrays or ShapeDtypeStructs): its ``jaxpr`` shows what the program asks
        before the backend lowers it, such as the memory space of what it keeps (``f32<host>``, offloaded)."""
        shardings = self.batch_shardings(batch)
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), batch, shardings)
        jitted = jax.jit(
            traced_auto(self._step, self.mesh, (self._specs(), PartitionSpec())),
            in_shardings=(self.shardings, shardings),
            out_shardings=(self.shardings, NamedSharding(self.mesh, PartitionSpec())),
            donate_argnums=(0,) if self.donate else (),
        )
        return jitted.trace(self.abstract_state(), abstract)

    def compile(self, batch: Any) -> jax.stages.Compiled:
        """The step compiled for this batch's shapes and dtypes (compiled once per batch signature)."""
        return self._program(batch)[0]

    def rematerialises(self, batch: Any) -> bool:
        """Whether the step for this batch recomputes activations in its backward pass: a ``jax.checkpoint``
        (``nn.remat``, ``spmd.models.rematerialised``) anywhere in the traced program. What ``plan.remat`` asks is
        each layer rematerialised; a model that rematerialises only some part still counts as applying it.

        >>> import spmd, optax, jax, jax.numpy as jnp
        >>> params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
        >>> layer = lambda p, b: jnp.mean(jnp.tanh(b @ p["w"]))
        >>> plain = spmd.TrainStep(layer, optax.sgd(0.1), spmd.Plan(), spmd.make_mesh({"data": -1}), params=params)
        >>> remat = spmd.TrainStep(jax.checkpoint(layer), optax.sgd(0.1), spmd.Plan(), plain.mesh, params=params)
        >>> plain.rematerialises(jnp.ones((2, 4))), remat.rematerialises(jnp.ones((2, 4)))
        (False, True)
        """
        return self._program(batch)[2]

    def plan_carried_out(self, batch: Any) -> Plan:
        """The plan as the step for this batch carries it out: without ``remat`` when the model applies none
        (a third party's model that ignores the request keeps every layer's activations)."""
        if self.plan.remat and not self.rematerialises(batch):
            return dataclasses.replace(self.plan, remat=False)
        return self.plan

    def _program(self, batch: Any) -> tuple[jax.stages.Compiled, Any, bool]:
        key = _signature(batch)
        if key not in self._compiled:
            traced = self.trace(batch)
            check_compute(self.plan.precision, traced.jaxpr)
            self._compiled[key] = (traced.lower().compile(), self.batch_shardings(batch), recomputes(traced.jaxpr))
        return self._compiled[key]

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
        compiled, shardings, _ = self._program(batch)
        return compiled(state, place(batch, shardings))


def _randomness(loss_fn: Callable, seed: int | jax.Array | None) -> tuple[BaseKey | None, bool]:
    """The run's base key, and whether the step gives the loss a key or the step (checked against the loss)."""
    takes, requires = named(loss_fn)
    if seed is not None and "key" not in takes:
        raise TypeError(
            "TrainStep: seed= is given but the loss takes no key, so nothing would use it; give the loss a "
            "keyword-only key (loss_fn(params, batch, *, key, step)) or leave seed out"
        )
    if "key" in requires and seed is None:
        raise TypeError(
            "TrainStep: the loss requires key= but the step has no seed; build it with seed= (an int or a "
            "jax.random.key): each step's key is jax.random.fold_in(seed, step)"
        )
    return (None if seed is None else BaseKey.of(seed)), (seed is not None or "step" in takes)


def recomputes(jaxpr: Any) -> bool:
    """Whether a (closed) jaxpr, or one nested in it (a scan's body, a jitted call), holds a remat: the primitive
    ``jax.checkpoint`` leaves in a differentiated program."""
    inner = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
    if any(e.primitive.name in ("remat2", "checkpoint") for e in inner.eqns):
        return True
    return any(recomputes(sub) for sub in subjaxprs(inner))


def shard(tree: Any, plan: Plan, mesh: Mesh) -> Any:
    """Places the arrays of ``tree`` (flax boxes are unboxed) on ``mesh`` as ``plan`` says (padded where a
    block-aligned plan pads).

    >>> import spmd, numpy as np
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> spmd.shard({"w": np.ones((2, 3))}, spmd.Plan(), mesh)["w"].sharding.spec
    P(None, None)
    """
    layout = plan.resolve(tree, mesh)
    return jax.device_put(pad(unbox(tree), layout), _named(mesh, layout.specs))


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
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sharding)  # already global (spmd.global_batch): no host copy to slice
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
