"""The ``spmd`` command: plan, run and demo a partitioning plan on a built-in or user model.

User mistakes exit with status 2 and one line on stderr; set SPMD_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn

DEMO = {"model": "gpt-tiny", "mesh": "data=2,fsdp=2,tensor=2", "strategy": "dp+fsdp+tp", "steps": 20}


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    top = _Parser(prog="spmd", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p: argparse.ArgumentParser, *, demo: bool = False) -> None:
        p.add_argument("--devices", type=int, help="emulate N CPU devices (default: the accelerators, else 8 CPUs)")
        p.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and of the data")
        p.add_argument("--batch-size", type=int, default=32, help="global batch size (sequences)")
        p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (eps 1e-6)")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
        if demo:
            return
        p.add_argument("--model", default="gpt-tiny", help="built-in name, or package.module:factory")
        p.add_argument("--mesh", default="data=-1", help="axis=size pairs, e.g. data=2,fsdp=2,tensor=2")
        p.add_argument("--strategy", default="dp", help="registry names joined by '+', e.g. dp+fsdp+tp")
        p.add_argument("--layers", type=int, help="override the model's number of layers")

    plan = sub.add_parser("plan", help="show how a plan lays out a model, and what the compiler makes of it")
    common(plan)
    run = sub.add_parser("run", help="train with a plan (and --check it against one device)")
    common(run)
    run.add_argument("--steps", type=int, default=10, help="training steps")
    run.add_argument("--check", action="store_true", help="also train on one device and compare")
    compare = sub.add_parser("compare", help="several strategies side by side: memory, traffic, step time")
    common(compare)
    compare.add_argument("--strategies", default="dp,zero1,zero2,zero3", help="comma-separated --strategy values")
    compare.add_argument("--timed-steps", type=int, default=3, help="steps timed per strategy (median reported)")
    compare.add_argument("--plot", help="write a bar chart of memory and traffic to this PNG file")
    demo = sub.add_parser("demo", help="the main job: gpt-tiny on data=2 × fsdp=2 × tensor=2, checked")
    common(demo, demo=True)
    demo.add_argument("--steps", type=int, default=DEMO["steps"])
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spmd`` command."""
    try:
        args = _parser().parse_args(argv)
        _check_args(args)
        _start_devices(args.devices)
        return {"plan": _plan, "run": _run, "compare": _compare, "demo": _demo}[args.command](args)
    except Exception as e:  # noqa: BLE001 - every user mistake becomes one line; SPMD_DEBUG shows the rest
        if os.environ.get("SPMD_DEBUG") or not _is_user_error(e):
            raise
        message = " ".join(str(e).split())
        print(f"spmd: error: {message}", file=sys.stderr)
        return 2


def _is_user_error(e: Exception) -> bool:
    from spmd._plan import PlanError

    return isinstance(e, (UsageError, PlanError, ValueError, RuntimeError, ImportError))


def _check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "batch_size", "devices", "layers", "timed_steps"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.lr <= 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")


def _start_devices(devices: int | None) -> None:
    import jax

    import spmd

    started = spmd._devices.backend_started()
    if devices is not None:
        if not started:
            jax.config.update("jax_platforms", "cpu")  # an explicit count means emulated CPU devices
        spmd.emulate_devices(devices)
    elif not started:
        spmd.emulate_devices(8)  # only the CPU platform listens; accelerators are used as they are


# ------------------------------------------------------------------------------------------------- pieces
def _setup(model_name: str, mesh_text: str, strategy: str, layers: int | None) -> tuple[Any, Any, Any]:
    import spmd
    import strategies
    from spmd import models

    axes = spmd.parse_mesh(mesh_text)
    mesh = spmd.make_mesh(axes)
    plan = strategies.from_names(strategy, dict(mesh.shape))
    overrides = {"layers": layers} if layers else {}
    if plan.remat and model_name in models.BUILTIN:  # user factories need not know the option
        overrides["remat"] = True
    model = models.get(model_name, **overrides)
    return model, mesh, plan


def _trainer(model: Any, plan: Any, mesh: Any, args: argparse.Namespace) -> Any:
    import optax

    import spmd
    from spmd import models

    # eps=1e-6 rather than 1e-8: with 1e-8, Adam turns reduction-order noise in near-zero gradients into
    # parameter differences near 1e-4 after 20 steps, and --check could no longer tell noise from a bug.
    return spmd.train_step(models.loss_fn(model), optax.adam(args.lr, eps=1e-6), plan, mesh)


def _batch(model: Any, seed: int, step: int, batch_size: int) -> dict[str, Any]:
    from spmd import data

    return data.batch(seed, step, batch_size, model.config.seq_len, model.config.vocab)


def _train(
    model: Any, plan: Any, mesh: Any, args: argparse.Namespace, *, label: str, quiet: bool, before: Any = None
) -> tuple:
    """Trains ``args.steps`` steps; returns (losses, final params on the host, the step object).

    ``before(step)`` runs after the step is compiled and before training (the demo prints its report there).
    """
    import jax
    import numpy as np
    from rich.progress import Progress

    step = _trainer(model, plan, mesh, args)
    state = step.init(model.init, jax.random.key(args.seed))
    step.compile(_batch(model, args.seed, 0, args.batch_size))
    if before is not None:
        before(step)
    losses = []
    with Progress(transient=True, disable=quiet, console=_console(stderr=True)) as bar:
        task = bar.add_task(label, total=args.steps)
        for i in range(args.steps):
            state, loss = step(state, _batch(model, args.seed, i, args.batch_size))
            losses.append(float(loss))
            bar.update(task, advance=1, description=f"{label} loss {losses[-1]:.3f}")
    return losses, jax.tree.map(np.asarray, state.params), step


def _reference(model: Any, args: argparse.Namespace, quiet: bool) -> tuple:
    """The same training on a single device, from the same initial parameters and data."""
    import jax

    import spmd

    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    return _train(model, spmd.Plan(), one, args, label="one device", quiet=quiet)


def _max_abs_diff(losses: list[float], ref: list[float], params: Any, ref_params: Any) -> float:
    import jax
    import numpy as np

    diffs = [abs(a - b) for a, b in zip(losses, ref, strict=True)]
    diffs += [
        float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
    ]
    return max(diffs)


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal rich assumes 80 columns, too narrow for parameter paths; COLUMNS still wins.
    width = None if stream.isatty() or "COLUMNS" in os.environ else 120
    return Console(stderr=stderr, width=width)


# ------------------------------------------------------------------------------------------------- commands
def _plan(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    import spmd

    model, mesh, plan = _setup(args.model, args.mesh, args.strategy, args.layers)
    step = _trainer(model, plan, mesh, args)
    step.prepare(jax.eval_shape(model.init, jax.random.key(args.seed)))
    batch = {"tokens": jax.ShapeDtypeStruct((args.batch_size, model.config.seq_len), jnp.int32)}
    rep = spmd.report(step, batch)
    if args.json:
        print(json.dumps({"model": model.name, **rep.to_dict()}))
    else:
        _console().print(rep)
    return 0


def _run(args: argparse.Namespace) -> int:
    model, mesh, plan = _setup(args.model, args.mesh, args.strategy, args.layers)
    losses, params, _ = _train(model, plan, mesh, args, label=args.strategy, quiet=args.json)
    out: dict[str, Any] = {
        "model": model.name,
        "mesh": dict(mesh.shape),
        "strategy": args.strategy,
        "losses": losses,
    }
    if args.check:
        ref, ref_params, _ = _reference(model, args, quiet=args.json)
        out["reference_losses"] = ref
        out["max_abs_diff"] = _max_abs_diff(losses, ref, params, ref_params)
    if args.json:
        print(json.dumps(out))
    else:
        console = _console()
        console.print(f"losses: {' '.join(f'{x:.4f}' for x in losses)}")
        if args.check:
            console.print(f"one device: {' '.join(f'{x:.4f}' for x in out['reference_losses'])}")
            console.print(f"max |difference| over losses and parameters: {out['max_abs_diff']:.2e}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    import statistics
    import time

    import jax

    import spmd

    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    if not names:
        raise UsageError("--strategies is empty; give names like dp,zero1,zero2,zero3")
    setups = [(name, *_setup(args.model, args.mesh, name, args.layers)) for name in names]  # all errors first
    rows = []
    for name, model, mesh, plan in setups:
        step = _trainer(model, plan, mesh, args)
        state = step.init(model.init, jax.random.key(args.seed))
        rep = spmd.report(step, _batch(model, args.seed, 0, args.batch_size))
        times = []
        for i in range(args.timed_steps):
            batch = _batch(model, args.seed, i, args.batch_size)
            start = time.perf_counter()
            state, loss = step(state, batch)
            loss.block_until_ready()
            times.append(time.perf_counter() - start)
        d = rep.to_dict()
        row = {"strategy": name, "plan": d["plan"], "per_device_bytes": d["per_device_bytes"]}
        row |= {k: d[k] for k in ("compiled_memory", "collectives", "comm_bytes_per_step", "warnings")}
        row["step_time_s"] = statistics.median(times)
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

    from spmd._report import _mb

    shown = " × ".join(f"{k}={v}" for k, v in mesh.shape.items())
    table = Table(title=f"{model} on {shown}: per device, per step", title_justify="left")
    for col in ("strategy", "model state", "compiled args+temp", "traffic compiled", "traffic analytic", "step"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in rows:
        mem = r["compiled_memory"]
        table.add_row(
            r["strategy"],
            _mb(r["per_device_bytes"]["total"]),
            _mb(mem.get("argument_bytes", 0) + mem.get("temp_bytes", 0)),
            _mb(r["comm_bytes_per_step"]["compiled"]),
            _mb(r["comm_bytes_per_step"]["analytic"]),
            f"{r['step_time_s'] * 1e3:.0f} ms",
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


def _demo(args: argparse.Namespace) -> int:
    import jax

    import spmd
    from spmd import data

    model, mesh, plan = _setup(DEMO["model"], DEMO["mesh"], DEMO["strategy"], None)
    console = _console()
    platform = jax.devices()[0].platform
    console.rule(f"spmd demo: {model.name} on {mesh.size} {platform} devices, strategy {DEMO['strategy']}")
    reports = []

    def show(step: Any) -> None:
        reports.append(spmd.report(step, _batch(model, args.seed, 0, args.batch_size)))
        if not args.json:
            console.print(reports[0])

    losses, params, _ = _train(model, plan, mesh, args, label=DEMO["strategy"], quiet=args.json, before=show)
    rep = reports[0]
    ref, ref_params, _ = _reference(model, args, quiet=args.json)
    diff = _max_abs_diff(losses, ref, params, ref_params)
    best = data.entropy_rate(args.seed, model.config.vocab)
    if args.json:
        print(json.dumps({**rep.to_dict(), "losses": losses, "reference_losses": ref, "max_abs_diff": diff}))
        return 0 if diff <= 1e-4 else 1
    console.rule("summary")
    console.print(_summary(rep, losses, diff, best))
    return 0 if diff <= 1e-4 else 1


def _summary(rep: Any, losses: list[float], diff: float, best: float) -> Any:
    from rich.table import Table

    from spmd._report import _mb

    table = Table(show_header=False, box=None, padding=(0, 1))
    groups: dict[str, list[int]] = {}
    for row in rep.params:
        axes = [a for e in row.spec if e for a in ((e,) if isinstance(e, str) else e)]
        groups.setdefault(" × ".join(sorted(axes)) or "replicated", []).append(row.bytes)
    total = sum(map(sum, groups.values()))
    how = "; ".join(
        f"{k}: {len(v)} arrays, {sum(v) / total:.0%} of bytes"
        for k, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    )
    table.add_row("[bold]sharded how", how)
    pd = rep.per_device_bytes
    cm = rep.compiled_memory
    table.add_row(
        "[bold]memory/device",
        f"model state {_mb(pd['total'])} (params {_mb(pd['params'])}, grads {_mb(pd['grads'])}, "
        f"optimizer {_mb(pd['optimizer'])}); compiled: arguments {_mb(cm.get('argument_bytes'))}, "
        f"temporaries {_mb(cm.get('temp_bytes'))}",
    )
    comms = ", ".join(f"{c.count}× {c.kind} over {'+'.join(c.axes) or '-'}" for c in rep.collectives) or "none"
    table.add_row("[bold]collectives", comms)
    table.add_row("[bold]loss", f"{sparkline(losses)}  {losses[0]:.3f} → {losses[-1]:.3f} (chain entropy {best:.3f})")
    verdict = "[green]matches" if diff <= 1e-4 else "[red]DIFFERS FROM"
    table.add_row("[bold]check", f"{verdict}[/] the single-device run: max |difference| {diff:.1e} (tolerance 1e-4)")
    return table


def sparkline(values: list[float]) -> str:
    """A loss curve as one line of text.

    >>> sparkline([3.0, 2.0, 1.0])
    '█▅▁'
    """
    blocks = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(blocks[round((v - lo) / span * (len(blocks) - 1))] for v in values)


if __name__ == "__main__":
    sys.exit(main())
