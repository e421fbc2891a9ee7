"""Pipeline schedules (generators of :class:`spmd.pipeline.Schedule` tables) and the pipeline plan.

Schedules (``p`` stage devices, ``m`` microbatches, ``v`` chunks per device):

- ``gpipe``: every forward, then every backward (Huang et al.); ``m`` microbatches in flight.
- ``1f1b``: ``p − 1 − d`` warm-up forwards on device ``d``, then one forward, one backward (PipeDream-Flush /
  Megatron); at most ``p − d`` in flight.
- ``interleaved``: Megatron's interleaved 1F1B over ``v`` chunks per device (looping placement); ``m`` a
  multiple of ``p``; bubble ``(p−1)/(v·m+p−1)``.
- ``bfs``: breadth-first looping (Lamy-Poirier): all microbatches through a device's earliest chunk first,
  then the next chunk; backward in reverse.
- ``zb-h1``, ``zb-h2``: zero-bubble schedules (Qi et al.) with the backward split into ``B`` and ``W``; deferred
  ``W``'s fill what would be bubbles. H1 keeps 1F1B's memory (``p − d`` in flight, ``p`` held until W) and
  leaves ``(p−1)(T_F+T_B−T_W)`` idle for ``m ≥ p``; H2 doubles the warm-up (``2(p − d) − 1`` in flight,
  ``2p − 1`` held) and leaves none for ``m ≥ 2p − 1``.
"""

from __future__ import annotations

from collections.abc import Callable

from spmd import Plan
from spmd.pipeline import Action, PipelineSpec, Schedule, ScheduleError, validate

__all__ = ["SCHEDULES", "pipeline", "pipeline_schedule"]


def _gpipe(p: int, m: int, v: int) -> list[list[Action]]:
    return [[Action("F", i) for i in range(m)] + [Action("BW", i) for i in range(m)] for _ in range(p)]


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Action]]:
    rows = []
    for d in range(p):
        warmup = min(p - 1 - d, m)
        row = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            row += [Action("F", warmup + i), Action("BW", i)]
        row += [Action("BW", i) for i in range(m - warmup, m)]
        rows.append(row)
    return rows


def _interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    # Megatron-LM's interleaved schedule: the k-th forward of a device runs chunk (k // p) % v on microbatch
    # (k // (p·v))·p + k % p; backwards walk the chunks in reverse; (p − d − 1)·2 + (v − 1)·p warm-up forwards.
    total = m * v

    def forward(k: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return Action("BW", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    rows = []
    for d in range(p):
        warmup = total if m == p else min((p - d - 1) * 2 + (v - 1) * p, total)
        row = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            row += [forward(warmup + k), backward(k)]
        row += [backward(k) for k in range(total - warmup, total)]
        rows.append(row)
    return rows


def _breadth_first(p: int, m: int, v: int) -> list[list[Action]]:
    row = [Action("F", i, c) for c in range(v) for i in range(m)]
    row += [Action("BW", i, c) for c in reversed(range(v)) for i in range(m)]
    return [list(row) for _ in range(p)]


def _zero_bubble(p: int, m: int, warmup: Callable[[int], int], defer: Callable[[int], int]) -> list[list[Action]]:
    """1F1B with the backward split into B and W: ``warmup(d)`` forwards, then F, B pairs, and device ``d``
    runs each W ``defer(d)`` microbatches after its B. Later devices defer more, so their B's (which earlier
    devices wait for) go first and the deferred W's fill the tail where 1F1B idles. Every device then holds
    ``warmup(0) + 1`` microbatches between an F and its W."""
    rows = []
    for d in range(p):
        first, lag = min(warmup(d), m), defer(d)
        row = [Action("F", i) for i in range(first)]
        for i in range(m):
            if first + i < m:
                row.append(Action("F", first + i))
            row.append(Action("B", i))
            if i >= lag:
                row.append(Action("W", i - lag))
        row += [Action("W", i) for i in range(max(m - lag, 0), m)]
        rows.append(row)
    return rows


SCHEDULES: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved": _interleaved,
    "bfs": _breadth_first,
    # Qi et al.'s handcrafted schedules: H1 at 1F1B's warm-up (p in flight), H2 with twice its warm-up.
    "zb-h1": lambda p, m, v: _zero_bubble(p, m, warmup=lambda d: p - 1 - d, defer=lambda d: d),
    "zb-h2": lambda p, m, v: _zero_bubble(p, m, warmup=lambda d: 2 * (p - 1 - d), defer=lambda d: 2 * d),
}
_LOOPED = ("interleaved", "bfs")


def pipeline_schedule(name: str, /, *, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule ``name`` (see :data:`SCHEDULES`) for ``stages`` devices, ``microbatches`` and ``virtual``
    chunks per device, validated.

    >>> [str(a) for a in pipeline_schedule("1f1b", stages=2, microbatches=3).actions[0]]
    ['F0', 'F1', 'BW0', 'F2', 'BW1', 'BW2']
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    for what, value in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"schedule {name}: {what} must be a positive integer, got {value!r}")
    if virtual > 1 and name not in _LOOPED:
        raise ScheduleError(
            f"schedule {name} runs one chunk per device; for --virtual {virtual} use {' or '.join(_LOOPED)}"
        )
    if name == "interleaved" and microbatches % stages:
        raise ScheduleError(
            f"schedule interleaved needs microbatches divisible by stages ({microbatches} by {stages}); "
            f"use {stages * max(1, round(microbatches / stages))} microbatches, or bfs"
        )
    rows = SCHEDULES[name](stages, microbatches, virtual)
    return validate(Schedule(name, microbatches, tuple(map(tuple, rows)), virtual))


def pipeline(
    schedule: str | Schedule = "1f1b",
    /,
    *,
    stages: int,
    microbatches: int,
    virtual: int = 1,
    axis: str = "stage",
    layers_per_stage: tuple[int, ...] | None = None,
) -> Plan:
    """Pipeline parallelism over mesh axis ``axis`` with ``stages`` devices: the model's stacked layers are cut
    into ``stages · virtual`` consecutive stages (``layers_per_stage`` of them each, default an even split)
    and run by the schedule inside one SPMD program.

    >>> pipeline("zb-h1", stages=4, microbatches=8).execution.schedule.name
    'zb-h1'
    """
    table = (
        validate(schedule)
        if isinstance(schedule, Schedule)
        else pipeline_schedule(schedule, stages=stages, microbatches=microbatches, virtual=virtual)
    )
    if table.stages != stages:
        raise ScheduleError(f"schedule {table.name} has {table.stages} devices, but the pipeline has {stages} stages")
    counts = None if layers_per_stage is None else tuple(layers_per_stage)
    # The stacked layers are stored [stage, chunk, layer, ...]; the spec maps their leading dimension to the axis.
    return Plan(execution=PipelineSpec(axis=axis, schedule=table, layers_per_stage=counts))
