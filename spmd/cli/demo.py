"""``spmd demo``: the main job — gpt-tiny on data=2 × fsdp=2 × tensor=2, its report, training with a progress
bar, the same steps on one device, and a one-screen summary of what happened."""

from __future__ import annotations

import argparse
import math

import jax
from rich.table import Table

import spmd
from spmd import data
from spmd.cli.common import console as make_console
from spmd.cli.common import dumps, sparkline
from spmd.cli.parser import DEMO, UsageError
from spmd.cli.setup import setup
from spmd.cli.train import max_abs_diff, reference, train

__all__ = ["command"]

TOLERANCE = 1e-4  # the largest difference from one device the demo calls a match


def command(args: argparse.Namespace) -> int:
    _check_devices()
    s = setup(args, model_name=DEMO["model"], mesh_text=DEMO["mesh"], strategy=DEMO["strategy"])
    console = make_console()
    console.rule(
        f"spmd demo: {s.model.name} on {s.mesh.size} {jax.devices()[0].platform} devices, strategy {DEMO['strategy']}"
    )
    reports = []

    def show(step: spmd.TrainStep) -> None:
        reports.append(spmd.report(step, s.batch(0), hardware=s.hardware))
        if not args.json:
            console.print(reports[0])

    run = train(s, args, label=DEMO["strategy"], quiet=args.json, before=show)
    ref = reference(s, args, quiet=args.json)
    diff = max_abs_diff(run, ref)
    if args.json:
        out = {**reports[0].to_dict(), "losses": run.losses, "reference_losses": ref.losses, "max_abs_diff": diff}
        print(dumps(out))
        return 0 if diff <= TOLERANCE else 1
    console.rule("summary")
    console.print(_summary(reports[0], run.losses, diff, data.entropy_rate(args.seed, s.model.config.vocab)))
    return 0 if diff <= TOLERANCE else 1


def _check_devices() -> None:
    """The demo's mesh is fixed (it takes no --mesh), so a device count that does not fit it is fixed by the
    device count: --devices in one process, the launcher's flags under spmd launch (where --devices is refused)."""
    need = math.prod(spmd.parse_mesh(DEMO["mesh"]).values())
    have = jax.device_count()
    if have == need:
        return
    fix = (
        f"start it with {need} devices in all (spmd launch --processes P --devices-per-process D with P × D = {need})"
        if jax.process_count() > 1
        else f"run it with --devices {need} (emulated CPU devices)"
    )
    raise UsageError(f"spmd demo runs on the mesh {DEMO['mesh']} of {need} devices and this run has {have}; {fix}")


def _summary(report: spmd.Report, losses: list[float], diff: float, best: float) -> Table:
    mb = spmd.format_bytes
    table = Table(show_header=False, box=None, padding=(0, 1))
    groups: dict[str, list[int]] = {}
    for row in report.params:
        groups.setdefault(" × ".join(sorted(row.axes)) or "replicated", []).append(row.bytes)
    total = sum(map(sum, groups.values()))
    how = "; ".join(
        f"{k}: {len(v)} arrays, {sum(v) / total:.0%} of bytes"
        for k, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    )
    table.add_row("[bold]sharded how", how)
    pd, cm = report.per_device_bytes, report.compiled_memory
    table.add_row(
        "[bold]memory/device",
        f"model state {mb(pd['total'])} (params {mb(pd['params'])}, grads {mb(pd['grads'])}, "
        f"optimizer {mb(pd['optimizer'])}); compiled: arguments {mb(cm.get('argument_bytes'))}, "
        f"temporaries {mb(cm.get('temp_bytes'))}",
    )
    comms = ", ".join(f"{c.count}× {c.kind} over {'+'.join(c.axes) or '-'}" for c in report.collectives) or "none"
    table.add_row("[bold]collectives", comms)
    table.add_row("[bold]loss", f"{sparkline(losses)}  {losses[0]:.3f} → {losses[-1]:.3f} (chain entropy {best:.3f})")
    verdict = "[green]matches" if diff <= TOLERANCE else "[red]DIFFERS FROM"
    table.add_row("[bold]check", f"{verdict}[/] the single-device run: max |difference| {diff:.1e} (tolerance 1e-4)")
    return table
