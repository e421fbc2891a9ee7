"""The execution seam: one small interface for every way of computing a step's loss and gradients.

Plain SPMD execution, pipelines, uneven data shares and subnetworks differ in one thing: how the stored
parameters relate to the model's, and how a step's loss and gradients are computed from them. An
:class:`Executor` is that difference as a value of pure functions, as optax's ``GradientTransformation`` is two.
The plan picks one once (its execution spec builds it for a :class:`Task`); the training step, checkpoints, the
report and the cost model call the interface and never ask which mode runs.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from spmd._keys import StepKey, call_loss
from spmd.costmodel import Contribution, Workload

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from spmd._layout import StateLayout
    from spmd._pipeline import StagedModel
    from spmd._plan import Plan

__all__ = ["Executor", "Summary", "Task", "identity", "plain"]


def identity(tree: Any) -> Any:
    """The tree itself: the default of every conversion of an :class:`Executor`.

    >>> identity({"w": 1})
    {'w': 1}
    """
    return tree


class Summary(NamedTuple):
    """What an execution mode adds to the report: its figures under ``kind`` (a key of the report's JSON) and
    one line for the terminal.

    >>> Summary("pipeline", {"ticks": 11}, "pipeline: 11 ticks").figures["ticks"]
    11
    """

    kind: str
    figures: Mapping[str, Any]
    text: str


class Task(NamedTuple):
    """What an executor is built for: the model's ``loss(params, batch)`` (which may also take ``key=`` and
    ``step=``: call it with :func:`spmd.execution.call_loss`), the plan and mesh, the model's
    abstract (possibly annotated) parameters in its own layout, and the model's optional cut forms — ``staged``
    (embeddings, one stacked layer, head: for pipelines) and ``narrow(kept) -> loss`` (the loss of the model
    narrowed to ``kept`` groups per logical dimension, ``{}`` keeping the whole model: for subnetworks with
    forward masking; and widened to padded sizes, for uneven tensor shares).

    >>> import spmd, jax
    >>> params = {"w": jax.ShapeDtypeStruct((2,), "float32")}
    >>> task = Task(lambda p, b: 0.0, spmd.Plan(), spmd.make_mesh({"data": -1}), params)
    >>> task.staged is None
    True
    """

    loss: Callable[[Any, Any], jax.Array]
    plan: Plan
    mesh: Mesh
    params: Any
    staged: StagedModel | None = None
    narrow: Callable[[Mapping[str, int]], Callable[[Any, Any], jax.Array]] | None = None


def _no_costs(layout: StateLayout, batch: Any, workload: Workload) -> Contribution:
    return Contribution()


def _no_summary(layout: StateLayout, batch: Any) -> Summary | None:
    return None


class Executor(NamedTuple):
    """One way of computing a training step's loss and gradients.

    - ``value_and_grad(stored, batch) -> (loss, grads)``: the mean loss of the batch and the gradients of the
      arrays the optimizer updates (``to_trained(stored)``), in their stored layout;
    - ``keyed``: whether ``value_and_grad`` also takes the step's :class:`spmd.execution.StepKey` (a third argument,
      given when the loss takes ``key=`` or ``step=``) and passes it on with :func:`spmd.execution.call_loss`, folding
      in the index of each part of the batch it calls the loss on. A step whose loss draws refuses an executor
      that is not keyed, rather than drop the key;
    - ``to_stored(params)`` / ``to_model(stored)``: the model's parameters as stored, and back. ``to_stored``
      and ``to_trained`` also take boxed or abstract trees: the plan lays out what they return, and the logical
      names they add (as flax boxes: ``stage``, ``worker``) go to the axes the execution spec names;
    - ``to_trained(stored)``: what the optimizer updates (the stored parameters, but for backward masking each
      worker's parts) and ``from_trained(updated)``: the stored parameters from the updated arrays;
    - ``splits_batch``: whether the batch is split over the plan's batch axes (False: every device receives it
      whole, and the executor takes its own share);
    - ``costs(layout, batch, workload)``: what the mode changes in the cost model (:class:`spmd.costmodel.
      Contribution`); ``summary(layout, batch)``: its figures for the report, or None;
    - ``branch_weights``: for named scopes of switches in the compiled program, how often each branch runs,
      and for a named loop whose bound each device reads for itself, one weight: the busiest device's trip
      count (the report weighs the collectives and FLOPs inside by them);
    - ``position_weights``: for a mode that gives the positions of its axis uneven work, one set of branch
      weights per position, with which the compiled counts are that position's own (the report's
      ``compiled_flops_by_position``: a slow device's fewer units or iterations);
    - ``engine``: the object implementing the mode, for inspection (a pipeline's tick table, say).

    Everything but ``value_and_grad`` has a default, so plain differentiation is one line:

    >>> import spmd, optax, jax, jax.numpy as jnp
    >>> ex = Executor(jax.value_and_grad(lambda p, b: jnp.sum(p["w"] * b)))
    >>> loss, grads = ex.value_and_grad({"w": jnp.ones(2)}, jnp.arange(2.0))
    >>> float(loss), grads["w"].tolist(), ex.to_model is identity
    (1.0, [0.0, 1.0], True)
    """

    value_and_grad: Callable[[Any, Any], tuple[jax.Array, Any]]
    to_stored: Callable[[Any], Any] = identity
    to_model: Callable[[Any], Any] = identity
    to_trained: Callable[[Any], Any] = identity
    from_trained: Callable[[Any], Any] = identity
    splits_batch: bool = True
    keyed: bool = False
    costs: Callable[[StateLayout, Any, Workload], Contribution] = _no_costs
    summary: Callable[[StateLayout, Any], Summary | None] = _no_summary
    branch_weights: Mapping[str, tuple[float, ...]] = types.MappingProxyType({})
    position_weights: tuple[Mapping[str, tuple[float, ...]], ...] = ()
    engine: Any = None

    @property
    def keeps_model_layout(self) -> bool:
        """Whether stored parameters and trained arrays are the model's own, with no conversion: every
        conversion is the default :func:`identity` (the function itself, so checkpoints skip converting).

        >>> plain(Task(lambda p, b: 0.0, None, None, None)).keeps_model_layout
        True
        """
        return all(f is identity for f in (self.to_stored, self.to_model, self.to_trained, self.from_trained))


def plain(task: Task) -> Executor:
    """Plain SPMD execution: the loss differentiated as it is; the plan's shardings do the rest.

    >>> import jax.numpy as jnp
    >>> ex = plain(Task(lambda p, b: jnp.sum(p * b), None, None, None))
    >>> ex.value_and_grad(jnp.ones(2), jnp.arange(2.0))[1].tolist()
    [0.0, 1.0]
    """

    def value_and_grad(stored: Any, batch: Any, draw: StepKey | None = None) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(lambda p: call_loss(task.loss, p, batch, draw))(stored)

    return Executor(value_and_grad, keyed=True)
