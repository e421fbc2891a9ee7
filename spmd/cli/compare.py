"""``spmd compare``: several strategies side by side — compiled, timed on the present devices, and modelled."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax

import spmd
from spmd.cli import hetero
from spmd.cli.common import console, dumps
from spmd.cli.parser import UsageError
from spmd.cli.setup import Setup, setup

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    """One row per strategy; the rows are the comparison."""
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    if not names:
        raise UsageError("--strategies is empty; give names like dp,zero1,zero2,zero3")
    setups = [(name, setup(args, strategy=name)) for name in names]  # all errors first
    rows = [_row(name, s, args) for name, s in setups]
    if args.plot:
        _plot_compare(rows, args.plot)
    if args.json:
        print(dumps(rows))
        return 0
    s = setups[-1][1]
    console().print(_compare_table(rows, s.model.name, s.mesh))
    return 0


def _row(name: str, s: Setup, args: argparse.Namespace) -> dict[str, Any]:
    step = s.step()
    state = step.init(s.model.init, jax.random.key(s.seed))
    report = spmd.report(step, s.batch(0), hardware=s.hardware)
    times = []
    for i in range(args.timed_steps):
        batch = s.batch(i)
        start = time.perf_counter()
        state, loss = step(state, batch)
        loss.block_until_ready()
        times.append(time.perf_counter() - start)
    d = report.to_dict()
    row = {"strategy": name, "plan": d["plan"], "per_device_bytes": d["per_device_bytes"]}
    keys = ("compiled_memory", "analytic_memory", "collectives", "comm_bytes_per_step", "modelled_step_time")
    row |= {k: d[k] for k in (*keys, "warnings")}
    row["step_time_s"] = statistics.median(times)
    if s.profile is not None:
        row |= hetero.figures(s, report, step)
    return row


def _compare_table(rows: list[dict], model: str, mesh: Any) -> Any:
    from rich.table import Table

    mb = spmd.format_bytes
    shown = " × ".join(f"{k}={v}" for k, v in mesh.shape.items())
    table = Table(title=f"{model} on {shown}: per device, per step", title_justify="left")
    columns = ("strategy", "model state", "compiled args+temp", "traffic compiled", "traffic analytic", "step")
    host = any("host_argument_bytes" in r["compiled_memory"] for r in rows)  # offloaded state: its own column
    for col in (*columns[:3], *(("compiled host",) if host else ()), *columns[3:], "modelled step"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in rows:
        mem = r["compiled_memory"]
        modelled = r["modelled_step_time"]
        table.add_row(
            r["strategy"],
            mb(r["per_device_bytes"]["total"]),
            mb(mem.get("argument_bytes", 0) + mem.get("temp_bytes", 0)),
            *((mb(mem.get("host_argument_bytes", 0)),) if host else ()),
            mb(r["comm_bytes_per_step"]["compiled"]),
            mb(r["comm_bytes_per_step"]["analytic"]),
            f"{r['step_time_s'] * 1e3:.0f} ms",
            f"{modelled['total_s'] * 1e3:.3g} ms ({modelled['hardware']})",
        )
    return table


def _plot_compare(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r["strategy"] for r in rows]
    x = np.arange(len(rows))
    fig, (mem, comm) = plt.subplots(1, 2, figsize=(10, 3.6))
    mib = 1 / (1 << 20)
    state = [r["per_device_bytes"]["total"] * mib for r in rows]
    peak = [
        (r["compiled_memory"].get("argument_bytes", 0) + r["compiled_memory"].get("temp_bytes", 0)) * mib for r in rows
    ]
    mem.bar(x - 0.2, state, 0.4, label="model state (planned)")
    mem.bar(x + 0.2, peak, 0.4, label="arguments + temporaries (compiled)")
    mem.set(title="memory per device", ylabel="MiB", xticks=x, xticklabels=names)
    mem.legend(fontsize=8)
    comm.bar(x - 0.2, [r["comm_bytes_per_step"]["compiled"] * mib for r in rows], 0.4, label="compiled")
    comm.bar(x + 0.2, [r["comm_bytes_per_step"]["analytic"] * mib for r in rows], 0.4, label="analytic")
    comm.set(title="collective traffic per device per step", ylabel="MiB", xticks=x, xticklabels=names)
    comm.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
