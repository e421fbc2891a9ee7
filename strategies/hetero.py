"""Heterogeneous meshes (HAP): devices of different speeds get uneven shares of the work.

Pure functions of a :class:`spmd.devices.Profile` and the mesh sizes:

- :func:`proportional_split` (from :mod:`strategies._split`): an exact integer split of a total proportional to
  weights under per-part caps (water-filling, then the largest remainders);
- :func:`batch_shares`: examples per data-parallel rank proportional to its speed (a rank's speed is its
  slowest device's), capped by what its memory holds;
- :func:`stage_layers`: layers per pipeline stage proportional to the stage's speed;
- :func:`kind_order`: a device order that keeps every group along the inner mesh axes (tensor parallelism, a
  pipeline's stages of one data position) inside one device kind; :func:`device_order`, the order a run lays
  the devices out in (and the planner prices);
- :func:`rank_microbatches`: a pipeline's microbatches per data position proportional to its speed;
- :func:`uneven_data_parallel`: the plan part that runs the shares (see ``spmd.execution.UnevenData``);
- :func:`apply_profile`: a plan made uneven for a profile: layers per stage for a pipeline, batch shares for
  data parallelism, heads and units for a tensor axis whose devices differ (:mod:`strategies.tensor_shares`);
- :func:`modelled_step_times`, :func:`pipeline_step_times`: the step time of the even and the uneven split;
  :func:`summary` puts them together for a plan, :func:`profiled_step_time` gives any plan's on a profile,
  and :func:`speedup_bound` the most that communication leaves an uneven split.

>>> from spmd.devices import Profile
>>> from strategies import hetero
>>> hetero.batch_shares(24, Profile.from_speeds([3, 1, 1, 1]), {"data": 4})  # the device 3× as fast takes half
(12, 4, 4, 4)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from spmd import Plan, PlanWarning, costmodel, format_bytes, resolve_state
from spmd import axes as A
from spmd.costmodel import StepTime
from spmd.devices import Profile
from spmd.execution import PipelineSpec, Shares, TensorShares
from spmd.pipeline import Schedule, simulate_lockstep
from spmd.rules import ShardLargest, leaves_with_paths
from strategies._split import position_name, proportional_split, rank_memory, rank_speeds
from strategies.pipeline import SCHEDULES, pipeline_schedule
from strategies.tensor_shares import tensor_position_flops, tensor_step_times, tensor_units, units_split_over

__all__ = [
    "apply_profile",
    "batch_shares",
    "device_order",
    "kind_order",
    "modelled_step_times",
    "pipeline_step_times",
    "profiled_step_time",
    "proportional_split",
    "rank_microbatches",
    "rank_speeds",
    "speedup_bound",
    "stage_layers",
    "summary",
    "uneven_data_parallel",
]


def batch_shares(
    batch: int,
    profile: Profile,
    mesh_axes: Mapping[str, int],
    *,
    axis: str = "data",
    state_bytes: int = 0,
    example_bytes: int = 0,
    granularity: int = 1,
) -> tuple[int, ...]:
    """Examples of a ``batch`` per position along ``axis``, proportional to its speed; a position whose memory
    (its smallest device's) is known holds at most ``(memory − state_bytes) / example_bytes`` examples, so a
    device with little memory gets less even if it is fast. Shares are multiples of ``granularity`` (the
    microbatch the devices loop over: larger ones use a device better, smaller ones follow the speeds closer).

    >>> batch_shares(56, Profile.from_speeds([3, 3, 1, 1, 1, 1, 2, 2]), {"data": 8})
    (12, 12, 4, 4, 4, 4, 8, 8)
    >>> batch_shares(256, Profile.from_speeds([4, 4, 2, 2, 2, 1, 1, 1]), {"data": 8}, granularity=8)
    (56, 56, 32, 32, 32, 16, 16, 16)
    """
    profile.check(math.prod(mesh_axes.values()))
    if granularity < 1 or batch % granularity:
        raise ValueError(f"a batch of {batch} cannot be split into microbatches of {granularity}; pick a divisor")
    caps = []
    for i, memory in enumerate(rank_memory(profile, mesh_axes, axis)):
        if memory is None or example_bytes <= 0:
            caps.append(None)
            continue
        if memory <= state_bytes:
            raise ValueError(
                f"{position_name(mesh_axes, axis, i)} has {format_bytes(memory)} of memory but the model state alone "
                f"needs {format_bytes(state_bytes)} per device; shard the parameters (fsdp, zero3) or use devices "
                f"with more memory"
            )
        caps.append((memory - state_bytes) // example_bytes)
    units = [None if c is None else c // granularity for c in caps]
    speeds = rank_speeds(profile, mesh_axes, axis)
    split = proportional_split(batch // granularity, speeds, caps=units)
    if 0 in split:
        # A position with no microbatch idles through every step: the batch is too small for these speeds.
        i = split.index(0)
        least = granularity * math.ceil(sum(speeds) / min(speeds))
        fix = (
            f"its memory holds no microbatch of {granularity} beside the model state; give it more memory, shard "
            f"the parameters, or leave the device out of the mesh"
            if units[i] == 0
            else f"its speed is {speeds[i]:g} of {sum(speeds):g} in all; give a --batch-size of at least {least}, "
            f"so every position has a microbatch of {granularity}, or leave the device out of the mesh"
        )
        raise ValueError(
            f"{position_name(mesh_axes, axis, i)} gets none of the batch of {batch} (shares "
            f"{[granularity * s for s in split]}): {fix}"
        )
    return tuple(granularity * s for s in split)


def stage_layers(
    layers: int, profile: Profile, mesh_axes: Mapping[str, int], *, axis: str = "stage"
) -> tuple[int, ...]:
    """Layers per pipeline stage proportional to the stage's speed (its slowest device's).

    >>> stage_layers(8, Profile.from_speeds([3, 3, 1, 1]), {"stage": 4})
    (3, 3, 1, 1)
    """
    profile.check(math.prod(mesh_axes.values()))
    return proportional_split(layers, rank_speeds(profile, mesh_axes, axis))


def rank_microbatches(
    schedule: Schedule, profile: Profile, mesh_axes: Mapping[str, int], *, axis: str = "data"
) -> tuple[Schedule, ...]:
    """One schedule per position along ``axis`` for a pipeline whose data positions run their own: the
    ``schedule``'s microbatches times the positions, split in proportion to each position's speed (its slowest
    device's) into microbatches of one size. Memory caps are not applied: a position keeps as many
    microbatches' activations in flight as its schedule does (1F1B and the zero-bubble schedules at most about
    the stages, whatever the count; GPipe and breadth-first all of their own, so a fast position holds more).

    >>> from strategies.pipeline import pipeline_schedule
    >>> s = pipeline_schedule("1f1b", stages=2, microbatches=4)
    >>> [r.microbatches for r in rank_microbatches(s, Profile.from_speeds([3, 1, 1, 2] * 2), {"stage": 2, "data": 4})]
    [7, 2, 2, 5]
    """
    profile.check(math.prod(mesh_axes.values()))
    if schedule.name not in SCHEDULES:
        raise ValueError(
            f"the data positions of a pipeline take microbatches by their speeds, each running the schedule "
            f"with its own count, and the table {schedule.name!r} fixes its microbatches; use a named schedule "
            f"({', '.join(SCHEDULES)}), or keep the data positions even (--even)"
        )
    # Interleaved schedules run their microbatches in rounds of the stages.
    unit = schedule.stages if schedule.name == "interleaved" else 1
    speeds = rank_speeds(profile, mesh_axes, axis)
    counts = proportional_split(schedule.microbatches * len(speeds) // unit, speeds)
    if 0 in counts:
        i = counts.index(0)
        least = unit * math.ceil(sum(speeds) / (min(speeds) * len(speeds)))
        raise ValueError(
            f"{position_name(mesh_axes, axis, i)} gets no microbatch of the pipeline's {schedule.microbatches} per "
            f"data position (split {[unit * c for c in counts]} by speeds {list(speeds)}); give the pipeline at "
            f"least {least} microbatches (--microbatches {least}), or leave the device out of the mesh"
        )
    return tuple(
        pipeline_schedule(schedule.name, stages=schedule.stages, microbatches=unit * c, virtual=schedule.virtual)
        for c in counts
    )


def device_order(profile: Profile, mesh_axes: Mapping[str, int], *, pipelined: bool = False) -> tuple[int, ...]:
    """The order in which the devices of ``profile`` fill the mesh (what ``spmd run`` lays out and the planner
    prices): on one axis, or of one kind, as given. Otherwise devices of one kind together (:func:`kind_order`),
    so that the groups along the inner axes (tensor parallelism's) stay inside one kind. A pipeline keeps the
    order given where its groups inside a stage and data position (tensor's, FSDP's) are of one kind already:
    its stages take layers, and its data positions microbatches, by the speeds of the devices the order places
    there; else each data position takes devices of one kind.

    >>> device_order(Profile.from_speeds([2, 1, 2, 1]), {"data": 2, "tensor": 2})  # tensor pairs of one kind
    (0, 2, 1, 3)
    >>> device_order(Profile.from_speeds([2, 1, 2, 1]), {"stage": 2, "data": 2}, pipelined=True)  # as given
    (0, 1, 2, 3)
    """
    given = tuple(range(len(profile.devices)))
    if len(set(profile.kinds)) == 1 or len(mesh_axes) == 1:
        return given
    if not pipelined:
        return kind_order(profile, mesh_axes)
    inner = [a for a in mesh_axes if a not in ("stage", "data")]
    if not inner:
        return given
    kinds = np.array(profile.kinds).reshape(tuple(mesh_axes.values()))
    cells = np.moveaxis(kinds, [list(mesh_axes).index(a) for a in inner], range(-len(inner), 0))
    cells = cells.reshape(-1, math.prod(mesh_axes[a] for a in inner))
    if all(len(set(cell)) == 1 for cell in cells):
        return given
    return kind_order(profile, mesh_axes, outer="data" if "data" in mesh_axes else None)


def kind_order(profile: Profile, mesh_axes: Mapping[str, int], *, outer: str | None = None) -> tuple[int, ...]:
    """A device order (indices into the profile, in mesh order) with the devices of each kind contiguous along
    ``outer`` (default: the mesh's first axis): the positions of ``outer`` take runs of one kind, so the groups
    along the other axes (tensor parallelism; a pipeline's stages of one data position) stay inside one kind
    wherever the kinds' counts allow.

    >>> kind_order(Profile.from_speeds([1, 2, 1, 2]), {"data": 2, "tensor": 2})
    (0, 2, 1, 3)
    >>> kind_order(Profile.from_speeds([3, 3, 1, 1]), {"stage": 2, "data": 2}, outer="data")  # a kind per position
    (0, 2, 1, 3)
    """
    profile.check(math.prod(mesh_axes.values()))
    first_seen = {k: i for i, k in reversed(list(enumerate(profile.kinds)))}
    runs = sorted(range(len(profile.devices)), key=lambda i: (first_seen[profile.kinds[i]], i))
    names = list(mesh_axes)
    outer = outer or names[0]
    if outer not in mesh_axes:
        raise ValueError(f"kind_order: outer={outer!r} is not an axis of the mesh {dict(mesh_axes)}; name one of them")
    # Lay the runs out with ``outer`` first, then put the axes back in the mesh's order.
    order = [outer] + [a for a in names if a != outer]
    grid = np.array(runs).reshape(tuple(mesh_axes[a] for a in order))
    return tuple(int(i) for i in np.transpose(grid, [order.index(a) for a in names]).reshape(-1))


def uneven_data_parallel(shares: Sequence[int], *, axis: str = "data", microbatch: int | None = None) -> Plan:
    """Data parallelism over ``axis`` with ``shares[i]`` examples on position ``i``: each device loops over
    its own number of ``microbatch``-example steps (default: the largest that divides every share).

    >>> uneven_data_parallel((12, 12, 4, 4)).execution.loops
    (3, 3, 1, 1)
    """
    shares = tuple(int(s) for s in shares)
    if microbatch is None:
        microbatch = math.gcd(*shares) or 1
    return Plan(batch_axes=(axis,), execution=Shares(axis=axis, shares=shares, microbatch=microbatch))


def modelled_step_times(
    work: float, speeds: Sequence[float], shares: Sequence[float], comm_s: float = 0.0
) -> dict[str, float]:
    """Step times of the even split and of ``shares`` when a position takes ``work × share / speed`` seconds
    (``work``: seconds per unit of share at speed 1) and communication adds ``comm_s``; with the speedup and
    the ideal one, Σs / (N · min s).

    >>> t = modelled_step_times(1.0, [3, 1], [3, 1])
    >>> t["even"], t["hetero"], t["speedup"], t["ideal"]
    (2.0, 1.0, 2.0, 2.0)
    """
    n, total = len(speeds), sum(shares)
    even = max(work * (total / n) / s for s in speeds) + comm_s
    hetero = max(work * share / s for share, s in zip(shares, speeds, strict=True)) + comm_s
    return {"even": even, "hetero": hetero, "speedup": even / hetero, "ideal": sum(speeds) / (n * min(speeds))}


def pipeline_step_times(
    schedule: Schedule, even: Sequence[int], counts: Sequence[int], speeds: Sequence[float], layer_s: float = 1.0
) -> dict[str, float]:
    """Simulated step times of a pipeline with ``even`` and with ``counts`` layers per global stage, when one
    layer's F, B or W for one microbatch takes ``layer_s`` at speed 1 and device ``d`` runs at ``speeds[d]``: in
    lock-step, as the one SPMD program runs it (:func:`spmd.pipeline.simulate_lockstep`).

    >>> from strategies.pipeline import pipeline_schedule
    >>> t = pipeline_step_times(pipeline_schedule("1f1b", stages=2, microbatches=8), (4, 4), (6, 2), (3, 1))
    >>> round(t["speedup"], 3), t["ideal"]  # a tick lasts its dearest action: F beside B waits out B
    (1.471, 2.0)
    """
    p, v = schedule.stages, schedule.virtual

    def makespan(layers: Sequence[int]) -> float:
        # Costs are per whole stage (a chunk's op is 1/v of it): scale each chunk by its layers × v / speed. The
        # program runs in lock-step: each tick lasts as long as its dearest action.
        scale = [
            [Fraction(layers[schedule.stage_of(d, c)] * v) / Fraction(speeds[d]) for c in range(v)] for d in range(p)
        ]
        return float(simulate_lockstep(schedule, scale=scale).makespan) * layer_s

    t_even, t = makespan(even), makespan(counts)
    return {"even": t_even, "hetero": t, "speedup": t_even / t, "ideal": sum(speeds) / (p * min(speeds))}


def _pipeline_times(
    spec: PipelineSpec,
    even: Sequence[int],
    layers: Sequence[int],
    profile: Profile,
    mesh_axes: Mapping[str, int],
    layer_s: float,
) -> dict[str, float]:
    """A pipeline's modelled compute, even and uneven (:func:`summary` adds each split's communication): without data
    schedules the stages' (each at its slowest device's speed); with them, each data position runs its own
    pipeline on its devices, and the step lasts as long as the slowest of them (the even split: every position
    runs the plan's own schedule)."""
    fastest = max(profile.speeds)
    if spec.data_schedules is None:
        speeds = [x / fastest for x in rank_speeds(profile, mesh_axes, spec.axis)]
        t = pipeline_step_times(spec.schedule, even, layers, speeds, layer_s)
        return t
    grid = np.array(profile.speeds).reshape(tuple(mesh_axes.values())) / fastest
    order = [list(mesh_axes).index(spec.axis), list(mesh_axes).index(spec.data_axis)]
    # [stage device, data position, the rest]: a stage device of a position runs at its slowest device's speed.
    per = np.moveaxis(grid, order, (0, 1)).reshape(mesh_axes[spec.axis], mesh_axes[spec.data_axis], -1).min(axis=2)
    plain = spec.schedule  # the plan's own, run by every position in the even split
    t_even = max(pipeline_step_times(plain, even, even, per[:, d], layer_s)["even"] for d in range(per.shape[1]))
    t = max(
        pipeline_step_times(r, layers, layers, per[:, d], layer_s)["even"] for d, r in enumerate(spec.data_schedules)
    )
    speeds = rank_speeds(profile, mesh_axes, spec.data_axis)
    return {"even": t_even, "hetero": t, "speedup": t_even / t, "ideal": sum(speeds) / (len(speeds) * min(speeds))}


def summary(
    plan: Plan,
    mesh_axes: Mapping[str, int],
    profile: Profile,
    batch: int,
    flops_per_device: float,
    modelled: StepTime,
    layers_per_stage: Sequence[int] | None = None,
    tensor_flops: tuple[float, Sequence[float]] | None = None,
    *,
    compute_factor: float = 1.0,
    even_comm_s: float | None = None,
) -> dict[str, Any]:
    """What a profile changes for ``plan``: its ``batch_shares`` (None when even), or a pipeline's
    ``layers_per_stage`` and ``rank_microbatches`` (its data positions' microbatches; None when each runs the
    plan's schedule), or uneven tensor shares' ``tensor_units``; the modelled step time of the even and of the
    uneven split (communication added to both), the speedup and the ideal Σs / (N · min s).
    ``tensor_flops``: for uneven tensor shares, one device's FLOPs under the even split and at each tensor
    position (:func:`tensor_position_flops`).

    ``flops_per_device`` and ``modelled`` are the cost model's figures for the plan at the fastest device's speed
    (``spmd.report`` or ``costmodel.estimate``; for a pipeline whose data positions run their own schedules, a
    device of the busiest position); a device's speed scales its compute. ``compute_factor``: the bubble that
    ``modelled``'s compute includes (the executor's ``Contribution.compute_factor``), which the simulation of a
    pipeline's schedule at each device's speed replaces. ``even_comm_s``: the even plan's communication, where it
    moves less than this one (a pipeline position's extra ticks, stages padded to the deepest); by default the
    plan's own, added to both splits.

    >>> plan, profile = uneven_data_parallel((12, 4, 4, 4)), Profile.from_speeds([3, 1, 1, 1])
    >>> s = summary(plan, {"data": 4}, profile, 24, 1e9, StepTime(compute_s=1.0, comm_s=0.0, hardware="cpu"))
    >>> s["batch_shares"], s["simulated_step_time"], s["simulated_speedup"]  # the slow devices bound the even split
    ([12, 4, 4, 4], {'even': 3.0, 'hetero': 2.0}, 1.5)
    """
    # FLOP/s the cost model gives the fastest device, its compute without the executor's bubble.
    rate = flops_per_device * compute_factor / max(modelled.compute_s, 1e-30)
    comm_s, even_comm_s = modelled.comm_s, modelled.comm_s if even_comm_s is None else even_comm_s
    out: dict[str, Any] = {}
    spec = plan.execution
    if isinstance(spec, PipelineSpec):
        # Layers per global stage; none given (chunks that loop over the stages) means an even split, which the
        # times below see only as each stage's share.
        layers = tuple(layers_per_stage or spec.layers_per_stage or (1,) * spec.schedule.total_stages)
        total = sum(layers)
        even = (total // len(layers),) * len(layers) if total % len(layers) == 0 else layers
        # One layer's F, B or W for one microbatch on one device: a device's FLOPs (the busiest data
        # position's) over 3 · its layers · microbatches. The plan's layout stores every stage padded to the
        # most layers, so the FLOPs counted on it are a device of the deepest stage's: v chunks of that many.
        s = spec.busiest
        layer_s = flops_per_device / (3 * s.virtual * max(layers) * s.microbatches) / rate
        times = _pipeline_times(spec, even, layers, profile, mesh_axes, layer_s)
        out["layers_per_stage"] = list(layers)
        out["rank_microbatches"] = list(spec.rank_microbatches) if spec.data_schedules else None
    elif isinstance(spec, TensorShares):
        if tensor_flops is None:
            raise ValueError("summary: uneven tensor shares are priced from tensor_flops (tensor_position_flops)")
        times = tensor_step_times(spec, profile, mesh_axes, tensor_flops, rate)
        out["tensor_units"] = {n: list(spec.of(n)) for n in spec.names}
    else:
        speeds = rank_speeds(profile, mesh_axes, "data")
        uneven = spec if isinstance(spec, Shares) else None
        shares = list(uneven.shares) if uneven else [batch / len(speeds)] * len(speeds)
        # The cost model's average device does batch / ways examples; a rank's share is split over its devices
        # along the other data axes (FSDP's, the context axis).
        ways = math.prod(mesh_axes.get(a, 1) for a in plan.data_axes) or 1
        within = ways / len(speeds)
        per_example_s = flops_per_device * ways / batch / rate
        per_device = [x / within for x in shares]
        relative = [x / max(profile.speeds) for x in speeds]  # the cost model priced the fastest device
        times = modelled_step_times(per_example_s, relative, per_device)
        out["batch_shares"] = list(uneven.shares) if uneven else None
    # Communication after compute, as the hardware model runs it: each split's own.
    t_even, t = times["even"] + even_comm_s, times["hetero"] + comm_s
    return out | {
        "simulated_step_time": {"even": t_even, "hetero": t},
        "simulated_speedup": t_even / t,
        "ideal_speedup": times["ideal"],
        "speedup_bound": speedup_bound(t_even, even_comm_s, times["ideal"]),
        "device_speeds": list(profile.speeds),
    }


def speedup_bound(even_s: float, comm_s: float, ideal: float) -> float:
    """The most an uneven split can gain on the cost model's step: its compute shrunk by the ``ideal`` ratio,
    its communication ``comm_s`` unchanged. The hardware model overlaps nothing (compute, then communication),
    and an uneven split moves what the even one moves (under data parallelism a rank's gradients are reduced
    whole once its loop over its share has ended, so the program has nothing to overlap them with either), so
    ``(T + C) / (T / ideal + C)`` bounds the speedup below the ideal whenever there is communication: ``even_s``
    is ``T + C``. Work that does not split (the units' fixed work, a pipeline's fill and drain) lowers it more.

    >>> speedup_bound(3.0, 1.0, 2.0)  # 2 s of compute and 1 s of communication: (2 + 1) / (1 + 1)
    1.5
    >>> speedup_bound(3.0, 0.0, 2.0)  # compute alone: the ideal
    2.0
    """
    return even_s / ((even_s - comm_s) / ideal + comm_s)


def profiled_step_time(
    plan: Plan,
    mesh_axes: Mapping[str, int],
    profile: Profile,
    batch: int,
    estimate: costmodel.Estimate,
    *,
    params: Any = None,
    workload: costmodel.Workload | None = None,
    compute_factor: float = 1.0,
) -> float:
    """``plan``'s modelled step on the devices of ``profile``, from the cost model's ``estimate`` (priced at the
    fastest device's speed): the uneven split's (:func:`summary`) for a plan with batch shares, a pipeline
    with layers per stage or data schedules, or uneven tensor shares (priced from ``params`` and
    ``workload``); otherwise every device does the same work, and the slowest paces the step.
    ``compute_factor``: the bubble the estimate's compute includes (a pipeline executor's contribution), which
    the summary's simulation of each device's schedule at its own speed replaces.

    >>> import jax, optax
    >>> params = {"w": jax.ShapeDtypeStruct((256, 256), "float32")}
    >>> e = costmodel.estimate(Plan(), params, {"tensor": 2}, costmodel.Workload(8, 16), optimizer=optax.sgd(0.1),
    ...                        hardware=costmodel.HARDWARE["h100"])
    >>> t = profiled_step_time(Plan(), {"tensor": 2}, Profile.from_speeds([3, 1]), 8, e)
    >>> t == 3 * e.time.compute_s + e.time.comm_s  # every device paced by the one a third as fast
    True
    """
    t = estimate.time
    spec = plan.execution
    if isinstance(spec, Shares) or (isinstance(spec, PipelineSpec) and (spec.layers_per_stage or spec.data_schedules)):
        priced = summary(plan, mesh_axes, profile, batch, estimate.flops, t, compute_factor=compute_factor)
        return priced["simulated_step_time"]["hetero"]
    if isinstance(spec, TensorShares):
        if params is None or workload is None:
            raise ValueError("profiled_step_time: uneven tensor shares are priced from params= and workload=")
        flops = tensor_position_flops(plan, params, mesh_axes, workload)
        priced = summary(plan, mesh_axes, profile, batch, estimate.flops, t, tensor_flops=flops)
        return priced["simulated_step_time"]["hetero"]
    return t.compute_s * max(profile.speeds) / min(profile.speeds) + t.comm_s


def apply_profile(
    plan: Plan,
    mesh_axes: Mapping[str, int],
    profile: Profile,
    *,
    params: Any,
    workload: costmodel.Workload,
    optimizer: Any,
    microbatch: int = 1,
) -> Plan:
    """``plan`` made uneven for the devices of ``profile``: a pipeline's stages get layers by their speed (unless
    the plan gives layers per stage, or loops over chunks), and its data positions, where their speeds differ,
    microbatches by theirs (:func:`rank_microbatches`); data parallelism gets batch shares by speed, capped by
    what each device's memory holds (the model state of ``plan``, and the activations of one example of
    ``workload``'s sequence length for ``params``), in multiples of ``microbatch``.

    >>> import jax, optax
    >>> from spmd import costmodel, models
    >>> import strategies
    >>> params = jax.eval_shape(models.get("gpt-tiny").init, jax.random.key(0))
    >>> plan = apply_profile(strategies.data_parallel(), {"data": 4}, Profile.from_speeds([3, 1, 1, 1]),
    ...                      params=params, workload=costmodel.Workload(24, 32), optimizer=optax.adam(1e-3))
    >>> plan.execution.shares
    (12, 4, 4, 4)
    """
    if isinstance(plan.execution, PipelineSpec):
        spec = plan.execution
        if not spec.layers_per_stage and spec.schedule.virtual == 1:  # not given by hand, nor looping chunks
            counts = stage_layers(_stacked_layers(params), profile, mesh_axes, axis=spec.axis)
            spec = dataclasses.replace(spec, layers_per_stage=counts)
        if mesh_axes.get("data", 1) > 1 and "data" in plan.batch_axes:
            speeds = rank_speeds(profile, mesh_axes, "data")
            if len(set(speeds)) > 1:  # each data position runs its own pipeline, with microbatches by its speed
                _require_whole_over_data(plan, params, mesh_axes)
                spec = dataclasses.replace(spec, data_schedules=rank_microbatches(spec.schedule, profile, mesh_axes))
        return dataclasses.replace(plan, execution=spec)
    split = units_split_over(plan, params, mesh_axes, "tensor")
    if split and len(set(rank_speeds(profile, mesh_axes, "tensor"))) > 1:
        # The tensor axis's positions differ in speed (its groups mix kinds, as the kinds' counts leave them):
        # each position computes heads and hidden units in proportion to its speed.
        if plan.execution is not None:
            raise ValueError(
                f"the tensor axis's devices differ in speed, so they take uneven heads and units, and the plan "
                f"already runs {plan.execution.describe()}; place one kind per tensor group, or pass --even"
            )
        units = tensor_units(params, profile, mesh_axes, names=split, plan=plan, workload=workload)
        return dataclasses.replace(plan, execution=units)
    if "data" not in plan.batch_axes or mesh_axes.get("data", 1) == 1:
        raise ValueError(
            "a device profile gives data-parallel ranks uneven batch shares, pipeline stages uneven layers, or "
            "the positions of a tensor axis whose devices differ in speed uneven heads and units: the plan needs "
            "a data axis (dp), a pipeline (pp) or tensor parallelism over such an axis (tp); or pass --even"
        )
    split = [p for p in plan.parts if isinstance(p, ShardLargest) and "params" in p.roles and p.axis == "data"]
    if split:
        # Each rank loops over its own microbatches with the parameters whole: split over the data axis itself
        # they would be gathered once on entry and their gradients all-reduced, which FSDP is not.
        raise ValueError(
            f"uneven batch shares run each data rank's own loop with the parameters whole on the rank, and "
            f"{split[0].describe()} splits them over the data axis itself; use dp, zero1 or zero2 over data, or "
            f"FSDP over an axis of its own (dp+fsdp on --mesh data=4,fsdp=2), or pass --even"
        )
    # A rank's devices along the other batch axes (FSDP's) split each of its microbatches evenly between them.
    within = math.prod(mesh_axes.get(a, 1) for a in plan.batch_axes if a != "data")
    state_bytes = example_bytes = 0
    if any(m is not None for m in profile.memory):
        layout = resolve_state(plan, params, optimizer, mesh_axes)
        state_bytes = costmodel.model_state_bytes(layout)["total"]
        one_each = costmodel.Workload(batch=mesh_axes["data"], seq_len=workload.seq_len)
        example_bytes = int(costmodel.activation_bytes(layout.params.leaves, plan, mesh_axes, one_each))
    shares = batch_shares(
        workload.batch,
        profile,
        mesh_axes,
        axis="data",
        state_bytes=state_bytes,
        example_bytes=example_bytes,
        granularity=microbatch * within,
    )
    return plan + uneven_data_parallel(shares)


def _require_whole_over_data(plan: Plan, params: Any, mesh_axes: Mapping[str, int]) -> None:
    """A pipeline's data positions of different speeds run their own schedules, with the parameters whole along
    ``data``: refuse a plan that splits them over it, naming the first array it splits."""
    with warnings.catch_warnings():  # the step resolves the layout again, and warns there
        warnings.simplefilter("ignore", PlanWarning)
        rows = plan.resolve(params, mesh_axes).leaves
    split = next((r for r in rows if "data" in r.axes), None)
    if split is not None:
        raise ValueError(
            f"the pipeline's data positions differ in speed, so each runs its own schedule with the parameters "
            f"whole along 'data', and the plan splits {split.path} over 'data' (ZeRO-3 or FSDP over data); "
            f"split the parameters over an axis of their own (pp+dp+fsdp on stage, data and fsdp), or keep "
            f"the data positions even (--even)"
        )


def _stacked_layers(params: Any) -> int:
    """The number of stacked layers: the leading dimension of the arrays annotated ``layers`` first."""
    for leaf in leaves_with_paths(params)[0]:
        if leaf.names and leaf.names[0] == A.LAYERS:
            return leaf.shape[0]
    raise ValueError("a pipeline's layers per stage follow a profile only for models with stacked layers")
