"""The commands that weigh plans against each other: ``spmd compare`` (compiled and timed side by side) and
``spmd suggest`` (ranked by the cost model, the best few confirmed by compiling)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from spmd.cli import UsageError, _batch, _console, _hardware, _optimizer, _setup, _trainer, _workload


def compare(args: argparse.Namespace) -> int:
    """``spmd compare``: one row per strategy, compiled, timed on the present devices, and modelled."""
    import jax

    import spmd

    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    if not names:
        raise UsageError("--strategies is empty; give names like dp,zero1,zero2,zero3")
    setups = [(name, *_setup(args, strategy=name)) for name in names]  # all errors first
    rows = []
    for name, model, mesh, plan, profile in setups:
        step = _trainer(model, plan, mesh, args)
        state = step.init(model.init, jax.random.key(args.seed))
        hardware = _hardware(args, profile, mesh.axis_names)
        # The rows are the comparison: a subnetwork plan's own data-parallel baseline is not needed here.
        first = _batch(model, args.seed, 0, args.batch_size)
        rep = spmd.report(step, first, hardware=hardware, against_data_parallel=False)
        times = []
        for i in range(args.timed_steps):
            batch = _batch(model, args.seed, i, args.batch_size)
            start = time.perf_counter()
            state, loss = step(state, batch)
            loss.block_until_ready()
            times.append(time.perf_counter() - start)
        d = rep.to_dict()
        row = {"strategy": name, "plan": d["plan"], "per_device_bytes": d["per_device_bytes"]}
        keys = ("compiled_memory", "analytic_memory", "collectives", "comm_bytes_per_step", "modelled_step_time")
        row |= {k: d[k] for k in (*keys, "warnings")}
        row["step_time_s"] = statistics.median(times)
        if profile is not None:
            from spmd import _cli_hetero

            row |= _cli_hetero.summary(args, step, rep, profile)
        rows.append(row)
        del state
    if args.plot:
        _plot_compare(rows, args.plot)
    if args.json:
        print(json.dumps(rows))
        return 0
    _console().print(_compare_table(rows, model.name, mesh))
    return 0


def _compare_table(rows: list[dict], model: str, mesh: Any) -> Any:
    from rich.table import Table

    from spmd import format_bytes as mb

    shown = " × ".join(f"{k}={v}" for k, v in mesh.shape.items())
    table = Table(title=f"{model} on {shown}: per device, per step", title_justify="left")
    columns = ("strategy", "model state", "compiled args+temp", "traffic compiled", "traffic analytic", "step")
    for col in (*columns, "modelled step"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in rows:
        mem = r["compiled_memory"]
        modelled = r["modelled_step_time"]
        table.add_row(
            r["strategy"],
            mb(r["per_device_bytes"]["total"]),
            mb(mem.get("argument_bytes", 0) + mem.get("temp_bytes", 0)),
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


def suggest(args: argparse.Namespace) -> int:
    """``spmd suggest``: every mesh and strategy composition for the devices, ranked by the cost model under
    the memory budget; the best few compiled on the devices present (emulated CPU devices will do)."""
    import jax
    import jax.numpy as jnp

    import spmd
    from spmd import models
    from strategies import suggest as search

    devices = len(jax.devices())
    model = models.get(args.model, **({"layers": args.layers} if args.layers else {}))
    params = jax.eval_shape(model.init, jax.random.key(args.seed))
    hardware = _hardware(args)
    budget = args.memory_per_device
    ranked, skipped = search.rank(
        params,
        _workload(model, args),
        hardware,
        devices=devices,
        memory_per_device=budget,
        optimizer=_optimizer(args),
        max_tensor=args.max_tensor,
    )
    if not ranked:
        raise ValueError(f"no plan could be built for {model.name} on {devices} devices: {skipped[0]}")
    batch = {"tokens": jax.ShapeDtypeStruct((args.batch_size, model.config.seq_len), jnp.int32)}

    def compile_report(mesh_axes: dict, plan: Any) -> Any:
        remat = models.get(args.model, **({"layers": args.layers} if args.layers else {}), remat=plan.remat)
        built = remat if args.model in models.BUILTIN else model
        step = _trainer(built, plan, spmd.make_mesh(mesh_axes), args)
        step.prepare(params)
        return spmd.report(step, batch, hardware=hardware, against_data_parallel=False)

    confirmed = search.confirm(ranked, compile_report, memory_per_device=budget, top=args.confirm)
    best, why = search.pick(confirmed, budget)
    if args.json:
        out = {
            "model": model.name,
            "devices": devices,
            "memory_per_device": budget,
            "hardware": hardware.name,
            "pick": None if best is None else best.to_dict(),
            "why": why,
            "ranked": [s.to_dict() for s in confirmed],
            "skipped": skipped,
        }
        print(json.dumps(out))
        return 0 if best is not None else 1
    console = _console()
    console.print(_suggest_table(confirmed[: args.top], model.name, devices, budget, hardware.name))
    if len(confirmed) > args.top:
        console.print(f"... {len(confirmed) - args.top} more plans (--top to show them); {len(skipped)} skipped")
    console.print(f"[bold]pick:[/] {why}" if best is not None else f"[red]{why}")
    if best is not None:
        shown = ",".join(f"{k}={v}" for k, v in best.mesh.items())
        console.print(f"run it: spmd run --model {args.model} --mesh {shown} --strategy {best.strategy}")
        for note in best.plan.notes:
            console.print(f"note: {note}")
    return 0 if best is not None else 1


def _suggest_table(rows: list, model: str, devices: int, budget: int, hardware: str) -> Any:
    from rich.table import Table

    from spmd import format_bytes as mb

    title = f"{model} on {devices} devices ({hardware}), {mb(budget)} each: plans ranked by modelled step time"
    table = Table(title=title, title_justify="left")
    columns = ("#", "mesh", "strategy", "memory (model)", "fits", "compiled peak", "traffic", "step (model)")
    for col in columns:
        # The mesh and strategy are what a reader copies into `spmd run`: never cut them short.
        table.add_column(
            col, justify="left" if col in ("mesh", "strategy", "fits") else "right", no_wrap=col in ("mesh", "strategy")
        )
    for i, s in enumerate(rows, 1):
        e = s.estimate
        peak = "" if s.compiled_memory is None else mb(s.compiled_memory.get("peak_bytes"))
        fits = "yes" if s.fits else "no"
        if s.confirmed is not None:
            fits += ", compiled " + ("fits" if s.confirmed else "does not")
        table.add_row(
            str(i),
            ",".join(f"{k}={v}" for k, v in s.mesh.items()),
            s.strategy,
            mb(e.memory_bytes),
            fits,
            peak,
            mb(e.comm_bytes),
            f"{e.time.total_s * 1e3:.3g} ms",
        )
    return table
