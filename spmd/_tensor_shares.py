"""Uneven tensor parallelism (HAP): heads and hidden units divided over the tensor axis by device speed.

JAX has no uneven sharding, so every array a rule splits along a unit dimension (``mlp``, ``heads``) is stored
padded: position ``j`` of the tensor axis holds its ``units[j]`` real units first, then zeros up to the most any
position holds, and the tensor axis splits the padded dimension evenly. A block that sums over those units (an
MLP: ``wi`` -> GELU -> ``wo``; attention: the heads' projections, attention and ``out``) runs through
:func:`unit_sum`: inside a ``shard_map`` over the tensor axis, a switch on the device's position runs the block
on its own units only (a static slice per branch), so a slow device really computes fewer units, and the
partial sums meet in one ``psum`` outside the switch (collectives inside branches that devices take differently
would never complete). The padding is zero and its gradient is zero, so it stays zero under any optimizer
whose update of a zero gradient is zero (SGD, Adam, weight decay), and the step equals one device's.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from spmd._executor import Executor, Summary, Task
from spmd._keys import StepKey, call_loss, named
from spmd._resolve import PlanWarning
from spmd._rules import PlanError
from spmd._tree import is_box, key_name

if TYPE_CHECKING:
    from spmd._layout import StateLayout
    from spmd._specs import TensorShares

__all__ = ["UNITS_SCOPE", "UnevenTensor", "tensor_shares_executor", "unit_sum"]

UNITS_SCOPE = "spmd_tensor_units"  # the switch over a device's own units, named for the compiled program's counts
# How many unit blocks the loss being traced ran through unit_sum (None: nobody is counting).
_BLOCKS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("spmd_unit_blocks", default=None)


def _active() -> tuple[TensorShares, Any] | None:
    """The active plan's uneven tensor shares and the mesh to run on; None when the plan has none."""
    from spmd._context import active

    current = active()
    if current is None or not getattr(current[0].execution, "splits_units", False):
        return None
    context = jax.sharding.get_abstract_mesh()
    return current[0].execution, current[1] if context.empty else context


def unit_sum(
    fn: Callable[..., jax.Array], x: jax.Array, weights: Sequence[jax.Array], dims: Sequence[int], name: str
) -> jax.Array:
    """``fn(x, *weights)`` for a block whose output is a sum over the units of logical dimension ``name``
    (``"mlp"``: hidden units, ``"heads"``), which each weight carries along ``dims[i]``: an MLP's ``wi``
    (dimension 1) and ``wo`` (dimension 0), attention's projections. Under a plan with uneven tensor shares
    (:class:`spmd.execution.TensorShares`) each device of the tensor axis runs ``fn`` on its own units of its
    padded shard and the partial sums are added over the axis; otherwise it is ``fn(x, *weights)``. A model of
    your own calls it around each such block to take uneven tensor parallelism.

    >>> import jax.numpy as jnp
    >>> x, wi, wo = jnp.ones((2, 4)), jnp.ones((4, 8)), jnp.ones((8, 4))
    >>> unit_sum(lambda x, wi, wo: (x @ wi) @ wo, x, (wi, wo), (1, 0), "mlp")[0].tolist()  # no plan: as it is
    [32.0, 32.0, 32.0, 32.0]
    """
    current = _active()
    if current is None or name not in current[0].names:
        return fn(x, *weights)
    if len(weights) != len(dims):
        raise ValueError(f"spmd.unit_sum: {len(weights)} weights and {len(dims)} dims; give each weight its units' dim")
    spec, mesh = current
    counted = _BLOCKS.get()
    if counted is not None:
        counted.append(name)
    units = spec.of(name)
    padded = max(units)
    ways = len(units)
    for w, d in zip(weights, dims, strict=True):
        if w.shape[d] != ways * padded:
            raise PlanError(
                f"spmd.unit_sum: a weight of shape {w.shape} has {w.shape[d]} {name} units along dimension {d}, "
                f"and the plan stores {ways} × {padded} (units {list(units)} padded to the most): give the model "
                f"the padded sizes (the executor's narrow does) and name the units' dimension in dims"
            )
    axis = spec.axis

    def branch(count: int, x: jax.Array, *local: jax.Array) -> jax.Array:
        own = [jax.lax.slice_in_dim(w, 0, count, axis=d) for w, d in zip(local, dims, strict=True)]
        return fn(x, *own)

    def body(x: jax.Array, *local: jax.Array) -> jax.Array:
        branches = [functools.partial(branch, count) for count in units]
        with jax.named_scope(UNITS_SCOPE):  # lets the compiled program's counts weigh it (see the executor)
            partial = jax.lax.switch(jax.lax.axis_index(axis), branches, x, *local)
        return jax.lax.psum(partial, axis)

    specs = [
        PartitionSpec(*[axis if i == d else None for i in range(w.ndim)]) for w, d in zip(weights, dims, strict=True)
    ]
    run = jax.shard_map(
        body, mesh=mesh, in_specs=(PartitionSpec(), *specs), out_specs=PartitionSpec(), axis_names={axis}
    )
    return run(x, *weights)


class UnevenTensor:
    """The stored layout of uneven tensor shares for one model: which arrays carry units along which
    dimension, and the conversions between the model's layout and the padded one.

    >>> import jax, spmd
    >>> from spmd import models
    >>> from spmd.execution import TensorShares
    >>> params = jax.eval_shape(models.get("gpt-tiny").init, jax.random.key(0))
    >>> engine = UnevenTensor(TensorShares("tensor", (("heads", (3, 1)), ("mlp", (171, 85)))), params)
    >>> engine.padded_sizes, engine.to_stored(params)["params"]["layers"]["mlp"]["wi"]["kernel"].value.shape
    ({'heads': 6, 'mlp': 342}, (8, 64, 342))
    """

    def __init__(self, spec: TensorShares, params: Any) -> None:
        self.spec, self.abstract = spec, params
        flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)
        self.dims: dict[str, tuple[str, int]] = {}  # path -> (unit name, dimension)
        sizes: dict[str, int] = {}
        for path, x in flat:
            logical = tuple(x.names) if is_box(x) and hasattr(x, "names") else ()
            found = [(n, logical.index(n)) for n in spec.names if n in logical]
            if not found:
                continue
            unit, dim = found[0]
            key = "/".join(key_name(k) for k in path)
            self.dims[key] = (unit, dim)
            size = np.shape(x.value)[dim]
            if sizes.setdefault(unit, size) != size:
                raise PlanError(
                    f"uneven tensor shares: {key} has {size} {unit} units and an earlier array {sizes[unit]}; "
                    f"the arrays naming {unit!r} must agree on its size"
                )
        for unit in spec.names:
            total = sum(spec.of(unit))
            if sizes.get(unit) != total:
                raise PlanError(
                    f"uneven tensor shares: the plan divides {total} {unit} units ({list(spec.of(unit))}) and the "
                    f"model has {sizes.get(unit, 0)}; plan the shares for this model (strategies.hetero."
                    f"tensor_units)"
                )

    @property
    def padded_sizes(self) -> dict[str, int]:
        """Units of each name in the padded layout: the tensor axis's positions times the most one holds."""
        return {n: len(self.spec.of(n)) * max(self.spec.of(n)) for n in self.spec.names}

    def _index(self, unit: str) -> np.ndarray:
        """For each padded unit, the model's unit it holds, or -1 for padding."""
        units = self.spec.of(unit)
        starts, most = np.concatenate([[0], np.cumsum(units)]), max(units)
        index = np.full((len(units), most), -1)
        for j, count in enumerate(units):
            index[j, :count] = np.arange(starts[j], starts[j] + count)
        return index.reshape(-1)

    def _map(self, f: Callable[[str, Any], Any], tree: Any) -> Any:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)
        return jax.tree_util.tree_unflatten(treedef, [f("/".join(key_name(k) for k in p), x) for p, x in flat])

    def to_stored(self, params: Any) -> Any:
        """The model's parameters (boxed, plain or abstract) padded: each position's units, then zeros."""

        def pad(v: jax.Array, unit: str, dim: int) -> jax.Array:
            index = self._index(unit)
            taken = jnp.take(v, np.maximum(index, 0), axis=dim)
            keep = (index >= 0).reshape([-1 if i == dim else 1 for i in range(v.ndim)])
            return jnp.where(keep, taken, jnp.zeros((), v.dtype))

        def one(path: str, x: Any) -> Any:
            if path not in self.dims:
                return x
            f = functools.partial(pad, unit=self.dims[path][0], dim=self.dims[path][1])
            value = x.value if is_box(x) else x
            value = jax.eval_shape(f, value) if isinstance(value, jax.ShapeDtypeStruct) else f(value)
            return x.replace(value=value) if is_box(x) else value

        return self._map(one, params)

    def to_model(self, stored: Any) -> Any:
        """The model's layout from the padded one: each position's real units, in order."""

        def one(path: str, x: Any) -> Any:
            if path not in self.dims:
                return x
            unit, dim = self.dims[path]
            index = self._index(unit)
            return jnp.take(x, np.flatnonzero(index >= 0), axis=dim)

        return self._map(one, stored)

    @property
    def busiest(self) -> dict[str, tuple[float, ...]]:
        """Branch weights for the compiled program's counts: each unit switch counted as the position holding
        the most units of any name runs it (its FLOPs are the cost model's per device)."""
        units = [self.spec.of(n) for n in self.spec.names]
        # One scope names every unit switch: weigh the position with the most units in all.
        j = int(np.argmax(np.sum(units, axis=0)))
        return {UNITS_SCOPE: tuple(float(i == j) for i in range(len(units[0])))}

    def device_weights(self, position: int) -> dict[str, tuple[float, ...]]:
        """Branch weights with which the compiled program's counts are position ``position``'s own."""
        ways = len(self.spec.of(self.spec.names[0]))
        return {UNITS_SCOPE: tuple(float(i == position) for i in range(ways))}

    def summary(self, layout: StateLayout, batch: Any) -> Summary:
        units = {n: list(self.spec.of(n)) for n in self.spec.names}
        text = ", ".join(f"{n} {u} (stored {max(u)} each)" for n, u in units.items())
        figures = {"axis": self.spec.axis, "units": units, "padded_units": self.padded_sizes}
        return Summary("tensor_shares", figures, f"uneven tensor shares over {self.spec.axis}: {text}")


def tensor_shares_executor(spec: TensorShares, task: Task) -> Executor:
    """The executor of uneven tensor shares: the model widened to the padded units (``task.narrow``), its
    parameters stored padded, and each unit block run through :func:`unit_sum`.

    >>> import dataclasses, jax, spmd, strategies
    >>> from spmd import models
    >>> from spmd.execution import TensorShares
    >>> model = models.get("gpt-tiny", layers=2)
    >>> spec = TensorShares("tensor", (("heads", (3, 1)), ("mlp", (171, 85))))
    >>> plan = dataclasses.replace(strategies.tensor_parallel(), execution=spec)
    >>> task = spmd.execution.Task(models.loss_fn(model), plan, spmd.make_mesh({"tensor": 2, "data": -1}),
    ...     jax.eval_shape(model.init, jax.random.key(0)), narrow=lambda s: models.loss_fn(models.narrowed(model, s)))
    >>> ex = tensor_shares_executor(spec, task)
    >>> ex.engine.padded_sizes, len(ex.position_weights)  # each position's counts for the report
    ({'heads': 6, 'mlp': 342}, 2)
    """
    if task.narrow is None:
        raise PlanError(
            "uneven tensor shares run the model at its padded sizes: pass TrainStep(..., narrow=lambda sizes: loss "
            "of the model with those sizes) (spmd.models.narrowed does it for the built-in GPTs)"
        )
    ways = len(spec.of(spec.names[0]))
    if spec.axis not in task.mesh.shape:
        raise PlanError(
            f"uneven tensor shares over {spec.axis!r}, and the mesh has no such axis ({dict(task.mesh.shape)}); "
            f"add it with {ways} devices"
        )
    if task.mesh.shape[spec.axis] != ways:
        raise PlanError(
            f"uneven tensor shares: {ways} positions of {spec.axis!r}, and the mesh has "
            f"{task.mesh.shape[spec.axis]}; give one share per position"
        )
    engine = UnevenTensor(spec, task.params)
    _require_split(task.plan, engine, task.mesh)
    loss_fn = task.narrow(engine.padded_sizes)
    keyed = named(loss_fn)[0] >= named(task.loss)[0]

    def value_and_grad(stored: Any, batch: Any, draw: StepKey | None = None) -> tuple[jax.Array, Any]:
        blocks: list[str] = []
        token = _BLOCKS.set(blocks)
        try:
            out = jax.value_and_grad(lambda p: call_loss(loss_fn, p, batch, draw))(stored)
        finally:
            _BLOCKS.reset(token)
        missing = sorted(set(spec.names) - set(blocks))
        if missing:  # the padded units would be computed in full on every device: nothing uneven would run
            # A warning, not an error: a body JAX traced once before (a cached lax.scan body) runs no Python.
            warnings.warn(
                f"uneven tensor shares: tracing the model ran no block over {missing} through spmd.unit_sum, so "
                f"unless a cached trace of it did, every device computes all the padded units; compute its "
                f"attention and MLP blocks with spmd.unit_sum (the built-in GPTs do), or keep the tensor axis even "
                f"(--even)",
                PlanWarning,
                stacklevel=2,
            )
        return out

    return Executor(
        value_and_grad,
        to_stored=engine.to_stored,
        to_model=engine.to_model,
        keyed=keyed,
        summary=engine.summary,
        branch_weights=engine.busiest,
        position_weights=tuple(engine.device_weights(j) for j in range(task.mesh.shape[spec.axis])),
        engine=engine,
    )


def _require_split(plan: Any, engine: UnevenTensor, mesh: Any) -> None:
    """Every array carrying the shares' units is split over the axis along those units (each device holds its
    own padded block), or the padded arrays would be stored whole and resharded at every block: refused."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        rows = plan.resolve(engine.to_stored(engine.abstract), mesh).leaves
    for row in rows:
        if row.path in engine.dims and row.spec[engine.dims[row.path][1]] != engine.spec.axis:
            unit, dim = engine.dims[row.path]
            raise PlanError(
                f"uneven tensor shares: {row.path} carries {unit} units along dimension {dim}, and the plan lays "
                f"that dimension out as {row.spec[dim]!r}, not over {engine.spec.axis!r} alone; split it with "
                f"tensor parallelism's rules (strategies.tensor_parallel)"
            )
