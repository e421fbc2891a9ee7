"""``spmd schedule``: simulate a pipeline schedule and show it (text Gantt chart, JSON, PNG)."""

from __future__ import annotations

import argparse
import json

import strategies
from spmd.cli.common import console as make_console
from spmd.cli.parser import UsageError
from spmd.cli.setup import schedule_arg
from spmd.pipeline import Costs, Timeline, gantt_text, plot_gantt, simulate, simulate_lockstep, validate

__all__ = ["command"]


# A text chart has a row per device and a column per time unit: past this many devices it is neither readable
# nor small (it grows as devices × time units), so the figures are printed without it.
CHART_DEVICES = 256


def command(args: argparse.Namespace) -> int:
    """Simulates the schedule: no devices needed."""
    costs = Costs.parse(args.costs) if args.costs else Costs()  # checked before a table is read
    if args.schedule.endswith((".json", ".csv")):
        # A table fixes its devices, microbatches and chunks: a flag for them would be silently ignored.
        for flag in ("stages", "microbatches", "virtual"):
            if flag in getattr(args, "given", ()):
                raise UsageError(f"--{flag}: the schedule table {args.schedule} fixes it; remove the flag")
    table = schedule_arg(args.schedule)
    if isinstance(table, str):
        table = strategies.pipeline_schedule(
            table, stages=args.stages, microbatches=args.microbatches or 2 * args.stages, virtual=args.virtual
        )
    else:
        validate(table)
    timeline = simulate(table, costs)
    # With costs given, also as one SPMD program runs it: each tick as long as its dearest action.
    lockstep = simulate_lockstep(table, costs) if args.costs else None
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ax = plot_gantt(timeline)
        ax.figure.tight_layout()
        ax.figure.savefig(args.plot, dpi=120)
        plt.close(ax.figure)
    if args.json:
        out = timeline.to_dict()
        if lockstep is not None:
            out["lockstep"] = _figures(lockstep)
        print(json.dumps(out))
        return 0
    console = make_console()
    s = timeline.schedule
    console.print(
        f"[bold]{s.name}[/]: {s.stages} stages, {s.microbatches} microbatches, {s.virtual} chunk(s) per device"
    )
    if s.stages <= CHART_DEVICES:
        console.print(gantt_text(timeline), highlight=False, soft_wrap=True)
    else:
        console.print(
            f"(no chart for {s.stages} devices, more than {CHART_DEVICES}: --json lists every action with its start "
            f"and end)",
            highlight=False,
        )
    busy = " ".join(f"{float(b):g}" for b in timeline.busy)
    console.print(
        f"makespan {float(timeline.makespan):g}, bubble fraction {float(timeline.bubble_fraction):.4f} "
        f"({timeline.bubble_fraction}); busy per device {busy}; peak in flight {list(timeline.peak_inflight)}, "
        f"held until W {list(timeline.peak_held)}"
    )
    if lockstep is not None:
        console.print(
            f"lock-step (one action per device per tick, each tick as long as its dearest action): makespan "
            f"{float(lockstep.makespan):g}, bubble fraction {float(lockstep.bubble_fraction):.4f} "
            f"({lockstep.bubble_fraction})"
        )
    return 0


def _figures(timeline: Timeline) -> dict[str, object]:
    return {
        "makespan": float(timeline.makespan),
        "bubble_fraction": float(timeline.bubble_fraction),
        "busy": [float(x) for x in timeline.busy],
    }
