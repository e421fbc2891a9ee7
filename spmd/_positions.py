"""Data positions that run their own pipelines: uneven data shares inside a pipeline.

Where the devices along the data axis differ in speed, each data position runs the plan's schedule with its own
number of microbatches, all of one size (``PipelineSpec.data_schedules``). The executor's program stays one SPMD
program: each position's tick table is padded to the longest with idle ticks, and a device reads its own with
``axis_index`` over the data axis and over the stages, so a slow position really runs fewer actions. The ring
exchanges stay within a position's stages, and the gradients reduce over the data axis once, after the last tick.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from spmd._rules import PlanError
from spmd._schedule import ScheduleError
from spmd._ticks import FIELDS, ROUTES, Placement, TickProgram, tick_program

if TYPE_CHECKING:
    from spmd._specs import PipelineSpec

__all__ = ["DataPositions"]


@dataclasses.dataclass(frozen=True)
class DataPositions:
    """The tick programs of the positions of ``axis`` (one each) and their microbatch counts.

    >>> import spmd, strategies
    >>> from strategies.pipeline import pipeline_schedule
    >>> s = [pipeline_schedule("1f1b", stages=2, microbatches=m) for m in (3, 1)]
    >>> spec = strategies.pipeline("1f1b", stages=2, microbatches=2).execution
    >>> spec = spmd.execution.PipelineSpec("stage", spec.schedule, data_schedules=tuple(s))
    >>> mesh = spmd.make_mesh({"stage": 2, "data": 2, "tensor": -1})
    >>> positions = DataPositions.of(spec, mesh, Placement(spec.schedule, (1, 1)))
    >>> positions.counts, positions.table().shape[:2]  # the busier position's 8 ticks, the other's padded
    ((3, 1), (2, 8))
    """

    axis: str
    counts: tuple[int, ...]
    programs: tuple[TickProgram, ...]

    @classmethod
    def of(
        cls, spec: PipelineSpec, mesh: Mesh, placement: Placement, manual: Sequence[str] | None = None
    ) -> DataPositions | None:
        """The positions of ``spec``'s data schedules on ``mesh`` (None: every position runs the plan's).
        ``manual``: the batch axes the program runs manual over (those that split no parameter), when known;
        a position can only run its own schedule if that is its data axis alone."""
        if spec.data_schedules is None:
            return None
        axis = spec.data_axis
        if axis not in mesh.shape:
            raise PlanError(
                f"pipeline: {len(spec.data_schedules)} data schedules for the positions of {axis!r}, and the mesh "
                f"has no axis {axis!r} ({dict(mesh.shape)}); add it to the mesh, or drop data_schedules"
            )
        if len(spec.data_schedules) != mesh.shape[axis]:
            raise PlanError(
                f"pipeline: {len(spec.data_schedules)} data schedules for the positions of {axis!r}, which has "
                f"{mesh.shape[axis]} on this mesh; give one per position"
            )
        if manual is not None and tuple(manual) != (axis,):
            raise PlanError(_manual_message(axis, tuple(manual)))
        programs = tuple(tick_program(s, placement) for s in spec.data_schedules)
        return cls(axis, spec.rank_microbatches, programs)

    @property
    def slots(self) -> int:
        return max(p.slots for p in self.programs)

    @property
    def ticks(self) -> int:
        """The executed program's ticks: the longest position's (the others idle to the end)."""
        return max(p.ticks for p in self.programs)

    def busiest(self) -> np.ndarray:
        """``[tick, device, field]``: the padded tick table of the position with the most microbatches."""
        return self.table()[self.counts.index(max(self.counts))]

    def table(self) -> np.ndarray:
        """``[data position, tick, device, field]``, each position's program padded with idle ticks."""
        ticks = self.ticks
        idle = np.zeros(self.programs[0].table.shape[1:], np.int32)
        for route in ROUTES:
            idle[:, FIELDS.index(f"{route}_slot")] = -1  # nothing arrives
        pad = lambda p: np.broadcast_to(idle, (ticks - p.ticks, *idle.shape))  # noqa: E731
        return np.stack([np.concatenate([p.table, pad(p)]) for p in self.programs])

    def microbatches(self, batch: Any) -> Any:
        """``[data position, most microbatches, rows, ...]``: position ``i`` takes the next ``counts[i]``
        microbatches of the batch in order (the rest of its rows are padding its schedule never reads)."""
        total, most = sum(self.counts), max(self.counts)
        firsts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        index = np.array([[min(f + k, total - 1) for k in range(most)] for f in firsts])

        def split(x: jax.Array) -> jax.Array:
            if x.shape[0] % total:
                raise ScheduleError(
                    f"pipeline: the data positions run {list(self.counts)} microbatches of one size, {total} in "
                    f"all, and a batch of {x.shape[0]} rows does not split into {total}; make the batch a "
                    f"multiple of {total}"
                )
            micro = x.reshape(total, x.shape[0] // total, *x.shape[1:])
            return jnp.take(micro, index.reshape(-1), axis=0).reshape(*index.shape, *micro.shape[1:])

        return jax.tree.map(split, batch)

    @staticmethod
    def first(micro: Any) -> Any:
        """The first microbatch of every position side by side, as the program over all devices sees it."""
        return jax.tree.map(lambda x: x[:, 0].reshape(-1, *x.shape[3:]), micro)

    def own(self, micro: Any, table: jax.Array) -> tuple[Any, jax.Array]:
        """Inside the program (manual over ``axis``): this position's microbatches and tick table."""
        return jax.tree.map(lambda m: m[0], micro), table[jax.lax.axis_index(self.axis)]


def _manual_message(axis: str, manual: tuple[str, ...]) -> str:
    """Why a program manual over ``manual`` cannot run a schedule per position of ``axis``, and the fix."""
    if axis not in manual:
        return (
            f"pipeline: the positions of {axis!r} run their own schedules, each with its own microbatches, which "
            f"needs {axis!r} to split the batch and the parameters whole along it, and the plan splits them over "
            f"it (ZeRO-3 or FSDP over {axis!r}) or does not split the batch over it; split the parameters over an "
            f"axis of their own (FSDP over 'fsdp') and the batch over {axis!r}, or give no data schedules"
        )
    others = [a for a in manual if a != axis]
    return (
        f"pipeline: the positions of {axis!r} run their own schedules, and the batch is also split over "
        f"{others}, which split no parameter either; make {axis!r} the only such batch axis (merge them into it), "
        f"or give no data schedules"
    )
