"""The schedule as the executor runs it: which layers each (device, chunk) holds, and per tick and device the
action, its microbatch, chunk and slot, and where each result that arrives in the tick is stored.

Each action runs in the tick the simulator gives it at unit cost. A device's result (F's output, or on the last
stage the loss's gradient; B's or BW's input gradient) goes to the device that runs the neighbouring stage: the
next device on the ring (``up``), the previous one (``down``) or itself (``self``: the turn of a V-shaped
placement, and the last stage's loss gradient), and is stored at the end of the tick in that device's slot for
the microbatch-chunk, as a stage input or as an output gradient. A slot lives from the arrival of a
microbatch-chunk's input (its own F on the first stage) to the end of its last backward (W or BW): it holds the
input, the output gradient, what F keeps for the backward and what B hands to W.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spmd._schedule import Action, Schedule, ScheduleError, tick_table

__all__ = ["CODES", "FIELDS", "IDLE", "Placement", "TickProgram", "split_layers", "tick_program"]

# Action codes of the tick table and of the switch's branches.
IDLE, F, B, W, BW = range(5)
CODES = {"F": F, "B": B, "W": W, "BW": BW}
FIELDS = (
    "kind", "microbatch", "chunk", "slot", "first", "last", "branch",
    "up_slot", "up_grad", "down_slot", "down_grad", "self_slot", "self_grad",
)  # fmt: skip
ROUTES = ("up", "down", "self")


# ------------------------------------------------------------------------------------------ layer placement
def split_layers(layers: int, stages: int, counts: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per global stage: ``counts`` checked, or an even split.

    >>> split_layers(8, 4), split_layers(8, 4, (3, 3, 1, 1))
    ((2, 2, 2, 2), (3, 3, 1, 1))
    """
    if counts is None:
        if layers % stages:
            raise ScheduleError(
                f"pipeline: {layers} layers do not split evenly over {stages} stages; change the number of "
                f"layers (e.g. --layers {stages * max(1, round(layers / stages))}) or give layers per stage"
            )
        return (layers // stages,) * stages
    counts = tuple(int(c) for c in counts)
    if len(counts) != stages or any(c < 0 for c in counts) or sum(counts) != layers:
        raise ScheduleError(
            f"pipeline: layers per stage {list(counts)} must be {stages} non-negative counts summing to the "
            f"model's {layers} layers"
        )
    return counts


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which of the model's layers each (device, chunk) holds, padded to the longest stage."""

    schedule: Schedule
    counts: tuple[int, ...]  # per global stage

    @property
    def longest(self) -> int:
        return max(max(self.counts), 1)

    @functools.cached_property
    def index(self) -> np.ndarray:
        """``[p, v, longest]`` layer indices; -1 marks padding."""
        s = self.schedule
        starts = np.concatenate([[0], np.cumsum(self.counts)])
        out = np.full((s.stages, s.virtual, self.longest), -1, np.int64)
        for d in range(s.stages):
            for c in range(s.virtual):
                g = s.stage_of(d, c)
                out[d, c, : self.counts[g]] = np.arange(starts[g], starts[g + 1])
        return out

    def stack(self, x: jax.Array) -> jax.Array:
        """``[layers, ...]`` -> ``[p, v, longest, ...]`` with zeros in the padding."""
        idx = self.index
        taken = jnp.take(x, np.maximum(idx, 0).reshape(-1), axis=0).reshape(*idx.shape, *x.shape[1:])
        mask = (idx >= 0).reshape(*idx.shape, *([1] * (x.ndim - 1)))
        return jnp.where(mask, taken, jnp.zeros((), x.dtype))

    def unstack(self, x: jax.Array) -> jax.Array:
        """The inverse of :meth:`stack`."""
        flat = self.index.reshape(-1)
        order = np.argsort(np.where(flat < 0, len(flat), flat), kind="stable")[: int(sum(self.counts))]
        return jnp.take(x.reshape(-1, *x.shape[3:]), order, axis=0)

    @functools.cached_property
    def branches(self) -> tuple[int, ...]:
        """The distinct layer counts of the stages: one switch branch each."""
        return tuple(sorted(set(self.counts)))


# ---------------------------------------------------------------------------------------------- tick table
@dataclasses.dataclass(frozen=True)
class TickProgram:
    """The schedule compiled to ticks: ``table[tick, device]`` holds the :data:`FIELDS`; ``slots`` is the
    number of slots each device needs (see :func:`tick_program`).

    >>> import strategies
    >>> s = strategies.pipeline_schedule("gpipe", stages=2, microbatches=2)
    >>> tick_program(s, Placement(s, (1, 1))).actions()  # [tick][device]
    [['F0', None], ['F1', 'F0'], [None, 'F1'], [None, 'BW0'], ['BW0', 'BW1'], ['BW1', None]]
    """

    table: np.ndarray
    slots: int

    @property
    def ticks(self) -> int:
        return self.table.shape[0]

    def actions(self) -> list[list[str | None]]:
        """The table as ``[tick][device]`` action strings (``"F3"``, ``"B3.1"``) or None, like the simulator's."""
        names = {v: k for k, v in CODES.items()}
        return [
            [
                None if row[0] == IDLE else f"{names[int(row[0])]}{row[1]}" + (f".{row[2]}" if row[2] else "")
                for row in tick
            ]
            for tick in self.table
        ]


def tick_program(schedule: Schedule, placement: Placement) -> TickProgram:
    """The schedule's ticks for the executor. Slots are assigned by interval colouring (optimal: the number of
    slots is the peak of microbatch-chunks a device holds).

    >>> import strategies
    >>> s = strategies.pipeline_schedule("1f1b", stages=4, microbatches=8)
    >>> program = tick_program(s, Placement(s, (1, 1, 1, 1)))  # one layer per stage
    >>> from spmd._schedule import simulate
    >>> program.ticks, program.slots, simulate(s).peak_inflight  # device 0 holds 4 microbatches at most
    (22, 4, (4, 3, 2, 1))
    """
    table = tick_table(schedule)
    tick_of = {(d, a): t for t, row in enumerate(table) for d, a in enumerate(row) if a is not None}
    slot_of, slots = _slots(schedule, tick_of)
    out = np.zeros((len(table), schedule.stages, len(FIELDS)), np.int32)
    for route in ROUTES:
        out[..., FIELDS.index(f"{route}_slot")] = -1
    last = schedule.total_stages - 1
    for (d, a), t in tick_of.items():
        s = schedule.stage_of(d, a.chunk)
        out[t, d, :7] = (
            CODES[a.kind],
            a.microbatch,
            a.chunk,
            slot_of[d, a.microbatch, a.chunk],
            s == 0,
            s == last,
            placement.branches.index(placement.counts[s]),
        )
        # Where this action's result goes: F's output to the next stage (the last stage's F makes the loss's
        # gradient, for its own backward), B's and BW's input gradient to the previous one.
        if a.kind == "F":
            to, grad = (s, True) if s == last else (s + 1, False)
        elif a.kind in ("B", "BW") and s > 0:
            to, grad = s - 1, True
        else:
            continue
        dest, chunk = schedule.where(to)
        route = "self" if dest == d else "up" if dest == (d + 1) % schedule.stages else "down"
        if route == "down" and dest != (d - 1) % schedule.stages:
            raise ScheduleError(f"schedule {schedule.name}: stage {s} and stage {to} are not on neighbouring devices")
        out[t, dest, FIELDS.index(f"{route}_slot")] = slot_of[dest, a.microbatch, chunk]
        out[t, dest, FIELDS.index(f"{route}_grad")] = grad
    return TickProgram(out, max(slots, 1))


def _slots(schedule: Schedule, tick_of: dict) -> tuple[dict[tuple[int, int, int], int], int]:
    """Per (device, microbatch, chunk) its slot, and the most slots a device needs. A slot is taken when the
    stage input arrives (the end of the previous stage's F; on the first stage, the end of its own F) and
    given back after the last backward (W or BW) reads it."""
    slot_of: dict[tuple[int, int, int], int] = {}
    most = 0
    for d, row in enumerate(schedule.actions):
        held = []
        for a in row:
            if a.kind not in ("W", "BW"):
                continue
            s = schedule.stage_of(d, a.chunk)
            src = (d, Action("F", a.microbatch, a.chunk)) if s == 0 else _at(schedule, s - 1, a.microbatch)
            held.append((tick_of[src], tick_of[d, a], (d, a.microbatch, a.chunk)))
        free: list[tuple[int, int]] = []  # (release tick, slot)
        count = 0
        for acquire, release, key in sorted(held):
            reusable = [f for f in free if f[0] <= acquire]
            if reusable:
                free.remove(min(reusable))
                slot = min(reusable)[1]
            else:
                slot, count = count, count + 1
            free.append((release, slot))
            slot_of[key] = slot
        most = max(most, count)
    return slot_of, most


def _at(schedule: Schedule, stage: int, microbatch: int) -> tuple[int, Action]:
    device, chunk = schedule.where(stage)
    return device, Action("F", microbatch, chunk)
