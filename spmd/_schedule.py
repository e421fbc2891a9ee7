"""Pipeline schedules as data: per device, the ordered actions it runs; a validator and a simulator.

An action is ``(kind, microbatch, chunk)`` with kind ``F`` (forward), ``B`` (backward to the input: the
activation gradient the previous stage waits for), ``W`` (backward to the weights, which nothing waits for) or
``BW`` (both at once). With ``virtual = v`` chunks per device, chunk ``c`` of device ``d`` is global stage
``c·p + d`` (the looping placement of interleaved and breadth-first schedules), so a microbatch passes every
device ``v`` times.

The simulator times a schedule with given op costs (a chunk's op costs ``1/v`` of a stage's): every device runs
its actions in order, each as soon as the device is free and its inputs exist. Times are exact fractions, so
bubble fractions equal the papers' closed forms exactly.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from numbers import Real
from typing import Any, NamedTuple

__all__ = [
    "KINDS",
    "Action",
    "Costs",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "simulate",
    "validate",
]

KINDS = ("F", "B", "W", "BW")


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the device, the position and the action.

    >>> try:
    ...     validate(Schedule("mine", 1, (("BW0", "F0"),)))
    ... except ValueError as e:  # a ScheduleError is a ValueError
    ...     print(type(e).__name__, e)
    ScheduleError schedule mine: device 0, position 0: BW(microbatch 0, chunk 0) comes before its F (position 1)
    """


class Action(NamedTuple):
    """One op of one device: ``kind`` of ``microbatch`` on the device's ``chunk``.

    >>> str(Action("F", 3)), str(Action("BW", 0, 1))
    ('F3', 'BW0.1')
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    def describe(self) -> str:
        return f"{self.kind}(microbatch {self.microbatch}, chunk {self.chunk})"


_CELL = re.compile(r"\s*(BW|F|B|W)\s*(\d+)(?:\.(\d+))?\s*")


def _parse_action(item: Any, where: str) -> Action:
    if isinstance(item, Action):
        return item
    if isinstance(item, str):
        m = _CELL.fullmatch(item)
        if not m:
            raise ScheduleError(f"{where}: cannot read action {item!r}; write F3, B3, W3 or BW3 (chunk: F3.1)")
        return Action(m.group(1), int(m.group(2)), int(m.group(3) or 0))
    if isinstance(item, Sequence) and len(item) in (2, 3):
        kind, *rest = item
        if isinstance(kind, str) and all(isinstance(x, int) and not isinstance(x, bool) for x in rest):
            return Action(kind, *rest)
    raise ScheduleError(f"{where}: action {item!r} must be (kind, microbatch[, chunk]) or a string like 'F3'")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per device (a position on the ``stage`` mesh axis), the ordered actions it runs: plain, frozen data.

    >>> s = Schedule("mine", 2, (("F0", "F1", "BW0", "BW1"), ("F0", "BW0", "F1", "BW1")))
    >>> s.stages, s.actions[1][1]
    (2, Action(kind='BW', microbatch=0, chunk=0))
    """

    name: str
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    virtual: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ScheduleError(f"schedule {self.name}: microbatches must be a positive integer")
        if not isinstance(self.virtual, int) or self.virtual < 1:
            raise ScheduleError(f"schedule {self.name}: virtual (chunks per device) must be a positive integer")
        if not self.actions:
            raise ScheduleError(f"schedule {self.name}: no devices; give one list of actions per stage device")
        rows = tuple(
            tuple(_parse_action(a, f"schedule {self.name}, device {d}, position {i}") for i, a in enumerate(row))
            for d, row in enumerate(self.actions)
        )
        object.__setattr__(self, "actions", rows)

    @property
    def stages(self) -> int:
        """Devices on the pipeline axis (p)."""
        return len(self.actions)

    @property
    def total_stages(self) -> int:
        """Pipeline stages in all: p · v."""
        return self.stages * self.virtual

    def stage_of(self, device: int, chunk: int) -> int:
        """The global stage that ``chunk`` of ``device`` runs (looping placement)."""
        return chunk * self.stages + device

    def where(self, stage: int) -> tuple[int, int]:
        """(device, chunk) running global ``stage``."""
        return stage % self.stages, stage // self.stages

    # -- files ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual": self.virtual,
            "actions": [[list(a) for a in row] for row in self.actions],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """From :meth:`to_dict`'s form; ``actions`` may also hold strings like ``"F3"``."""
        try:
            return cls(str(data.get("name", "custom")), data["microbatches"], data["actions"], data.get("virtual", 1))
        except KeyError as e:
            raise ScheduleError(f"schedule file: missing field {e.args[0]!r} (need microbatches and actions)") from None

    def to_csv(self) -> str:
        """One row per device, one cell per action (``F3``, ``B3``, ``W3``, ``BW3``; chunk ``c`` as ``F3.c``)."""
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows([str(a) for a in row] for row in self.actions)
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str, *, name: str = "custom", virtual: int | None = None) -> Schedule:
        """Reads :meth:`to_csv`'s table (empty cells skipped, like torchtitan's tables); the microbatch and
        chunk counts are read off the actions.

        >>> Schedule.from_csv("F0,F1,BW0,BW1\\nF0,BW0,F1,BW1\\n").microbatches
        2
        """
        rows = [[c for c in row if c.strip()] for row in csv.reader(io.StringIO(text))]
        rows = [row for row in rows if row]
        actions = [
            [_parse_action(c, f"schedule {name}, device {d}, position {i}") for i, c in enumerate(row)]
            for d, row in enumerate(rows)
        ]
        if not actions:
            raise ScheduleError(f"schedule {name}: the table is empty; give one row of actions per device")
        m = 1 + max(a.microbatch for row in actions for a in row)
        v = virtual or 1 + max(a.chunk for row in actions for a in row)
        return cls(name, m, tuple(tuple(r) for r in actions), v)

    @classmethod
    def load(cls, path: str) -> Schedule:
        """A schedule from a ``.json`` (:meth:`to_dict`) or ``.csv`` (:meth:`to_csv`) file."""
        with open(path) as f:
            text = f.read()
        if path.endswith(".json"):
            try:
                return cls.from_dict(json.loads(text))
            except json.JSONDecodeError as e:
                raise ScheduleError(f"schedule file {path}: not valid JSON ({e})") from None
        return cls.from_csv(text, name=path.rsplit("/", 1)[-1].rsplit(".", 1)[0])


# --------------------------------------------------------------------------------------------- dependencies
def _backward_kinds(schedule: Schedule) -> dict[tuple[int, int], str]:
    """Per (global stage, microbatch): the kind that produces its input gradient, "B" or "BW"."""
    out = {}
    for d, row in enumerate(schedule.actions):
        for a in row:
            if a.kind in ("B", "BW"):
                out[schedule.stage_of(d, a.chunk), a.microbatch] = a.kind
    return out


def _dependencies(schedule: Schedule, device: int, action: Action, grads: Mapping) -> list[tuple[int, Action]]:
    """The (device, action) pairs whose results ``action`` needs."""
    s = schedule.stage_of(device, action.chunk)
    mb = action.microbatch
    here = lambda kind: (device, Action(kind, mb, action.chunk))  # noqa: E731

    def at(stage: int, kind: str) -> tuple[int, Action]:
        d, c = schedule.where(stage)
        return d, Action(kind, mb, c)

    if action.kind == "F":
        return [at(s - 1, "F")] if s > 0 else []
    if action.kind == "W":
        return [here("B")]
    deps = [here("F")]
    if s < schedule.total_stages - 1:
        deps.append(at(s + 1, grads.get((s + 1, mb), "B")))
    return deps


def validate(schedule: Schedule) -> Schedule:
    """Raises :class:`ScheduleError` naming the device, position and action if ``schedule`` cannot run:
    an unknown kind, a microbatch or chunk out of range, an action repeated or missing, a backward before its
    forward, a W before its B, or an action waiting on one that can never come first (a deadlock, such as
    the F of a chunk ordered before the F that makes its input). Returns the schedule.

    >>> validate(Schedule("bad", 1, (("F0", "BW0"), ("BW0", "F0"))))
    Traceback (most recent call last):
    ...
    spmd._schedule.ScheduleError: schedule bad: device 1, position 0: BW(microbatch 0, chunk 0) comes before its F ...
    """
    name, m, v = schedule.name, schedule.microbatches, schedule.virtual
    for d, row in enumerate(schedule.actions):
        seen: dict[Action, int] = {}
        for i, a in enumerate(row):
            where = f"schedule {name}: device {d}, position {i}: {a.describe()}"
            if a.kind not in KINDS:
                raise ScheduleError(f"{where}: kind must be one of {', '.join(KINDS)}")
            if not 0 <= a.microbatch < m:
                raise ScheduleError(f"{where}: microbatch out of range 0..{m - 1}")
            if not 0 <= a.chunk < v:
                raise ScheduleError(f"{where}: chunk out of range 0..{v - 1} (virtual={v})")
            if a in seen:
                raise ScheduleError(f"{where}: repeats position {seen[a]}")
            seen[a] = i
        for mb in range(m):
            for c in range(v):
                has = {k: seen.get(Action(k, mb, c)) for k in KINDS}
                what = f"schedule {name}: device {d}: microbatch {mb}, chunk {c}"
                if has["F"] is None:
                    raise ScheduleError(f"{what} has no F; every device runs F and a backward of each")
                if has["BW"] is not None and (has["B"] is not None or has["W"] is not None):
                    raise ScheduleError(f"{what} has BW and also B or W; use either BW or the pair B, W")
                if has["BW"] is None and (has["B"] is None or has["W"] is None):
                    missing = "B" if has["B"] is None else "W"
                    extra = "" if has["B"] is not None or has["W"] is not None else " (no backward at all)"
                    raise ScheduleError(f"{what} has no {missing}{extra}; give BW, or both B and W")
                back = has["BW"] if has["BW"] is not None else has["B"]
                if back < has["F"]:
                    kind = "BW" if has["BW"] is not None else "B"
                    raise ScheduleError(
                        f"schedule {name}: device {d}, position {back}: {Action(kind, mb, c).describe()} comes "
                        f"before its F (position {has['F']})"
                    )
                if has["W"] is not None and has["W"] < has["B"]:
                    raise ScheduleError(
                        f"schedule {name}: device {d}, position {has['W']}: {Action('W', mb, c).describe()} comes "
                        f"before its B (position {has['B']})"
                    )
    simulate(schedule, Costs())  # raises on a deadlock
    return schedule


# ----------------------------------------------------------------------------------------------- simulation
def _exact(x: Real, what: str) -> Fraction:
    value = Fraction(x) if isinstance(x, (int, Fraction)) else Fraction(str(x))
    if value < 0:
        raise ScheduleError(f"costs: {what} must be >= 0, got {x}")
    return value


@dataclasses.dataclass(frozen=True)
class Costs:
    """Op times of one whole stage (a chunk's ops take ``1/v`` of these); ``BW`` defaults to ``B + W``;
    ``comm`` is added whenever a result moves to another device.

    >>> Costs.parse("1,2,1").B
    Fraction(2, 1)
    """

    F: Real = 1
    B: Real = 1
    W: Real = 1
    BW: Real | None = None
    comm: Real = 0

    def __post_init__(self) -> None:
        for field in ("F", "B", "W", "comm"):
            object.__setattr__(self, field, _exact(getattr(self, field), field))
        bw = self.B + self.W if self.BW is None else _exact(self.BW, "BW")
        object.__setattr__(self, "BW", bw)

    @classmethod
    def parse(cls, text: str) -> Costs:
        """``"F,B,W"`` or ``"F,B,W,comm"``."""
        try:
            values = [float(x) for x in text.split(",")]
        except ValueError:
            values = []
        if len(values) not in (3, 4) or any(x < 0 for x in values):
            raise ScheduleError(f"--costs {text!r}: give F,B,W (or F,B,W,comm) as non-negative numbers, e.g. 1,1,1")
        return cls(*values[:3], comm=values[3] if len(values) == 4 else 0)

    def of(self, kind: str, virtual: int) -> Fraction:
        return getattr(self, kind) / virtual


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A simulated schedule: per device, each action's start and end (exact fractions), and what follows.

    >>> import strategies
    >>> t = simulate(strategies.pipeline_schedule("gpipe", stages=2, microbatches=2))
    >>> t.makespan, t.busy, t.bubble_fraction  # device 0 waits 3 of its 9 units for device 1's backward
    (Fraction(9, 1), (Fraction(6, 1), Fraction(6, 1)), Fraction(1, 3))
    """

    schedule: Schedule
    costs: Costs
    starts: tuple[tuple[Fraction, ...], ...]
    ends: tuple[tuple[Fraction, ...], ...]

    @property
    def makespan(self) -> Fraction:
        return max((row[-1] for row in self.ends if row), default=Fraction(0))

    @property
    def busy(self) -> tuple[Fraction, ...]:
        return tuple(sum((e - s for s, e in zip(ss, es, strict=True)), Fraction(0)) for ss, es in self._rows())

    @property
    def span(self) -> tuple[Fraction, ...]:
        """Per device: from its first action's start to its last action's end."""
        return tuple((es[-1] - ss[0]) if ss else Fraction(0) for ss, es in self._rows())

    @property
    def idle(self) -> tuple[Fraction, ...]:
        """Per device: time inside its own span spent waiting."""
        return tuple(s - b for s, b in zip(self.span, self.busy, strict=True))

    @property
    def bubble_fraction(self) -> Fraction:
        """The largest, over devices, of idle time inside the device's span divided by that span."""
        return max((i / s for i, s in zip(self.idle, self.span, strict=True) if s), default=Fraction(0))

    @property
    def peak_inflight(self) -> tuple[int, ...]:
        """Per device: the most (microbatch, chunk) pairs at once whose F has started and whose backward to the
        input (B or BW) has not finished: the activations a device holds."""
        return self._peak(("B", "BW"))

    @property
    def peak_held(self) -> tuple[int, ...]:
        """Per device: the most (microbatch, chunk) pairs at once whose F has started and whose last backward
        (W or BW) has not finished: what a device keeps for its weight gradients (zero-bubble schedules defer
        W, so this can exceed :attr:`peak_inflight`)."""
        return self._peak(("W", "BW"))

    def _peak(self, closing: tuple[str, ...]) -> tuple[int, ...]:
        out = []
        for d, row in enumerate(self.schedule.actions):
            events = []
            for a, s, e in zip(row, self.starts[d], self.ends[d], strict=True):
                if a.kind == "F":
                    events.append((s, 1))
                elif a.kind in closing:
                    events.append((e, -1))
            level = peak = 0
            for _, step in sorted(events):  # at equal times an ending comes before a start
                level += step
                peak = max(peak, level)
            out.append(peak)
        return tuple(out)

    def ticks(self) -> list[list[Action | None]]:
        """The timeline as a table ``[tick][device]`` when every action takes one time unit (unit costs)."""
        if any(e - s != 1 or s.denominator != 1 for ss, es in self._rows() for s, e in zip(ss, es, strict=True)):
            raise ScheduleError(
                "Timeline.ticks: every action must take exactly one time unit (simulate with unit costs)"
            )
        table: list[list[Action | None]] = [[None] * self.schedule.stages for _ in range(int(self.makespan))]
        for d, row in enumerate(self.schedule.actions):
            for a, s in zip(row, self.starts[d], strict=True):
                table[int(s)][d] = a
        return table

    def _rows(self) -> Iterable[tuple[tuple[Fraction, ...], tuple[Fraction, ...]]]:
        return zip(self.starts, self.ends, strict=True)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the figures as floats, and every action with its start and end."""
        return {
            "schedule": self.schedule.name,
            "stages": self.schedule.stages,
            "microbatches": self.schedule.microbatches,
            "virtual": self.schedule.virtual,
            "costs": {k: float(getattr(self.costs, k)) for k in ("F", "B", "W", "BW", "comm")},
            "bubble_fraction": float(self.bubble_fraction),
            "makespan": float(self.makespan),
            "busy": [float(x) for x in self.busy],
            "idle": [float(x) for x in self.idle],
            "peak_inflight": list(self.peak_inflight),
            "peak_held": list(self.peak_held),
            "actions": [
                [
                    {"kind": a.kind, "microbatch": a.microbatch, "chunk": a.chunk, "start": float(s), "end": float(e)}
                    for a, s, e in zip(row, self.starts[d], self.ends[d], strict=True)
                ]
                for d, row in enumerate(self.schedule.actions)
            ],
        }


def simulate(
    schedule: Schedule, costs: Costs | None = None, *, scale: Sequence[Sequence[Real]] | None = None
) -> Timeline:
    """Times ``schedule``: each device runs its actions in order, each starting when the device is free and
    the results it needs exist (plus ``costs.comm`` when they come from another device). ``scale[d][c]``
    multiplies the op times of chunk ``c`` on device ``d`` (uneven stages, devices of different speeds).

    >>> import strategies
    >>> t = simulate(strategies.pipeline_schedule("1f1b", stages=4, microbatches=8))
    >>> t.bubble_fraction, t.peak_inflight
    (Fraction(3, 11), (4, 3, 2, 1))
    """
    costs = costs or Costs()
    grads = _backward_kinds(schedule)
    p, v = schedule.stages, schedule.virtual
    factor = (
        [[Fraction(1)] * v for _ in range(p)] if scale is None else [[_exact(x, "scale") for x in row] for row in scale]
    )
    if len(factor) != p or any(len(row) != v for row in factor):
        raise ScheduleError(f"simulate: scale must give {v} factor(s) for each of the {p} devices")
    ends: dict[tuple[int, Action], Fraction] = {}
    starts: list[list[Fraction]] = [[] for _ in range(p)]
    finish: list[list[Fraction]] = [[] for _ in range(p)]
    position = [0] * p
    free = [Fraction(0)] * p
    remaining = sum(len(row) for row in schedule.actions)
    while remaining:
        progressed = False
        for d, row in enumerate(schedule.actions):
            while position[d] < len(row):
                a = row[position[d]]
                deps = _dependencies(schedule, d, a, grads)
                if any(dep not in ends for dep in deps):
                    break
                ready = max([ends[dep] + (costs.comm if dep[0] != d else 0) for dep in deps], default=Fraction(0))
                start = max(free[d], ready)
                end = start + costs.of(a.kind, v) * factor[d][a.chunk]
                ends[d, a] = end
                starts[d].append(start)
                finish[d].append(end)
                free[d] = end
                position[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(_deadlock(schedule, position, ends, grads))
    return Timeline(schedule, costs, tuple(map(tuple, starts)), tuple(map(tuple, finish)))


def _deadlock(schedule: Schedule, position: list[int], ends: Mapping, grads: Mapping) -> str:
    index = {(d, a): i for d, row in enumerate(schedule.actions) for i, a in enumerate(row)}
    for d, row in enumerate(schedule.actions):
        if position[d] == len(row):
            continue
        a = row[position[d]]
        for dep in _dependencies(schedule, d, a, grads):
            if dep not in ends:
                dd, da = dep
                at = f"device {dd}, position {index[dep]}" if dep in index else f"device {dd}, which never runs it"
                return (
                    f"schedule {schedule.name}: device {d}, position {position[d]}: {a.describe()} needs "
                    f"{da.describe()} ({at}) first, and that cannot run before it: the table deadlocks; reorder "
                    f"so every action comes after the ones it needs"
                )
    raise AssertionError("stuck without a missing dependency")  # unreachable: progress would have been made
