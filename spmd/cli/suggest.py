"""``spmd suggest``: every mesh and strategy composition for the devices, ranked by the cost model under the
memory budget; the best few compiled on the devices present (emulated CPU devices will do)."""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp

import spmd
from spmd import costmodel, models
from spmd.cli.common import console as make_console
from spmd.cli.common import dumps
from spmd.cli.setup import context_options, hardware_of, optimizer_of, profile_of, size_overrides
from strategies import suggest as search

__all__ = ["command"]

_BF16 = spmd.Precision(compute="bfloat16", params="float32", gather="bfloat16")  # what run's --precision bf16 asks
_PRECISIONS = {"fp32": (None,), "bf16": (_BF16,), "any": (None, _BF16)}


def command(args: argparse.Namespace) -> int:
    devices = len(jax.devices())
    sizes = size_overrides(args.model, args)
    model = models.get(args.model, **sizes)
    params = jax.eval_shape(model.init, jax.random.key(args.seed))
    hardware, optimizer, budget = hardware_of(args), optimizer_of(args), args.memory_per_device
    workload = costmodel.Workload(batch=args.batch_size, seq_len=model.config.seq_len)
    batch = {"tokens": jax.ShapeDtypeStruct((args.batch_size, model.config.seq_len), jnp.int32)}

    def build(plan: spmd.Plan) -> models.Model:
        """The model as run builds it for ``plan``: the plan's remat policy, bf16 under bf16."""
        if args.model not in models.BUILTIN:
            return model
        bf16 = {"dtype": jnp.bfloat16} if plan.precision is not None else {}
        built = models.get(args.model, **sizes, **bf16)
        return models.rematerialised(built, plan.remat) if plan.remat else built

    ranked, skipped = search.rank(
        params,
        workload,
        hardware,
        devices=devices,
        memory_per_device=budget,
        optimizer=optimizer,
        max_tensor=args.max_tensor,
        # A context axis splits the sequence (cp): every size the devices and the sequence's half-chunks allow.
        contexts=[c for c in range(1, min(args.max_context, devices) + 1) if devices % c == 0],
        context_options=context_options(args),
        remat=args.remat,
        # The policies are searched with the strategies: every remat policy (unless --remat fixes one), up to 8
        # microbatches per step, and bf16 only where asked for, since it changes the numbers a step computes.
        remats=() if args.remat is not None else ("none", "full", "dots"),
        accumulations=(1, 2, 4, 8),
        precisions=_PRECISIONS[args.precision],
        # On devices of different speeds the data-parallel ranks take shares by speed (--even: none).
        profile=None if args.even else profile_of(args, devices),
        microbatch=args.microbatch,
        # Pipelines over a stage axis of every size the devices allow, each schedule asked for, for a model cut
        # into stages; each priced by its executor, as run would build it.
        stages=[
            s for s in range(1, min(args.max_stages, devices) + 1) if devices % s == 0 and (s == 1 or model.staged)
        ],
        schedules=args.schedules,
        microbatches_per_stage=(2, 4),
        price=lambda mesh_axes, plan: _executor_costs(
            build(plan), optimizer, plan, mesh_axes, params, batch, workload, args.axis_types == "explicit"
        ),
    )
    if not ranked:
        raise ValueError(f"no plan could be built for {model.name} on {devices} devices: {skipped[0]}")

    def compile_report(mesh_axes: dict, plan: spmd.Plan) -> spmd.Report:
        mesh = spmd.make_mesh(mesh_axes, explicit=args.axis_types == "explicit")
        built = build(plan)
        step = spmd.TrainStep(models.loss_fn(built), optimizer, plan, mesh, params=params, staged=built.staged)
        return spmd.report(step, batch, hardware=hardware)

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
        print(dumps(out))
    else:
        _show(args, model.name, devices, hardware.name, confirmed, skipped, best, why)
    return 0 if best is not None else 1


def _executor_costs(
    model: models.Model,
    optimizer: Any,
    plan: spmd.Plan,
    mesh_axes: dict,
    params: Any,
    batch: Any,
    workload: Any,
    explicit: bool,
) -> tuple[Any, costmodel.Contribution]:
    """What an executed plan (a pipeline) stores and contributes to the estimate, from a training step built
    for it on the devices present, as run builds it (nothing compiled; each plan is priced once, the ranking
    keeps no two alike)."""
    mesh = spmd.make_mesh(mesh_axes, explicit=explicit)
    step = spmd.TrainStep(models.loss_fn(model), optimizer, plan, mesh, params=params, staged=model.staged)
    return step.layout, step.executor.costs(step.layout, batch, workload)


def _show(
    args: argparse.Namespace,
    model: str,
    devices: int,
    hardware: str,
    confirmed: list,
    skipped: list,
    best: Any,
    why: str,
) -> None:
    console = make_console()
    console.print(_suggest_table(confirmed[: args.top], model, devices, args.memory_per_device, hardware))
    if len(confirmed) > args.top:
        console.print(f"... {len(confirmed) - args.top} more plans (--top to show them); {len(skipped)} skipped")
    console.print(f"[bold]pick:[/] {why}" if best is not None else f"[red]{why}")
    if best is not None:
        console.print(f"run it: {_run_command(args, best)}", highlight=False)
        for note in best.plan.notes:
            console.print(f"note: {note}")


def _run_command(args: argparse.Namespace, best: Any) -> str:
    """``spmd run`` for the pick, with the flags the ranking depended on: without them run would lay out another
    job (its own batch size and layers; 8 emulated devices where suggest had --devices 64; osdp priced for
    another device) or refuse it (osdp needs --memory-per-device)."""
    shown = ",".join(f"{k}={v}" for k, v in best.mesh.items())
    parts = [f"spmd run --model {args.model} --mesh {shown} --strategy {best.strategy}", *best.flags]
    if args.remat is not None and "--remat" not in best.flags:  # every ranked plan took it in place of its own
        parts += ["--remat", args.remat.form]
    if args.devices is not None:
        parts.append(f"--devices {args.devices}")
    if args.layers:
        parts.append(f"--layers {args.layers}")
    if args.seq_len:
        parts.append(f"--seq-len {args.seq_len}")
    if "cp" in best.strategy.split("+"):  # the context options the ranking priced
        parts += [f"--cp-method {args.cp_method}"] + (["--no-load-balance"] if args.no_load_balance else [])
        parts += ["--cp-shard-params"] if args.cp_shard_params else []
    for flag in ("device_speeds", "device_memory", "device_profile"):  # the devices the ranking priced
        if getattr(args, flag, None):
            parts.append(f"--{flag.replace('_', '-')} {getattr(args, flag)}")
    parts += [f"--microbatch {args.microbatch}"] if args.microbatch != 1 and "--microbatch" not in best.flags else []
    parts += ["--even"] if args.even and "--even" not in best.flags else []
    if args.device_kind:  # the cost model's device, which chooses osdp's layout
        parts.append(f"--device-kind {args.device_kind}")
    parts.append(f"--batch-size {args.batch_size} --memory-per-device {args.memory_per_device}")
    return " ".join(parts)


def _suggest_table(rows: list, model: str, devices: int, budget: int, hardware: str) -> Any:
    from rich.table import Table

    mb = spmd.format_bytes

    title = f"{model} on {devices} devices ({hardware}), {mb(budget)} each: plans ranked by modelled step time"
    table = Table(title=title, title_justify="left")
    columns = (
        "#",
        "mesh",
        "strategy",
        "policies",
        "memory (model)",
        "fits",
        "compiled peak",
        "traffic",
        "step (model)",
    )
    for col in columns:
        # The mesh and strategy are what a reader copies into `spmd run`: never cut them short.
        table.add_column(
            col,
            justify="left" if col in ("mesh", "strategy", "policies", "fits") else "right",
            no_wrap=col in ("mesh", "strategy", "policies"),
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
            " ".join(s.flags),
            mb(e.memory_bytes),
            fits,
            peak,
            mb(e.comm_bytes),
            f"{s.step_s * 1e3:.3g} ms",
        )
    return table
