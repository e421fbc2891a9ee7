"""From the rows each process reads to a training step's global batch.

A data pipeline that runs in every process of a job (grain's ``ShardByJaxProcess``, or a ``MapDataset`` sliced
``[jax.process_index()::jax.process_count()]``) gives each process its own rows. The step wants one global
array per batch leaf, laid out by :meth:`spmd.TrainStep.batch_shardings`; ``jax.make_array_from_process_local_data``
builds it from each process's part without moving data between processes. What is left to the toolkit is the
global shape: a process's devices hold some of the row blocks the batch axes cut the batch into, so its rows
are that share of the global batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from spmd._train import TrainStep

__all__ = ["global_batch", "process_share"]


def process_share(step: TrainStep) -> tuple[int, int]:
    """``(held, blocks)``: of the ``blocks`` row blocks the step's batch axes cut a batch into, how many this
    process's devices hold. A process reads ``held / blocks`` of each global batch; ``(1, 1)`` where every
    device takes the whole batch (uneven data parallelism, or a plan without batch axes).

    >>> import spmd, optax, jax, numpy as np
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> params = {"w": jax.ShapeDtypeStruct((3,), np.float32)}
    >>> step = spmd.TrainStep(lambda p, b: (b @ p["w"]).mean(), optax.sgd(0.1), spmd.Plan(batch_axes=("data",)),
    ...                       mesh, params=params)
    >>> process_share(step) == (jax.local_device_count(), jax.device_count())  # one process: all of them
    True
    """
    axes = step.plan.batch_axes if step.executor.splits_batch else ()
    mesh = step.mesh
    positions = [mesh.axis_names.index(a) for a in axes]
    me = jax.process_index()
    held = {
        tuple(index[p] for p in positions)
        for index in np.ndindex(mesh.devices.shape)
        if mesh.devices[index].process_index == me
    }
    return len(held), math.prod(mesh.shape[a] for a in axes)


def global_batch(local: Any, step: TrainStep) -> Any:
    """This process's rows of a batch (numpy arrays, each with a leading batch dimension) as the step's global
    batch, laid out by :meth:`spmd.TrainStep.batch_shardings`, for ``step(state, batch)``.

    Every process calls it with the same number of rows (a sharded loader with ``drop_remainder=True`` makes it
    so); the global batch is the processes' rows in the order their devices hold the row blocks (process
    order, for :func:`spmd.make_mesh` over several processes). Where a process's devices hold every block (the
    batch axes lie within a process, or the plan has none), its rows are the whole batch, and every process must
    read the same rows. On one process the global batch is the local one.

    >>> import spmd, optax, jax, numpy as np
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> params = {"w": jax.ShapeDtypeStruct((3,), np.float32)}
    >>> step = spmd.TrainStep(lambda p, b: (b["x"] @ p["w"]).mean(), optax.sgd(0.1),
    ...                       spmd.Plan(batch_axes=("data",)), mesh, params=params)
    >>> batch = global_batch({"x": np.ones((2 * mesh.size, 3), np.float32)}, step)
    >>> batch["x"].shape == (2 * mesh.size, 3), batch["x"].sharding.spec
    (True, P('data', None))
    """
    held, blocks = process_share(step)
    shapes = [np.shape(x) for x in jax.tree.leaves(local)]
    rows = {shape[0] if shape else None for shape in shapes}
    if len(rows) != 1 or None in rows:
        raise ValueError(
            f"spmd.global_batch: every array of the local batch needs the same leading (batch) dimension; got "
            f"shapes {shapes}"
        )
    (count,) = rows
    if count % held:
        raise ValueError(
            f"spmd.global_batch: process {jax.process_index()} holds {held} of the {blocks} row blocks of the "
            f"batch (batch axes {step.plan.batch_axes} of mesh {dict(step.mesh.shape)}), so its local batch needs a "
            f"multiple of {held} rows; got {count}: make the per-process batch size a multiple of {held}"
        )
    rows_of = count // held * blocks
    shapes_of = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows_of, *np.shape(x)[1:]), np.asarray(x).dtype), local)
    shardings = step.batch_shardings(shapes_of)
    return jax.tree.map(
        lambda x, s, g: jax.make_array_from_process_local_data(s, np.asarray(x), g.shape), local, shardings, shapes_of
    )
