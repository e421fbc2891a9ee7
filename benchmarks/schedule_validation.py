"""Schedule tables: how long loading, validating and simulating a table takes as it grows, and how it grows.

    python benchmarks/schedule_validation.py [--rows 1000,3000,10000] [--schedule gpipe] [--microbatches 2]
        [--format csv] [--repeats 3] [--profile]

Writes a pipeline schedule table with ``--rows`` devices (one CSV row per device, as ``Schedule.to_csv`` writes;
or ``Schedule.to_dict``'s JSON) to a temporary file, then times what ``spmd schedule --schedule FILE`` does with
it: ``Schedule.load``, ``validate`` and ``simulate`` (unit costs). Prints the median time of each part, the
time per action, and each size's time over the previous one's against the ratio of their action counts (linear
growth: the two match). Goal: under 1 s in all at 10,000 rows. Times are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from planning import profile  # a script beside this one: its directory is on the path

GOAL_S = 1.0
GOAL_ROWS = 10_000


def median_time(fn, repeats: int) -> float:
    """The median wall time of ``fn()`` over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_table(schedule, directory: str, fmt: str) -> str:
    path = os.path.join(directory, f"{schedule.name}-{schedule.stages}.{fmt}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(schedule.to_csv() if fmt == "csv" else json.dumps(schedule.to_dict()))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000,3000,10000", help="pipeline devices (table rows), comma-separated")
    parser.add_argument("--schedule", default="gpipe", help="the generator of the tables (a built-in schedule)")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--format", choices=("csv", "json"), default="csv")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (the median is shown)")
    parser.add_argument("--profile", action="store_true", help="always print a cProfile of the largest table")
    args = parser.parse_args()
    try:
        sizes = sorted(int(s) for s in args.rows.split(","))
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1 or args.repeats < 1 or args.microbatches < 1:
        parser.error("--rows must be positive counts, --repeats and --microbatches >= 1")

    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd.pipeline import Schedule, simulate, validate

    console = Console()
    table = Table(
        title=f"{args.schedule} tables, {args.microbatches} microbatches, {args.format}: load + validate + "
        f"simulate (unit costs), median of {args.repeats}",
        title_justify="left",
    )
    for col in ("rows", "actions", "load s", "validate s", "simulate s", "total s", "µs / action"):
        table.add_column(col, justify="right")
    table.add_column("time / previous", justify="right")
    table.add_column("actions / previous", justify="right")

    results: list[tuple[int, int, float]] = []  # rows, actions, total seconds
    with tempfile.TemporaryDirectory() as directory:
        paths = {}
        for n in sizes:
            generated = strategies.pipeline_schedule(args.schedule, stages=n, microbatches=args.microbatches)
            paths[n] = write_table(generated, directory, args.format)
            loaded = Schedule.load(paths[n])
            assert simulate(validate(loaded)).makespan == simulate(generated).makespan  # also a warm-up
            actions = sum(map(len, loaded.actions))
            load = median_time(lambda n=n: Schedule.load(paths[n]), args.repeats)
            check = median_time(lambda s=loaded: validate(s), args.repeats)
            run = median_time(lambda s=loaded: simulate(s), args.repeats)
            total = load + check + run
            grow = more = ""
            if results:  # against the row above: linear growth when the two ratios match
                grow, more = f"{total / results[-1][2]:.2f}", f"{actions / results[-1][1]:.2f}"
            results.append((n, actions, total))
            cells = (f"{load:.3f}", f"{check:.3f}", f"{run:.3f}", f"{total:.3f}", f"{total / actions * 1e6:.1f}")
            table.add_row(f"{n:,}", f"{actions:,}", *cells, grow, more)
        console.print(table)

        verdict = []
        at_goal = next((total for n, _, total in results if n == GOAL_ROWS), None)
        if at_goal is not None:
            verdict.append(f"{GOAL_ROWS:,} rows: {at_goal:.3f} s (goal < {GOAL_S} s)")
        superlinear = False
        if len(results) > 1:
            (_, a, ta), (_, b, tb) = results[-2:]
            superlinear = tb / ta > 1.5 * b / a
            verdict.append(f"growth {b:,}/{a:,} actions: time x{tb / ta:.2f} for actions x{b / a:.2f}")
        console.print("; ".join(verdict))
        if args.profile or superlinear or (at_goal is not None and at_goal > GOAL_S):
            largest = paths[sizes[-1]]
            console.print(f"cProfile of load + validate + simulate at {sizes[-1]:,} rows, GC off (by own time):")
            whole = lambda: simulate(validate(Schedule.load(largest)))  # noqa: E731
            console.print(profile(whole, top=12), markup=False, highlight=False)


if __name__ == "__main__":
    main()
