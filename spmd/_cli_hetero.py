"""Heterogeneous meshes on the command line: device profiles from flags, files or measurement; uneven shares
or stages planned from them; the modelled even and uneven step times."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from spmd._profile import parse_bytes
from spmd.cli import UsageError


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-speeds", help="relative speed of each device in mesh order, e.g. 3,3,1,1,1,1,2,2")
    p.add_argument("--device-memory", help="memory of each device (or one for all), e.g. 16GiB,16GiB,8GiB,...")
    p.add_argument("--device-profile", help="a JSON device profile (spmd profile writes one)")
    p.add_argument("--even", action="store_true", help="ignore the profile's speeds: the homogeneous split")
    p.add_argument("--microbatch", type=int, default=1, help="uneven shares are multiples of this many examples")


def profile_from_args(args: argparse.Namespace, devices: int) -> Any:
    """The device profile the flags give, checked against the mesh's device count; None without one."""
    from spmd._profile import Profile

    speeds, memory, path = (getattr(args, k, None) for k in ("device_speeds", "device_memory", "device_profile"))
    if path and (speeds or memory):
        raise UsageError("give either --device-profile or --device-speeds/--device-memory, not both")
    if path:
        profile = Profile.load(path)
    elif speeds or memory:
        values = _numbers(speeds, "--device-speeds") if speeds else [1.0] * devices
        sizes = [parse_bytes(m, "--device-memory") for m in memory.split(",")] if memory else None
        profile = Profile.from_speeds(values, sizes)
    else:
        return None
    try:
        return profile.check(devices)
    except ValueError as e:
        raise UsageError(f"{e} (the mesh has {devices} devices)") from None


def _numbers(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise UsageError(f"{flag} {text!r}: give one positive number per device, e.g. 3,3,1,1")
    return values


def apply(args: argparse.Namespace, model: Any, mesh: Any, plan: Any, profile: Any) -> tuple[Any, Any, Any]:
    """Places devices of one kind together (so tensor groups stay inside a kind) and turns the plan uneven:
    a pipeline gets layers per stage by stage speed, data parallelism batch shares by device speed and memory.
    With ``--even`` the plan stays homogeneous (the profile still prices it)."""
    import dataclasses

    import spmd
    from strategies import hetero

    axes = dict(mesh.shape)
    if len(set(profile.kinds)) > 1 and len(axes) > 1:
        order = hetero.kind_order(profile, axes)
        mesh = spmd.make_mesh(axes, devices=[mesh.devices.flat[i] for i in order])
        profile = profile.reordered(order)
    if args.even:
        return mesh, plan, profile
    if plan.pipeline is not None:
        if args.layers_per_stage or plan.pipeline.schedule.virtual > 1:
            return mesh, plan, profile  # layers given by hand, or chunks that loop over every stage
        layers = model.config.layers
        counts = hetero.stage_layers(layers, profile, axes, axis=plan.pipeline.axis)
        return (
            mesh,
            dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, layers_per_stage=counts)),
            profile,
        )
    if "data" not in plan.batch_axes or axes.get("data", 1) == 1:
        raise UsageError(
            "a device profile gives data-parallel ranks uneven batch shares, or pipeline stages uneven layers: "
            "the plan needs a data axis (dp) or a pipeline (pp); or pass --even"
        )
    others = [a for a in plan.batch_axes if a != "data" and axes.get(a, 1) > 1]
    if others:
        raise UsageError(
            f"uneven batch shares split only the data axis, but this plan also splits the batch over {others}; "
            f"use dp with tp (or pass --even)"
        )
    state_bytes = example_bytes = 0
    if any(m is not None for m in profile.memory):
        state_bytes, example_bytes = _memory_per_example(args, model, axes, plan)
    shares = hetero.batch_shares(
        args.batch_size,
        profile,
        axes,
        axis="data",
        state_bytes=state_bytes,
        example_bytes=example_bytes,
        granularity=args.microbatch,
    )
    return mesh, plan + hetero.uneven_data_parallel(shares), profile


def _memory_per_example(args: argparse.Namespace, model: Any, axes: dict, plan: Any) -> tuple[int, int]:
    """Per device: the model state, and the activations one example keeps for the backward pass."""
    import jax

    import spmd
    from spmd import cli, costmodel

    params = jax.eval_shape(model.init, jax.random.key(args.seed))
    layout = spmd.resolve_state(plan, params, cli._optimizer(args), axes)
    state = costmodel.model_state_bytes(layout)["total"]
    one_each = costmodel.Workload(batch=axes["data"], seq_len=model.config.seq_len)
    return state, int(costmodel.activation_bytes(layout.params.leaves, plan, axes, one_each))


def summary(args: argparse.Namespace, step: Any, report: Any, profile: Any) -> dict[str, Any]:
    """``batch_shares`` or ``layers_per_stage``, the modelled step time of the even split and of the uneven one,
    their ratio, and the ideal ratio Σs / (N · min s)."""
    from strategies import hetero

    layers = step.pipeline.placement.counts if step.pipeline is not None else None
    return hetero.summary(
        step.plan,
        dict(step.mesh.shape),
        profile,
        args.batch_size,
        report.flops_per_device,
        report.modelled_step_time,
        layers,
    )


def text(info: dict[str, Any]) -> str:
    split = (
        f"batch shares {info['batch_shares']}"
        if info.get("batch_shares")
        else f"layers per stage {info['layers_per_stage']}"
        if info.get("layers_per_stage")
        else "even split"
    )
    t = info["simulated_step_time"]
    speedup, ideal = info["simulated_speedup"], info["ideal_speedup"]
    return (
        f"heterogeneous devices (speeds {info['device_speeds']}): {split}; modelled step "
        f"{t['even'] * 1e3:.3g} ms even → {t['hetero'] * 1e3:.3g} ms uneven, speedup {speedup:.3f} (ideal {ideal:.3f})"
    )


def profile_command(args: argparse.Namespace) -> int:
    """``spmd profile``: time a matmul on each present device and an all-reduce over all; print the profile."""
    import jax

    from spmd._profile import measure

    profile = measure(jax.devices(), size=args.size)
    data = profile.to_dict()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    print(json.dumps(data))
    return 0
