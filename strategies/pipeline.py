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
- ``zb-v``: ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6; "Pipeline Parallelism with
  Controllable Memory", NeurIPS 2024, its V-ZB): two chunks per device placed in a V (``placement="v"``: device
  ``d`` holds stages ``d`` and ``2p − 1 − d``), ``B`` and ``W`` split; always ``virtual = 2``. The papers' closed
  forms, with ``T_F = T_B = T_W``: no bubble, and peak activation memory equal to 1F1B's, ``p`` microbatches of a
  whole stage, i.e. ``2p`` chunk-microbatches in flight (each chunk is half a stage) — on *every* device, where
  1F1B's ``p − d`` peaks on the first alone; twice 1F1B's pipeline messages. The construction is the papers'
  figure as torchtitan's ``ScheduleZBVZeroBubble`` writes it per device: ``2(p − d) − 1`` forwards of chunk 0,
  ``d`` pairs (F chunk 1, F chunk 0), ``p − d`` triples (F, B, W of chunk 1), then F, B, W of chunk 0 and of
  chunk 1 in turn, and a cool-down of the remaining B's followed by the W's. Its warm-up takes ``2p − 1``
  microbatches: for ``m ≥ 2p − 1`` the simulator confirms both closed forms exactly (bubble 0, peak ``2p``; the
  makespan ``m(T_F+T_B+T_W) + (p−1)·T_F/2``, each device starting half a forward after the one before). Below
  ``2p − 1`` the table is built for ``2p − 1`` and the missing microbatches' actions dropped: it runs, with a
  bubble the papers give no form for; with unit costs the simulator measures ``(2p−1−m)/(2m+2p−1)`` (idle
  ``(2p−1−m)`` units on the first device).

DualPipeV (DeepSeek) shares ZB-V's placement, but its point is a fused action: one chunk's forward overlapped with
another chunk's backward in the same slot, so that one's communication hides behind the other's compute. The
schedule IR has one action per device per slot (and the executor one per tick), so DualPipeV's overlap cannot be
written in it; its order without the overlap is a ZB-V-like table with nothing to gain over ``zb-v``.
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


def _zero_bubble_v(p: int, m: int, v: int) -> list[list[Action]]:
    """ZB-V, device by device (see the module's docstring). Chunk 0 of device ``d`` is stage ``d``, chunk 1 is
    stage ``2p − 1 − d``: device 0 both starts and ends the V, so it warms up with the most chunk-0 forwards, and
    every device has ``2p`` chunk-microbatches in flight before its first chunk-0 backward."""
    n = max(m, 2 * p - 1)  # the warm-up's shape needs 2p − 1 microbatches; those past m are dropped
    return [[a for a in _zero_bubble_v_device(p, d, n) if a.microbatch < m] for d in range(p)]


def _zero_bubble_v_device(p: int, d: int, n: int) -> list[Action]:
    made = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}
    row: list[Action] = []

    def put(*ops: tuple[str, int], times: int = 1) -> None:
        for _ in range(times):
            for kind, c in ops:
                row.append(Action(kind, made[kind, c], c))
                made[kind, c] += 1

    put(("F", 0), times=2 * (p - d) - 1)
    put(("F", 1), ("F", 0), times=d)
    put(("F", 1), ("B", 1), ("W", 1), times=p - d)  # the turn of the V: chunk 1 runs back up the devices
    for _ in range(n - p):  # steady state: one F, B, W of each chunk
        if made["F", 0] < n:
            put(("F", 0))
        put(("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    put(("B", 0), ("B", 1), times=d)
    put(("B", 0), ("W", 0), times=p - d)
    put(("W", 1), times=made["B", 1] - made["W", 1])
    put(("W", 0), times=made["B", 0] - made["W", 0])
    return row


SCHEDULES: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved": _interleaved,
    "bfs": _breadth_first,
    # Qi et al.'s handcrafted schedules: H1 at 1F1B's warm-up (p in flight), H2 with twice its warm-up.
    "zb-h1": lambda p, m, v: _zero_bubble(p, m, warmup=lambda d: p - 1 - d, defer=lambda d: d),
    "zb-h2": lambda p, m, v: _zero_bubble(p, m, warmup=lambda d: 2 * (p - 1 - d), defer=lambda d: 2 * d),
    "zb-v": _zero_bubble_v,
}
_LOOPED = ("interleaved", "bfs")
_V_SHAPED = ("zb-v",)  # placement "v": exactly two chunks per device


def pipeline_schedule(name: str, /, *, stages: int, microbatches: int, virtual: int | None = None) -> Schedule:
    """The schedule ``name`` (see :data:`SCHEDULES`) for ``stages`` devices, ``microbatches`` and ``virtual``
    chunks per device (default: the schedule's own, 2 for ``zb-v``, else 1), validated.

    >>> [str(a) for a in pipeline_schedule("1f1b", stages=2, microbatches=3).actions[0]]
    ['F0', 'F1', 'BW0', 'F2', 'BW1', 'BW2']
    >>> s = pipeline_schedule("zb-v", stages=2, microbatches=3)
    >>> s.virtual, s.placement, " ".join(map(str, s.actions[1][:6]))
    (2, 'v', 'F0 F0.1 F1 F1.1 B0.1 W0.1')
    """
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    if virtual is None:
        virtual = 2 if name in _V_SHAPED else 1
    for what, value in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"schedule {name}: {what} must be a positive integer, got {value!r}")
    if name in _V_SHAPED and virtual != 2:
        raise ScheduleError(
            f"schedule {name} places exactly two chunks on each device (a V), so virtual is 2, got {virtual}; "
            f"leave --virtual out (or give --virtual 2)"
        )
    if virtual > 1 and name not in _LOOPED + _V_SHAPED:
        raise ScheduleError(
            f"schedule {name} runs one chunk per device; for --virtual {virtual} use {' or '.join(_LOOPED)}"
        )
    if name == "interleaved" and microbatches % stages:
        raise ScheduleError(
            f"schedule interleaved needs microbatches divisible by stages ({microbatches} by {stages}); "
            f"use {stages * max(1, round(microbatches / stages))} microbatches, or bfs"
        )
    rows = SCHEDULES[name](stages, microbatches, virtual)
    placement = "v" if name in _V_SHAPED else "loop"
    return validate(Schedule(name, microbatches, tuple(map(tuple, rows)), virtual, placement))


def pipeline(
    schedule: str | Schedule = "1f1b",
    /,
    *,
    stages: int,
    microbatches: int,
    virtual: int | None = None,
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
