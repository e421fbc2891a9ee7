"""Pipeline schedules as data: per device, the ordered actions it runs; a validator and a simulator.

An action is ``(kind, microbatch, chunk)`` with kind ``F`` (forward), ``B`` (backward to the input: the
activation gradient the previous stage waits for), ``W`` (backward to the weights, which nothing waits for) or
``BW`` (both at once). With ``virtual = v`` chunks per device, a schedule's ``placement`` says which global stage
chunk ``c`` of device ``d`` runs:

- ``"loop"`` (the default): stage ``c·p + d``, the looping placement of interleaved and breadth-first schedules;
  a microbatch passes every device ``v`` times, always to the next device on the ring;
- ``"v"``: exactly two chunks per device, device ``d`` holding stages ``d`` and ``2p − 1 − d`` (ZB-V, DualPipeV):
  a microbatch goes down the devices and back up, stage ``p − 1`` to ``p`` staying on the last device, and the
  first device holds the first stage and the last (the loss).

The simulator times a schedule with given op costs (a chunk's op costs ``1/v`` of a stage's): every device runs
its actions in order, each as soon as the device is free and its inputs exist. Times are exact fractions, so
bubble fractions equal the papers' closed forms exactly. :func:`simulate_lockstep` times a schedule as one SPMD
program runs it: on :func:`tick_table`'s grid (one action per device per tick), each tick as long as its
dearest action, so a cheap action paired with a dear one waits out the tick.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from numbers import Real
from typing import Any, NamedTuple

__all__ = [
    "KINDS",
    "PLACEMENTS",
    "Action",
    "Costs",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "simulate",
    "simulate_lockstep",
    "tick_table",
    "validate",
]

KINDS = ("F", "B", "W", "BW")
PLACEMENTS = ("loop", "v")  # see the module's docstring


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


_CELL = re.compile(r"\s*(BW|F|B|W)\s*(\d{1,9})(?:\.(\d{1,9}))?\s*")


@functools.lru_cache(maxsize=1 << 14)
def _read_cell(text: str) -> Action | None:
    """A table's cells repeat (``F0`` on every device): one Action each saves the time and memory of many."""
    m = _CELL.fullmatch(text)
    return Action(m.group(1), int(m.group(2)), int(m.group(3) or 0)) if m else None


@functools.lru_cache(maxsize=1 << 14)
def _shared(action: Action) -> Action:
    """One object for equal actions read from a file: fewer live objects, less for the garbage collector."""
    return action


def _parse_action(item: Any, name: str, device: int, position: int) -> Action:
    if isinstance(item, Action):
        return item
    if isinstance(item, str):
        action = _read_cell(item)
        if action is not None:
            return action
    elif (
        type(item) in (list, tuple)
        and len(item) == 3
        and type(item[0]) is str
        and type(item[1]) is type(item[2]) is int
    ):
        return _shared(Action(*item))  # the common case, JSON's [kind, microbatch, chunk], checked quickly
    elif isinstance(item, Sequence) and len(item) in (2, 3):
        kind, *rest = item
        if isinstance(kind, str) and all(isinstance(x, int) and not isinstance(x, bool) for x in rest):
            return _shared(Action(kind, *rest))
    # The message is built only here: this runs once per cell of tables of many thousand.
    where = f"schedule {name}, device {device}, position {position}"
    if isinstance(item, str):
        raise ScheduleError(f"{where}: cannot read action {item!r}; write F3, B3, W3 or BW3 (chunk: F3.1)")
    raise ScheduleError(f"{where}: action {item!r} must be (kind, microbatch[, chunk]) or a string like 'F3'")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per device (a position on the ``stage`` mesh axis), the ordered actions it runs: plain, frozen data.

    ``placement`` maps (device, chunk) to a global stage: ``"loop"`` (``c·p + d``) or ``"v"`` (two chunks per
    device, stages ``d`` and ``2p − 1 − d``); see :meth:`stage_of`.

    >>> s = Schedule("mine", 2, (("F0", "F1", "BW0", "BW1"), ("F0", "BW0", "F1", "BW1")))
    >>> s.stages, s.actions[1][1]
    (2, Action(kind='BW', microbatch=0, chunk=0))
    """

    name: str
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    virtual: int = 1
    placement: str = "loop"

    def __post_init__(self) -> None:
        for field, what in (("microbatches", "microbatches"), ("virtual", "virtual (chunks per device)")):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"schedule {self.name}: {what} must be a positive integer, got {_short(value)}")
        if self.placement not in PLACEMENTS:
            raise ScheduleError(
                f"schedule {self.name}: placement must be one of {', '.join(map(repr, PLACEMENTS))}, got "
                f"{_short(self.placement)}; use 'loop' (chunk c of device d is stage c·p + d) or 'v'"
            )
        if self.placement == "v" and self.virtual != 2:
            raise ScheduleError(
                f"schedule {self.name}: placement 'v' puts exactly two chunks on each device, but virtual is "
                f"{self.virtual}; give virtual=2, or placement='loop'"
            )
        if not _is_list(self.actions) or not all(_is_list(row) for row in self.actions):
            raise ScheduleError(
                f"schedule {self.name}: actions must hold one list of actions per device, e.g. "
                f'[["F0", "BW0"], ["F0", "BW0"]]; got {_short(self.actions)}'
            )
        if not self.actions:
            raise ScheduleError(f"schedule {self.name}: no devices; give one list of actions per stage device")
        rows = tuple(
            tuple(_parse_action(a, self.name, d, i) for i, a in enumerate(row)) for d, row in enumerate(self.actions)
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
        """The global stage that ``chunk`` of ``device`` runs: ``chunk·p + device`` under the looping placement,
        ``device`` or ``2p − 1 − device`` under the V.

        >>> v = Schedule("v", 1, (("F0", "F0.1", "B0.1", "B0", "W0.1", "W0"),) * 2, virtual=2, placement="v")
        >>> [v.stage_of(d, c) for c in (0, 1) for d in (0, 1)], v.where(2)
        ([0, 1, 3, 2], (1, 1))
        """
        if self.placement == "v":
            return device if chunk == 0 else 2 * self.stages - 1 - device
        return chunk * self.stages + device

    def where(self, stage: int) -> tuple[int, int]:
        """(device, chunk) running global ``stage``: the inverse of :meth:`stage_of`."""
        p = self.stages
        if self.placement == "v":
            return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
        return stage % p, stage // p

    # -- files ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "virtual": self.virtual,
            "placement": self.placement,
            "actions": [[list(a) for a in row] for row in self.actions],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """From :meth:`to_dict`'s form; ``actions`` may also hold strings like ``"F3"``.

        >>> Schedule.from_dict({"microbatches": 1, "actions": [["F0", "BW0"]]}).actions
        ((Action(kind='F', microbatch=0, chunk=0), Action(kind='BW', microbatch=0, chunk=0)),)
        """
        return _from_dict(cls, data, "Schedule.from_dict", "custom")

    def to_csv(self) -> str:
        """One row per device, one cell per action (``F3``, ``B3``, ``W3``, ``BW3``; chunk ``c`` as ``F3.c``). The
        table holds no placement: give it again to :meth:`from_csv` (``placement="v"``), or keep a V-placed
        schedule in JSON (:meth:`to_dict`), which does."""
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows([str(a) for a in row] for row in self.actions)
        return out.getvalue()

    @classmethod
    def from_csv(
        cls, text: str, *, name: str = "custom", virtual: int | None = None, placement: str = "loop"
    ) -> Schedule:
        """Reads :meth:`to_csv`'s table (empty cells skipped, like torchtitan's tables); the microbatch and
        chunk counts are read off the actions. A CSV table cannot say its placement: it is ``placement``
        (``"loop"`` unless given; ``"v"`` for a ZB-V table).

        >>> Schedule.from_csv("F0,F1,BW0,BW1\\nF0,BW0,F1,BW1\\n").microbatches
        2
        """
        try:
            rows = [[c for c in row if c.strip()] for row in csv.reader(io.StringIO(text))]
        except csv.Error as e:  # a cell past the csv module's field size limit
            raise ScheduleError(
                f"schedule {name}: not a CSV table ({e}); write one row of actions per device"
            ) from None
        rows = [row for row in rows if row]
        actions = [[_parse_action(c, name, d, i) for i, c in enumerate(row)] for d, row in enumerate(rows)]
        if not actions:
            raise ScheduleError(f"schedule {name}: the table is empty; give one row of actions per device")
        m = 1 + max(a.microbatch for row in actions for a in row)
        v = virtual or 1 + max(a.chunk for row in actions for a in row)
        return cls(name, m, tuple(tuple(r) for r in actions), v, placement)

    @classmethod
    def load(cls, path: str, *, placement: str | None = None) -> Schedule:
        """A schedule from a ``.json`` (:meth:`to_dict`) or ``.csv`` (:meth:`to_csv`) file (UTF-8); a file that
        cannot be read or holds no table raises :class:`ScheduleError` naming the file. A JSON file says its
        placement; ``placement`` gives a CSV table's (default ``"loop"``), and must agree with a JSON file's.

        >>> Schedule.load("no/such/table.csv")
        Traceback (most recent call last):
        ...
        spmd._schedule.ScheduleError: schedule file no/such/table.csv: cannot read it (No such file or directory)...
        """
        where = f"schedule file {path}"
        stem = os.path.splitext(os.path.basename(path))[0] or "custom"
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except OSError as e:  # a directory, no permission, gone
            raise ScheduleError(f"{where}: cannot read it ({e.strerror}); give a readable .json or .csv file") from None
        except UnicodeDecodeError as e:
            raise ScheduleError(
                f"{where}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); save it as UTF-8"
            ) from None
        try:
            if not path.endswith(".json"):
                return cls.from_csv(text, name=stem, placement=placement or "loop")
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ScheduleError(f"not valid JSON ({e})") from None
            except RecursionError:
                raise ScheduleError("not valid JSON (nested too deeply)") from None
            table = _from_dict(cls, data, where, stem)
            if placement is not None and table.placement != placement:
                raise ScheduleError(
                    f"placement is {table.placement!r} but {placement!r} was asked for; drop the placement "
                    f"argument (a JSON file says its own)"
                )
            return table
        except ScheduleError as e:
            # The table's own errors name the schedule, not the file the user gave.
            raise ScheduleError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None


def _from_dict(cls: type[Schedule], data: Any, where: str, name: str) -> Schedule:
    """:meth:`Schedule.from_dict` with the checks a file needs: each field's type, before any work."""
    fields = (
        "an object with microbatches and actions (and optionally name, stages, virtual, placement), as Schedule.to_dict"
    )
    if not isinstance(data, Mapping):
        raise ScheduleError(f"{where}: expected {fields} writes; got {type(data).__name__} {_short(data)}")
    missing = [k for k in ("microbatches", "actions") if k not in data]
    if missing:
        raise ScheduleError(f"{where}: missing field {missing[0]!r}; give {fields} writes")
    actions, stages = data["actions"], data.get("stages")
    if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 1):
        raise ScheduleError(f"{where}: stages must be a positive integer, got {_short(stages)}")
    if stages is not None and _is_list(actions) and stages != len(actions):
        raise ScheduleError(
            f"{where}: stages is {stages} but actions has {len(actions)} row(s); give one row per device"
        )
    name = data.get("name", name)
    if not isinstance(name, str):
        raise ScheduleError(f"{where}: name must be a string, got {_short(name)}")
    placement = data.get("placement", "loop")
    if not isinstance(placement, str):
        raise ScheduleError(f"{where}: placement must be a string ('loop' or 'v'), got {_short(placement)}")
    return cls(name, data["microbatches"], actions, data.get("virtual", 1), placement)


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------------------------- dependencies
# Results are named by integers, ``(stage · microbatches + microbatch) · 4 + kind``: on tables of many thousand
# actions, hashing ints is several times cheaper than hashing (device, Action) tuples, and ints cost the
# garbage collector nothing.
_KIND_INDEX = {kind: i for i, kind in enumerate(KINDS)}
_NONE = -1


def _backward_kinds(schedule: Schedule) -> dict[int, int]:
    """Per (global stage, microbatch), as ``stage · microbatches + microbatch``: the kind index that produces
    its input gradient, B's or BW's."""
    m, stage_of, out = schedule.microbatches, schedule.stage_of, {}
    for d, row in enumerate(schedule.actions):
        for kind, mb, c in row:
            if kind in ("B", "BW"):
                out[stage_of(d, c) * m + mb] = _KIND_INDEX[kind]
    return out


def _keys_of(schedule: Schedule) -> Callable[[int, Action], tuple[int, int, int]]:
    """``keys(device, action)``: the action's own result, the result it needs from its own device, and the one it
    needs from the stage next to it (``_NONE`` where it needs none). A closure over the schedule's sizes: it runs
    a few times per action on tables of many thousand."""
    name, p, m, v = schedule.name, schedule.stages, schedule.microbatches, schedule.virtual
    grads, kinds, stride, last = _backward_kinds(schedule), _KIND_INDEX, 4 * m, 4 * m * (p * v - 1)
    # Results are named by global stage, so the neighbours are stage ± 1 whatever the placement.
    stage_of = [[schedule.stage_of(d, c) for c in range(v)] for d in range(p)]

    def keys(device: int, action: Action) -> tuple[int, int, int]:
        kind, mb, c = action
        k = kinds.get(kind)
        if k is None or not 0 <= mb < m or not 0 <= c < v:
            raise ScheduleError(
                f"schedule {name}: device {device}: {action.describe()} has an unknown kind or is out of range "
                f"(microbatches={m}, virtual={v}); validate the schedule first"
            )
        at = (stage_of[device][c] * m + mb) * 4  # F of this stage and microbatch
        if k == 0:  # F: the previous stage's F
            return at, _NONE, (at - stride if at >= stride else _NONE)
        if k == 2:  # W: its own B
            return at + 2, at + 1, _NONE
        # B or BW: its own F, and the next stage's B or BW (the input gradient), unless this is the last stage
        return at + k, at, (_NONE if at >= last else at + stride + grads.get(at // 4 + m, 1))

    return keys


def _describe(schedule: Schedule, key: int) -> tuple[int, Action]:
    """The (device, action) that makes result ``key``."""
    rest, k = divmod(key, 4)
    stage, mb = divmod(rest, schedule.microbatches)
    device, chunk = schedule.where(stage)
    return device, Action(KINDS[k], mb, chunk)


def _in_order(schedule: Schedule) -> Iterator[tuple[int, Action, int, int, int]]:
    """Yields every action (device, action, and its :func:`_keys_of`) in an order the devices can run them: each
    device's actions in its order, each after the results it needs. Raises :class:`ScheduleError` on a deadlock.

    A blocked device waits on the one result it lacks and is woken when that is made, so each action is looked
    at a bounded number of times; sweeping all devices until none moves is quadratic in the number of devices.
    Any order that respects the needs gives the same times, so the result does not depend on this one.
    """
    rows, keys = schedule.actions, _keys_of(schedule)
    position = [0] * len(rows)
    done = {_NONE}
    waiting: dict[int, list[int]] = {}
    ready = list(range(len(rows)))
    while ready:
        d = ready.pop()
        row, i = rows[d], position[d]
        while i < len(row):
            a = row[i]
            key, same, other = keys(d, a)
            if same not in done or other not in done:
                waiting.setdefault(same if same not in done else other, []).append(d)
                break
            yield d, a, key, same, other
            done.add(key)
            ready.extend(waiting.pop(key, ()))
            i += 1
        position[d] = i
    if any(position[d] < len(row) for d, row in enumerate(rows)):
        raise ScheduleError(_deadlock(schedule, position, done, keys))


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
    for d, row in enumerate(schedule.actions):
        _check_row(schedule, d, row)
    for _ in _in_order(schedule):  # raises on a deadlock; no times needed
        pass
    return schedule


def _check_row(schedule: Schedule, d: int, row: tuple[Action, ...]) -> None:
    """Device ``d``'s own checks: each action well formed and once, each (microbatch, chunk) complete and in
    order. Messages are built only on an error: this runs once per action on tables of many thousand."""
    name, m, v = schedule.name, schedule.microbatches, schedule.virtual
    seen: dict[tuple[str, int, int], int] = {}
    for i, a in enumerate(row):
        kind, mb, c = a
        if kind not in KINDS or not 0 <= mb < m or not 0 <= c < v or a in seen:
            where = f"schedule {name}: device {d}, position {i}: {a.describe()}"
            if kind not in KINDS:
                raise ScheduleError(f"{where}: kind must be one of {', '.join(KINDS)}")
            if not 0 <= mb < m:
                raise ScheduleError(f"{where}: microbatch out of range 0..{m - 1}")
            if not 0 <= c < v:
                raise ScheduleError(f"{where}: chunk out of range 0..{v - 1} (virtual={v})")
            raise ScheduleError(f"{where}: repeats position {seen[a]}")
        seen[a] = i
    for mb in range(m):
        for c in range(v):
            f, b, w, bw = (seen.get((k, mb, c)) for k in KINDS)  # plain tuples hash and compare as Actions
            # Complete: F, and either BW alone or both B and W.
            incomplete = (b is None or w is None) if bw is None else (b is not None or w is not None)
            if f is None or incomplete:
                what = f"schedule {name}: device {d}: microbatch {mb}, chunk {c}"
                if f is None:
                    raise ScheduleError(f"{what} has no F; every device runs F and a backward of each")
                if bw is not None:
                    raise ScheduleError(f"{what} has BW and also B or W; use either BW or the pair B, W")
                missing = "B" if b is None else "W"
                extra = "" if b is not None or w is not None else " (no backward at all)"
                raise ScheduleError(f"{what} has no {missing}{extra}; give BW, or both B and W")
            back, kind = (bw, "BW") if bw is not None else (b, "B")
            if back < f:
                raise ScheduleError(
                    f"schedule {name}: device {d}, position {back}: {Action(kind, mb, c).describe()} comes "
                    f"before its F (position {f})"
                )
            if w is not None and w < b:
                raise ScheduleError(
                    f"schedule {name}: device {d}, position {w}: {Action('W', mb, c).describe()} comes "
                    f"before its B (position {b})"
                )


# ----------------------------------------------------------------------------------------------- simulation
def _exact(x: Real, what: str) -> Fraction:
    if isinstance(x, bool) or not isinstance(x, Real):
        raise ScheduleError(f"costs: {what} must be a number, got {_short(x)}")
    if not isinstance(x, (int, Fraction)) and not math.isfinite(x):  # exact numbers are finite, and may be huge
        raise ScheduleError(f"costs: {what} must be a finite number >= 0, got {x}")
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
        if len(values) not in (3, 4) or not all(math.isfinite(x) and x >= 0 for x in values):  # nan, inf, 1e400
            raise ScheduleError(
                f"--costs {text!r}: give F,B,W (or F,B,W,comm) as finite non-negative numbers, e.g. 1,1,1"
            )
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

    @functools.cached_property
    def _whole(self) -> tuple[int, tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """Every start and end as a whole multiple of ``1/unit``, and the unit: sums and sorts of integers take a
        fraction of the time of Fractions' on tables of many thousand actions. Computed once."""
        unit = math.lcm(*{t.denominator for rows in (self.starts, self.ends) for row in rows for t in row})

        def whole(rows: tuple[tuple[Fraction, ...], ...]) -> tuple[tuple[int, ...], ...]:
            return tuple(tuple(t.numerator * (unit // t.denominator) for t in row) for row in rows)

        return unit, whole(self.starts), whole(self.ends)

    @functools.cached_property
    def busy(self) -> tuple[Fraction, ...]:
        unit, starts, ends = self._whole
        return tuple(Fraction(sum(es) - sum(ss), unit) for ss, es in zip(starts, ends, strict=True))

    @functools.cached_property
    def span(self) -> tuple[Fraction, ...]:
        """Per device: from its first action's start to its last action's end."""
        return tuple((es[-1] - ss[0]) if ss else Fraction(0) for ss, es in self._rows())

    @property
    def idle(self) -> tuple[Fraction, ...]:
        """Per device: time inside its own span spent waiting."""
        return tuple(s - b for s, b in zip(self.span, self.busy, strict=True))

    @functools.cached_property
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
        _, starts, ends = self._whole
        for d, row in enumerate(self.schedule.actions):
            events = []
            for a, s, e in zip(row, starts[d], ends[d], strict=True):
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
            "placement": self.schedule.placement,
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
    p, v = schedule.stages, schedule.virtual
    unit, op, comm, scaled = _in_units(costs, v, _factors(scale, p, v, "simulate"))
    ends = {_NONE: 0}
    starts: list[list[int]] = [[] for _ in range(p)]
    finish: list[list[int]] = [[] for _ in range(p)]
    free = [0] * p
    # The device of each global stage: a neighbour's result costs comm only from another device (one device
    # holds every stage; under the V, stages p − 1 and p share the last device).
    device_of, stride = [schedule.where(s)[0] for s in range(p * v)], 4 * schedule.microbatches
    for d, a, key, same, other in _in_order(schedule):
        wait = 0 if other == _NONE else ends[other] + (comm if device_of[other // stride] != d else 0)
        start = max(free[d], ends[same], wait)
        end = start + (op[a.kind] if scaled is None else scaled[d][a.chunk][a.kind])
        ends[key] = end
        starts[d].append(start)
        finish[d].append(end)
        free[d] = end
    return _timeline(schedule, costs, unit, starts, finish)


def _timeline(schedule: Schedule, costs: Costs, unit: int, starts: list[list[int]], ends: list[list[int]]) -> Timeline:
    """A :class:`Timeline` from times in whole multiples of ``1/unit``."""
    # Times repeat across devices: one Fraction for each distinct time.
    exact = {t: Fraction(t, unit) for t in {t for rows in (starts, ends) for row in rows for t in row}}
    starts_, ends_ = (tuple(tuple(map(exact.__getitem__, row)) for row in rows) for rows in (starts, ends))
    return Timeline(schedule, costs, starts_, ends_)


def _factors(scale: Sequence[Sequence[Real]] | None, p: int, v: int, api: str) -> list[list[Fraction]] | None:
    factor = None if scale is None else [[_exact(x, "scale") for x in row] for row in scale]
    if factor is not None and (len(factor) != p or any(len(row) != v for row in factor)):
        raise ScheduleError(f"{api}: scale must give {v} factor(s) for each of the {p} devices")
    return factor


def tick_table(schedule: Schedule) -> list[list[Action | None]]:
    """The table ``[tick][device]`` that a lock-step executor runs: every action (``BW`` too) takes one tick,
    each device runs at most one action per tick, and an action runs in the first tick after the ones it needs
    (:func:`simulate` with every op costing one tick, no comm; ``None`` where a device waits).

    >>> import strategies
    >>> s = strategies.pipeline_schedule("1f1b", stages=2, microbatches=2)
    >>> [[str(a) if a else None for a in tick] for tick in tick_table(s)]
    [['F0', None], ['F1', 'F0'], [None, 'BW0'], ['BW0', 'F1'], [None, 'BW1'], ['BW1', None]]
    """
    v = schedule.virtual  # a chunk's op costs 1/v of a stage's: scale so that every op takes one tick
    return simulate(schedule, Costs(F=v, B=v, W=v, BW=v)).ticks()


def simulate_lockstep(
    schedule: Schedule, costs: Costs | None = None, *, scale: Sequence[Sequence[Real]] | None = None
) -> Timeline:
    """Times ``schedule`` as one SPMD program runs it, in lock-step on :func:`tick_table`'s grid: each tick lasts
    as long as the dearest action any device runs in it (op times as in :func:`simulate`, ``scale[d][c]`` too),
    plus ``costs.comm``. Every action starts when its tick does and ends after its own time, so the device that
    runs a cheaper one waits out the rest of the tick (idle, bubble). The executor exchanges with both ring
    neighbours after every tick, whether or not a device has a result to send, so comm is paid once per tick
    (none on one device); the makespan ends with the last action, before the last tick's exchange. Never shorter
    than :func:`simulate`'s timeline of the same costs: it is one of the timings that respect the same order.

    >>> import strategies
    >>> s = strategies.pipeline_schedule("1f1b", stages=2, microbatches=2)
    >>> simulate_lockstep(s).makespan, simulate(s).makespan  # tick 3 pairs BW0 (2 units) with F1 (1)
    (Fraction(10, 1), Fraction(9, 1))
    """
    costs = costs or Costs()
    p, v = schedule.stages, schedule.virtual
    unit, op, comm, scaled = _in_units(costs, v, _factors(scale, p, v, "simulate_lockstep"))
    exchange = comm if p > 1 else 0
    starts: list[list[int]] = [[] for _ in range(p)]
    ends: list[list[int]] = [[] for _ in range(p)]
    now = 0
    for tick in tick_table(schedule):
        longest = 0
        for d, a in enumerate(tick):
            if a is not None:
                cost = op[a.kind] if scaled is None else scaled[d][a.chunk][a.kind]
                starts[d].append(now)
                ends[d].append(now + cost)
                longest = max(longest, cost)
        now += longest + exchange
    return _timeline(schedule, costs, unit, starts, ends)


def _in_units(
    costs: Costs, virtual: int, factor: list[list[Fraction]] | None
) -> tuple[int, dict[str, int], int, list[list[dict[str, int]]] | None]:
    """Op times as whole multiples of ``1/unit`` (the common denominator): the simulator adds and compares
    integers, several times faster than Fractions, and converts once at the end. Returns the unit, the op
    times, the comm time, and per device and chunk the op times scaled by ``factor`` (None without one)."""
    op = {kind: costs.of(kind, virtual) for kind in KINDS}
    times = list(op.values()) + [costs.comm]
    if factor is not None:
        times += [t * f for row in factor for f in row for t in op.values()]
    unit = math.lcm(*(t.denominator for t in times))
    whole = lambda t: int(t * unit)  # noqa: E731 - exact: unit is a multiple of t's denominator
    scaled = None if factor is None else [[{k: whole(t * f) for k, t in op.items()} for f in row] for row in factor]
    return unit, {k: whole(t) for k, t in op.items()}, whole(costs.comm), scaled


def _deadlock(schedule: Schedule, position: list[int], done: Collection[int], keys: Callable) -> str:
    index = {(d, a): i for d, row in enumerate(schedule.actions) for i, a in enumerate(row)}
    for d, row in enumerate(schedule.actions):
        if position[d] == len(row):
            continue
        a = row[position[d]]
        for dep in keys(d, a)[1:]:
            if dep not in done:
                dd, da = _describe(schedule, dep)
                at = (
                    f"device {dd}, position {index[dd, da]}"
                    if (dd, da) in index
                    else f"device {dd}, which never runs it"
                )
                return (
                    f"schedule {schedule.name}: device {d}, position {position[d]}: {a.describe()} needs "
                    f"{da.describe()} ({at}) first, and that cannot run before it: the table deadlocks; reorder "
                    f"so every action comes after the ones it needs"
                )
    raise AssertionError("stuck without a missing dependency")  # unreachable: progress would have been made
