"""Pictures of a simulated schedule: a text Gantt chart for terminals and a matplotlib one for files."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from spmd._schedule import Timeline

__all__ = ["gantt_text", "plot_gantt"]

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "BW": "#C44E52"}


def gantt_text(timeline: Timeline, *, max_width: int = 200) -> str:
    """One row per device, one cell per time unit (the finest op time); ``.`` is idle.

    >>> import strategies
    >>> t = strategies.pipeline_schedule("gpipe", stages=2, microbatches=2)
    >>> from spmd._schedule import simulate
    >>> print(gantt_text(simulate(t)))
    device 0 │ F0  F1  .   .   .   BW0     BW1     │
    device 1 │ .   F0  F1  BW0     BW1     .   .   │
    """
    unit = _unit(timeline)
    width = max(len(str(a)) for row in timeline.schedule.actions for a in row) + 1
    cells = int(timeline.makespan / unit)
    if cells * width > max_width:
        width = max(2, max_width // max(cells, 1))
    lines = []
    for d, row in enumerate(timeline.schedule.actions):
        line = [". ".ljust(width)] * cells
        for a, s, e in zip(row, timeline.starts[d], timeline.ends[d], strict=True):
            first, last = int(s / unit), int(e / unit)
            text = str(a).ljust(width * (last - first))[: width * (last - first)]
            for i in range(first, last):
                line[i] = text[(i - first) * width : (i - first + 1) * width]
        lines.append(f"device {d} │ " + "".join(line).rstrip().ljust(cells * width) + "│")
    return "\n".join(lines)


def _unit(timeline: Timeline) -> Fraction:
    """The largest time step dividing every start and end."""
    times = [t for row in timeline.starts + timeline.ends for t in row]
    denominator = math.lcm(*(t.denominator for t in times)) if times else 1
    numerators = [int(t * denominator) for t in times]
    return Fraction(math.gcd(*numerators) or 1, denominator)


def plot_gantt(timeline: Timeline, ax: Any = None, *, title: str | None = None) -> Any:
    """Draws the timeline on ``ax`` (a new figure if None): a bar per action, coloured by kind, labelled with
    its microbatch (and chunk); returns the axes.

    >>> import strategies
    >>> from matplotlib.figure import Figure
    >>> from spmd._schedule import simulate
    >>> ax = plot_gantt(simulate(strategies.pipeline_schedule("gpipe", stages=2, microbatches=2)), Figure().subplots())
    >>> ax.get_title(), len(ax.patches)  # one bar per action: 2 devices × 2 microbatches × (F, BW)
    ('gpipe: p=2, m=2, v=1, bubble 0.333', 8)
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, float(timeline.makespan) * 0.35), 0.5 * timeline.schedule.stages + 1))
    for d, row in enumerate(timeline.schedule.actions):
        for a, s, e in zip(row, timeline.starts[d], timeline.ends[d], strict=True):
            alpha = 1.0 - 0.45 * a.chunk / max(1, timeline.schedule.virtual - 1) if timeline.schedule.virtual > 1 else 1
            ax.barh(d, float(e - s), left=float(s), color=COLORS[a.kind], alpha=alpha, edgecolor="white")
            label = str(a.microbatch) + (f".{a.chunk}" if timeline.schedule.virtual > 1 else "")
            ax.text(float(s + e) / 2, d, label, ha="center", va="center", fontsize=7, color="white")
    s = timeline.schedule
    ax.set_yticks(range(s.stages), [f"device {d}" for d in range(s.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(
        title
        or f"{s.name}: p={s.stages}, m={s.microbatches}, v={s.virtual}, bubble {float(timeline.bubble_fraction):.3f}"
    )
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax
