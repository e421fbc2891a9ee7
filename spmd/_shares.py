"""Uneven data parallelism inside one SPMD program: each device runs its own number of microbatches.

JAX has no uneven sharding, so the batch goes to the devices as a padded buffer, ``[devices, longest share,
...]``, and inside a ``shard_map`` over the data axis every device loops ``lax.fori_loop(0, loops[i], ...)`` with
its own bound read by ``axis_index``: a slow device really does less work. Each microbatch's gradient is
weighted by its share of the global batch and the sum is reduced once, so the result is the gradient of the
whole batch's mean loss, whatever the split. A loss that draws random numbers gets, for the ``k``-th microbatch
of the global batch (rows ``k·microbatch`` on, in order), the step's key folded with ``k``: the draws follow
the data, not the devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from spmd._context import constrain
from spmd._executor import Executor, Task
from spmd._keys import StepKey, call_loss
from spmd._rules import PlanError
from spmd.axes import BATCH

if TYPE_CHECKING:
    from spmd._specs import Shares

__all__ = ["UnevenData", "uneven_executor"]

LOOP_SCOPE = "spmd_uneven_loop"  # the loop over a device's own microbatches, named for the compiled program's counts


class UnevenData:
    """Loss and gradients of a batch split over ``spec.axis`` by ``spec.shares``.

    >>> import spmd, jax, jax.numpy as jnp
    >>> from spmd.execution import Shares
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> shares = Shares("data", (3,) + (1,) * (mesh.size - 1))
    >>> engine = UnevenData(lambda p, b: jnp.mean(b["x"] * p), shares, mesh)
    >>> loss, grad = engine.value_and_grad(jnp.ones(()), {"x": jnp.arange(shares.batch, dtype=jnp.float32)})
    >>> float(grad) == float(jnp.mean(jnp.arange(shares.batch)))
    True
    """

    def __init__(self, loss_fn: Callable[[Any, Any], jax.Array], spec: Shares, mesh: Mesh) -> None:
        if mesh.shape.get(spec.axis) != len(spec.shares):
            raise ValueError(
                f"uneven data parallelism: {len(spec.shares)} shares but mesh axis {spec.axis!r} has "
                f"{mesh.shape.get(spec.axis, 0)} devices; give one share per position"
            )
        self.loss_fn, self.spec, self.mesh = loss_fn, spec, mesh

    def value_and_grad(self, params: Any, batch: Any, draw: StepKey | None = None) -> tuple[jax.Array, Any]:
        """The loss and gradients of the global batch's mean loss (``draw``: see the module docstring)."""
        loss, grads, _ = self._run(params, batch, draw)
        return loss, grads

    def executed_loops(self, params: Any, batch: Any) -> np.ndarray:
        """Runs once and returns how many loop iterations each position along the axis really ran."""
        _, _, loops = jax.jit(self._run)(params, batch)
        return np.asarray(loops)

    def _padded(self, batch: Any) -> Any:
        """``[positions, longest share, ...]``: position ``i``'s examples first, then padding (never read)."""
        spec = self.spec
        rows = max(spec.shares)
        starts = np.concatenate([[0], np.cumsum(spec.shares)])
        index = np.zeros((len(spec.shares), rows), np.int32)
        for i, share in enumerate(spec.shares):
            index[i, :share] = np.arange(starts[i], starts[i] + share)

        def one(x: jax.Array) -> jax.Array:
            if x.shape[0] != spec.batch:
                raise ValueError(
                    f"uneven data parallelism: the batch has {x.shape[0]} examples but the shares "
                    f"{list(spec.shares)} add up to {spec.batch}; plan the shares for this batch size"
                )
            return jnp.take(x, index.reshape(-1), axis=0).reshape(*index.shape, *x.shape[1:])

        return jax.tree.map(one, batch)

    def _run(self, params: Any, batch: Any, draw: StepKey | None = None) -> tuple[jax.Array, Any, jax.Array]:
        axis, spec = self.spec.axis, self.spec
        weight = spec.microbatch / spec.batch  # each microbatch's share of the global mean
        # The index in the global batch of each position's first microbatch.
        firsts = jnp.asarray(np.concatenate([[0], np.cumsum(spec.loops)[:-1]]), jnp.int32)

        def body(params: Any, rows: Any, loops: jax.Array, draw: StepKey | None) -> tuple:
            rows = jax.tree.map(lambda x: x[0], rows)
            first = firsts[jax.lax.axis_index(axis)]

            def step(i: jax.Array, carry: tuple) -> tuple:
                grads, loss, count = carry
                start = i * spec.microbatch
                micro = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, spec.microbatch), rows)
                # The rank's devices along the other batch axes (FSDP's) split its microbatch between them.
                micro = jax.tree.map(lambda x: constrain(x, (BATCH,) + (None,) * (x.ndim - 1)) if x.ndim else x, micro)
                part = None if draw is None else draw.fold(first + i)
                value, grad = jax.value_and_grad(lambda p: call_loss(self.loss_fn, p, micro, part))(params)
                grads = jax.tree.map(lambda acc, g: acc + weight * g, grads, grad)
                return grads, loss + weight * value, count + 1

            start = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
            # A bound read from the table by position: each device runs its own number of iterations.
            with jax.named_scope(LOOP_SCOPE):  # lets the compiled program's counts weigh it (see uneven_executor)
                grads, loss, count = jax.lax.fori_loop(0, loops[jax.lax.axis_index(axis)], step, start)
            loss, grads = jax.lax.psum((loss, grads), axis)
            return loss, grads, count[None]

        run = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(PartitionSpec(), PartitionSpec(axis), PartitionSpec(), PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(axis)),
            axis_names={axis},
            check_vma=False,
        )
        return run(params, self._padded(batch), jnp.asarray(spec.loops, jnp.int32), draw)


def uneven_executor(spec: Shares, task: Task) -> Executor:
    """The executor of uneven data parallelism: every device receives the whole batch and runs its own share.

    >>> import spmd, strategies, jax
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> plan = strategies.hetero.uneven_data_parallel((2,) * mesh.size)
    >>> uneven_executor(plan.execution, spmd.execution.Task(lambda p, b: 0.0, plan, mesh, {})).splits_batch
    False
    """
    within = math.prod(task.mesh.shape[a] for a in task.plan.batch_axes if a != spec.axis)
    if spec.microbatch % within:
        raise PlanError(
            f"uneven shares: a microbatch of {spec.microbatch} examples does not split over the other batch "
            f"axes' {within} devices of each {spec.axis} rank; make the microbatch a multiple of {within} "
            f"(--microbatch)"
        )
    engine = UnevenData(task.loss, spec, task.mesh)
    # The compiled program's FLOPs and collectives are the busiest device's: its loop runs the most iterations.
    busiest = {LOOP_SCOPE: (float(spec.iterations),)}
    # Any batch size: the shares, not an even split, place its examples.
    # Each rank's own counts: its loop's iterations.
    ranks = tuple({LOOP_SCOPE: (float(n),)} for n in spec.loops)
    return Executor(
        engine.value_and_grad, splits_batch=False, keyed=True, engine=engine, branch_weights=busiest,
        position_weights=ranks,
    )  # fmt: skip
