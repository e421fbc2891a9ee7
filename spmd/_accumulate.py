"""Gradient accumulation: a step's batch run as K microbatches in a ``lax.scan``, gradients reduced once per step.

A plan with ``accumulate=K`` (:meth:`spmd.Plan.with_accumulation`) wraps the executor's gradient (a policy that
applies to every executor wraps the loss or the gradient, never the executor's inside). Microbatch ``j`` is rows
``i·K + j`` of the batch: each device's rows split locally into its share of every microbatch, so forming the
microbatches moves no data. The loss is the mean of the K equal microbatch means (the whole batch's mean), and a
loss that takes ``key=`` gets the step's key folded with the microbatch index ``j`` for microbatch ``j`` (then
folded again by an executor that calls the loss on parts of a microbatch), so a one-device reference that
accumulates the same way draws the same numbers. Such a loss is accumulated by the generic scan below (its draws
depend on the shapes it sees, and one device's rows inside a manual program would draw other numbers).

Why a manual reduction. Differentiated in a plain ``lax.scan`` under ``jit``, each microbatch's gradient is
reduced over the batch axes inside the loop: the compiled program runs the data-parallel all-reduce K times per
step, and XLA does not hoist it out of the loop. JAX's ``unreduced``/``reduced`` sharding types say "a partial
sum, not yet reduced", which is what an accumulator is, but they are types of *Explicit* mesh axes, and the
training step traces over Auto axes (:func:`spmd._mesh.traced_auto`), where layouts are the compiler's to
choose. So plain SPMD execution (no execution mode) computes the gradient in a ``jax.shard_map`` manual only
over the batch axes that split no parameter (as a pipeline does, :func:`spmd._pipeline._manual_axes`); axes that
split parameters (FSDP) and model axes stay Auto. Each device scans over its rows of the K microbatches,
accumulates its local gradients in float32 and returns the un-reduced sum, stacked on a new leading dimension
split over the manual axes. Outside, that dimension is summed and the training step constrains the result to the
gradients' planned layout: XLA emits one all-reduce per step (a reduce-scatter for ZeRO-2's split gradients).
Inside, activation constraints by logical name leave the manual axes out (:func:`spmd.constrain` does; flax's
logical rules are narrowed the same way); a model whose own bare ``PartitionSpec`` names a manual axis cannot
run there, and is accumulated by the generic scan below, with a :class:`spmd.PlanWarning` saying so.

Under FSDP the parameters are gathered for every microbatch (its forward and backward need them), so the
gathers run K times per step; the accumulator keeps the parameters' FSDP layout, so each microbatch's gradient
is reduce-scattered over the FSDP axes into it (K reduce-scatters per step, each of the whole gradient buffer)
rather than kept whole, which would cost a full unsharded float32 gradient per device; the reduction over the other
batch axes still runs once (measured in ``benchmarks/accumulation.py``).

Execution modes (pipelines, uneven data, subnetworks) run their own ``shard_map`` programs and reduce inside
them, so their gradient is accumulated by a plain scan over the executor's ``value_and_grad``: correct, but
reduced once per microbatch. A pipeline runs its whole schedule, with its own microbatches, K times per step.
Uneven shares are planned for one microbatch (``batch / K`` examples).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec

from spmd._executor import Executor, Task
from spmd._keys import StepKey, named
from spmd._rules import PlanError, PlanWarning, user_stacklevel

__all__ = [
    "accumulated",
    "check_accumulate",
    "check_batch",
    "free_batch_axes",
    "merged",
    "microbatches",
    "with_accumulation",
]


def check_accumulate(k: Any, api: str = "Plan.with_accumulation") -> int:
    """``k`` if it is a positive int (a bool is not), else a :class:`spmd.PlanError` naming ``api``.

    >>> check_accumulate(4)
    4
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PlanError(
            f"{api}: the number of microbatches to accumulate must be a positive integer, got {k!r}; "
            f"e.g. 4 (1 turns accumulation off)"
        )
    return k


def with_accumulation(plan: Any, k: int) -> Any:
    """``Plan.with_accumulation(k)``: each step runs its batch as ``k`` microbatches and accumulates their
    gradients, reduced once per step; the batch size must split into ``k`` microbatches the batch axes divide.
    The loss must be a mean over the batch's rows with equal weights (as the built-in losses are): the step's
    loss is the mean of the microbatches' (and, reduced once, of each device's), which is the whole batch's only
    then; a summed loss, or one weighted by a per-row count of tokens, is another loss under accumulation.

    >>> import spmd
    >>> spmd.Plan(batch_axes=("data",)).with_accumulation(4).describe()
    'batch over data; parameters replicated; gradients accumulated over 4 microbatches'
    """
    return dataclasses.replace(plan, accumulate=check_accumulate(k))


def merged(k: int, m: int) -> int:
    """The accumulation of two plans added together: one that accumulates wins; two different ones are an error.

    >>> merged(1, 4), merged(4, 4)
    (4, 4)
    """
    if k > 1 and m > 1 and k != m:
        raise PlanError(
            f"Plan + Plan: one plan accumulates gradients over {k} microbatches, the other over {m}; a step "
            f"accumulates once: keep one (e.g. plan.with_accumulation({max(k, m)}))"
        )
    return max(k, m)


def check_batch(rows: int, k: int, axes: Mapping[str, int]) -> None:
    """Raises unless a batch of ``rows`` splits into ``k`` microbatches each of which the batch ``axes``
    (name -> size) divide.

    >>> check_batch(32, 4, {"data": 8})
    >>> check_batch(16, 4, {"data": 8})
    Traceback (most recent call last):
    ...
    spmd._rules.PlanError: accumulate: a batch of 16 cannot be split into 4 microbatches ... multiple of 32 ...
    """
    n = math.prod(axes.values())
    if rows % (k * n):
        shown = " × ".join(f"{a}={s}" for a, s in axes.items()) or "none"
        raise PlanError(
            f"accumulate: a batch of {rows} cannot be split into {k} microbatches each of which the batch axes "
            f"({shown}, {n} devices) divide; make the batch size a multiple of {k * n} (accumulate × {n}), or "
            f"accumulate over a divisor of {rows // n if rows % n == 0 else rows}"
        )


def microbatches(batch: Any, k: int) -> Any:
    """Every array of ``batch`` as ``[k, rows / k, ...]``: microbatch ``j`` is rows ``i·k + j``, so each device's
    contiguous share of the rows holds its part of every microbatch.

    >>> microbatches({"x": jnp.arange(6)}, 2)["x"].tolist()
    [[0, 2, 4], [1, 3, 5]]
    """
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def free_batch_axes(task: Task) -> tuple[str, ...]:
    """The plan's batch axes (of more than one device) that split no parameter: the accumulating ``shard_map``
    runs manual over them.

    >>> import spmd, strategies, jax
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), "float32")}
    >>> plan = strategies.data_parallel() + strategies.fsdp(axis="fsdp")
    >>> free_batch_axes(Task(None, plan, {"data": 4, "fsdp": 2}, params))
    ('data',)
    """
    sizes = dict(task.mesh.shape) if hasattr(task.mesh, "shape") else dict(task.mesh)
    split = {a for row in _layout(task).leaves for a in row.axes}
    return tuple(a for a in task.plan.batch_axes if a not in split and sizes[a] > 1)


def _layout(task: Task) -> Any:
    """The parameters' layout under the plan. The training step resolves it again and warns there, once."""
    sizes = dict(task.mesh.shape) if hasattr(task.mesh, "shape") else dict(task.mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        return task.plan.resolve(task.params, sizes)


def accumulated(executor: Executor, task: Task, k: int) -> Executor:
    """``executor`` whose ``value_and_grad`` runs the batch as ``k`` microbatches and returns the whole batch's
    mean loss and gradients (see the module docstring). ``k == 1``: the executor itself.

    >>> import spmd, jax, jax.numpy as jnp
    >>> from spmd.execution import Task, plain
    >>> task = Task(lambda p, b: jnp.mean(b * p), spmd.Plan(), spmd.make_mesh({"data": -1}), jnp.ones(()))
    >>> loss, grad = accumulated(plain(task), task, 2).value_and_grad(jnp.float32(2.0), jnp.arange(4.0))
    >>> float(loss), float(grad)
    (3.0, 1.5)
    """
    k = check_accumulate(k, "accumulate")
    if k == 1:
        return executor
    # A loss that draws random numbers draws them for the shapes it sees: inside the manual program those are one
    # device's rows, which would draw other numbers than one device does, so it takes the generic scan.
    draws = "key" in named(task.loss)[0] if task.loss is not None else False
    manual = free_batch_axes(task) if task.plan.execution is None and not draws else ()
    if manual:
        value_and_grad = _reduced_once(executor.value_and_grad, task, k, manual)
    else:
        value_and_grad = _scanned(executor.value_and_grad, task, k, splits=executor.splits_batch)
        return executor._replace(value_and_grad=value_and_grad, costs=_costs(executor.costs, k))
    return executor._replace(value_and_grad=value_and_grad)


def _costs(costs: Callable, k: int) -> Callable:
    """An execution mode's cost model under accumulation: what it contributes for one microbatch, its traffic run
    ``k`` times (the scan runs the whole mode once per microbatch).

    >>> import jax, spmd
    >>> from spmd.costmodel import Contribution, Traffic, Workload
    >>> seen = lambda layout, batch, w: Contribution((Traffic("all-reduce", ("data",), w.batch, w.batch),), 1.0)
    >>> part = _costs(seen, 4)(None, {"x": jax.ShapeDtypeStruct((32, 2), "float32")}, Workload(32, 8))
    >>> part.traffic[0].bytes, part.traffic[0].count, part.activation_bytes
    (32, 4, 1.0)
    """

    def run(layout: Any, batch: Any, workload: Any) -> Any:
        shrink = lambda x: jax.ShapeDtypeStruct((x.shape[0] // k, *x.shape[1:]), x.dtype)  # noqa: E731
        micro = None if batch is None else jax.tree.map(shrink, batch)
        part = costs(layout, micro, dataclasses.replace(workload, batch=max(workload.batch // k, 1)))
        if part.traffic is None:
            return part
        times = lambda t: dataclasses.replace(  # noqa: E731
            t, bytes=t.bytes * k, traffic_bytes=t.traffic_bytes * k, count=t.count * k
        )
        return dataclasses.replace(part, traffic=tuple(map(times, part.traffic)))

    return run


def _check(batch: Any, k: int, task: Task, splits: bool) -> None:
    sizes = dict(task.mesh.shape)
    axes = {a: sizes[a] for a in task.plan.batch_axes} if splits else {}
    for x in jax.tree.leaves(batch):
        check_batch(x.shape[0], k, axes)


def _scan(
    value_and_grad: Callable, params: Any, micro: Any, draw: StepKey | None, k: int, layout: Callable = lambda g: g
) -> tuple[jax.Array, Any, Any]:
    """Sums, in float32, the loss and gradients of the ``k`` microbatches of ``micro`` (``layout`` keeps the
    accumulator in its place); also the gradients' abstract shapes (an executor may differentiate other arrays
    than the stored parameters: backward-masked subnetworks' own parts)."""

    def call(rows: Any, j: Any) -> tuple[jax.Array, Any]:
        return value_and_grad(params, rows) if draw is None else value_and_grad(params, rows, draw.fold(j))

    def one(carry: tuple, xs: tuple) -> tuple:
        j, rows = xs
        loss, grads = call(rows, j)
        total, acc = carry
        acc = layout(jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads))
        return (total + loss.astype(jnp.float32), acc), None

    shapes = jax.eval_shape(call, jax.tree.map(lambda x: x[0], micro), 0)[1]
    zeros = layout(jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.float32), shapes))
    (total, acc), _ = jax.lax.scan(one, (jnp.zeros((), jnp.float32), zeros), (jnp.arange(k), micro))
    return total, acc, shapes


def _scanned(value_and_grad: Callable, task: Task, k: int, *, splits: bool) -> Callable:
    """The generic accumulation: a scan over the executor's own ``value_and_grad`` (its reductions inside)."""

    # Over the scan's microbatch dimension, each microbatch keeps the batch's layout (its rows, and under
    # context parallelism its sequence).
    def sharding(x: jax.Array) -> NamedSharding:
        return NamedSharding(task.mesh, PartitionSpec(None, *(task.plan.batch_spec(x.ndim) if splits else ())))

    def run(params: Any, batch: Any, draw: StepKey | None = None) -> tuple[jax.Array, Any]:
        _check(batch, k, task, splits)
        micro = jax.lax.with_sharding_constraint(microbatches(batch, k), jax.tree.map(sharding, batch))
        total, acc, shapes = _scan(value_and_grad, params, micro, draw, k)
        grads = jax.tree.map(lambda a, g: (a / k).astype(_result_dtype(task, g)), acc, shapes)
        return (total / k).astype(jnp.float32), grads

    return run


def _reduced_once(value_and_grad: Callable, task: Task, k: int, manual: Sequence[str]) -> Callable:
    """Plain execution's accumulation: manual over ``manual``, local sums out, one reduction per step."""
    shards = math.prod(task.mesh.shape[a] for a in manual)
    lead = manual[0] if len(manual) == 1 else tuple(manual)
    specs = _auto_specs(task, set(manual))

    def body(params: Any, micro: Any, draw: StepKey | None) -> tuple[jax.Array, Any]:
        context = jax.sharding.get_abstract_mesh()

        def layout(tree: Any) -> Any:  # the accumulator keeps the parameters' layout over the Auto axes (FSDP)
            place = lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(context, s))  # noqa: E731
            return jax.tree.map(place, tree, specs)

        with nn.logical_axis_rules(_without_axes(nn.get_logical_axis_rules(), set(manual))):
            total, acc, _ = _scan(value_and_grad, params, micro, draw, k, layout if specs is not None else lambda g: g)
        # Each device's loss is the mean over its own rows: the whole batch's mean is the mean over the shards.
        # The one reduction runs in the precision policy's ``reduce`` dtype (float32 without one): the partial
        # sums are cast before they leave the device.
        scale, wire = 1.0 / (k * shards), _reduce_dtype(task)
        return (total * scale)[None], jax.tree.map(lambda a: (a * scale).astype(wire)[None], acc)

    generic = _scanned(value_and_grad, task, k, splits=True)

    def run(params: Any, batch: Any, draw: StepKey | None = None) -> tuple[jax.Array, Any]:
        _check(batch, k, task, True)
        try:
            return manual_run(params, batch, draw)
        except ValueError as e:  # the model's own constraint names a manual axis (a bare PartitionSpec over one)
            if "Auto axes" not in str(e) and "Manual" not in str(e):
                raise
            warnings.warn(
                f"gradient accumulation: the model constrains a layout over the batch axes {list(manual)} itself "
                f"({str(e).splitlines()[0][:160]}), which a program manual over them cannot take; its gradients "
                f"are reduced once per microbatch instead of once per step. Constrain activations by logical "
                f"names (spmd.constrain, flax's logical constraints) to reduce once",
                PlanWarning,
                stacklevel=user_stacklevel(),
            )
            return generic(params, batch, draw)

    def manual_run(params: Any, batch: Any, draw: StepKey | None) -> tuple[jax.Array, Any]:
        rows = PartitionSpec(None, lead)
        local = jax.shard_map(
            body,
            mesh=task.mesh,
            in_specs=(PartitionSpec(), rows, PartitionSpec()),
            out_specs=(PartitionSpec(lead), PartitionSpec(lead)),
            axis_names=set(manual),
            check_vma=False,
        )
        total, acc = local(params, microbatches(batch, k), draw)
        # Summing the dimension split over the manual axes is the step's one reduction; the training step
        # constrains the result to the gradients' layout, so it lands there directly (all-reduce, reduce-scatter).
        grads = jax.tree.map(lambda a, p: jnp.sum(a, axis=0).astype(_result_dtype(task, p)), acc, params)
        return jnp.sum(total), grads

    return run


def _reduce_dtype(task: Task) -> Any:
    """The dtype of the once-per-step reduction: the precision policy's ``reduce``, else float32."""
    return jnp.float32 if task.plan is None or task.plan.precision is None else task.plan.precision.reduce


def _result_dtype(task: Task, like: Any) -> Any:
    """The accumulated gradients' dtype: the parameters' (the model's) without a precision policy; with one, the
    accumulator's own float32 (the step casts it to the stored master dtype), not the compute dtype the
    microbatches ran in, which would round the accumulated sum away."""
    if task.plan is not None and task.plan.precision is not None:
        return jnp.promote_types(jnp.float32, _reduce_dtype(task))
    return jnp.result_type(like)


def _without_axes(rules: Sequence[tuple[str, Any]], manual: set[str]) -> list[tuple[str, Any]]:
    """flax's logical rules with the manual axes left out: inside the program each device holds its own rows, so
    a logical constraint (flax's ``with_logical_constraint``) may name only the other axes.

    >>> _without_axes([("batch", ("data", "fsdp")), ("mlp", "tensor"), ("embed", "data")], {"data"})
    [('batch', 'fsdp'), ('mlp', 'tensor'), ('embed', None)]
    """
    out = []
    for name, axes in rules:
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a not in manual)
        out.append((name, None if not kept else kept[0] if len(kept) == 1 else kept))
    return out


def _auto_specs(task: Task, manual: set[str]) -> Any:
    """The parameters' specs without the manual axes (None when no parameter is split at all, or block alignment
    pads one: the accumulator then takes whatever layout the compiler gives it)."""
    layout = _layout(task)
    if not any(row.axes for row in layout.leaves) or any(row.padded_shape for row in layout.leaves):
        return None

    def drop(spec: PartitionSpec) -> PartitionSpec:
        kept = [tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a not in manual) for e in spec]
        return PartitionSpec(*[None if not e else e[0] if len(e) == 1 else e for e in kept])

    return jax.tree.map(drop, layout.specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
