"""OSDP (Jiang et al., 2023): per parameter, replicate or shard, whichever the memory budget allows most cheaply."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import spmd
from spmd import Plan, PlanError, costmodel, format_bytes
from spmd import axes as A
from strategies.data_parallel import data_parallel
from strategies.fsdp import fsdp


def osdp(
    params: Any,
    mesh_axes: Mapping[str, int],
    workload: costmodel.Workload,
    hardware: costmodel.Hardware,
    *,
    memory_per_device: int,
    optimizer: Any,
    axis: str = "data",
    base: Plan | None = None,
    min_bytes: int = 4096,
) -> Plan:
    """Data parallelism over ``axis`` with just enough parameters sharded (FSDP-style) to fit
    ``memory_per_device`` (model state plus kept activations, as the cost model estimates them).

    Each array FSDP could split is priced by what sharding it adds to the step — the extra all-gather traffic
    over the axis's bandwidth (none for an embedding table, gathered once while its replicated gradient's
    all-reduce moves as much) plus a latency per added collective — per byte of model state it saves (the
    parameter, its gradient and its optimizer moments, all split). The cheapest are sharded first until the
    estimate fits. The plan's notes say what was chosen and why; a budget that even full sharding misses is an
    error.

    >>> import jax, optax, spmd
    >>> from spmd import models
    >>> params = jax.eval_shape(models.get("gpt-tiny", layers=2).init, jax.random.key(0))
    >>> plan = osdp(params, {"data": 8}, costmodel.Workload(8, 32), costmodel.HARDWARE["h100"],
    ...             memory_per_device=2 << 20, optimizer=optax.adam(1e-3))
    >>> plan.parts[-1].paths[0]  # a lookup table costs no extra traffic sharded: it goes first
    'params/embed/embedding'
    """
    base = base or Plan()
    plan = base if axis in base.batch_axes else base + data_parallel(axis=axis)
    replicated = costmodel.estimate(plan, params, mesh_axes, workload, optimizer=optimizer, hardware=hardware)
    if replicated.memory_bytes <= memory_per_device:
        fits = f"{format_bytes(replicated.memory_bytes)} of {format_bytes(memory_per_device)}"
        note = f"osdp: everything fits replicated ({fits})"
        return dataclasses.replace(plan, notes=plan.notes + (note,))
    full = plan + fsdp(axis=axis, min_bytes=min_bytes)
    sharded = costmodel.estimate(full, params, mesh_axes, workload, optimizer=optimizer, hardware=hardware)
    if sharded.memory_bytes > memory_per_device:
        state, kept = sharded.per_device_bytes["total"], sharded.activation_bytes
        raise PlanError(
            f"osdp: even with every parameter sharded over {axis!r} a device needs "
            f"{format_bytes(sharded.memory_bytes)} (model state {format_bytes(state)}, activations "
            f"{format_bytes(kept)}), above --memory-per-device {format_bytes(memory_per_device)}; add devices or "
            f"tensor parallelism"
        )
    before = spmd.resolve_state(plan, params, optimizer, mesh_axes)
    options = _priced(before, spmd.resolve_state(full, params, optimizer, mesh_axes), hardware, mesh_axes, axis)
    # The remat policy that FSDP turns on shrinks the activations too, so start from the replicated plan with it.
    remat = fsdp(axis=axis).remat
    need = (
        costmodel.estimate(
            dataclasses.replace(plan, remat=remat), params, mesh_axes, workload, optimizer=optimizer, hardware=hardware
        ).memory_bytes
        - memory_per_device
    )
    chosen, cost = [], 0.0
    for _, saved, extra, path in options:
        if need <= 0:
            break
        chosen.append(path)
        need -= saved
        cost += extra
    if not chosen:
        note = f"osdp: everything fits replicated once layers are rematerialised ({format_bytes(memory_per_device)})"
        return dataclasses.replace(plan, remat=remat, notes=plan.notes + (note,))
    result = plan + fsdp(axis=axis, min_bytes=min_bytes, paths=tuple(chosen))
    note = (
        f"osdp: {len(chosen)} of {len(options)} shardable arrays sharded over {axis} to fit "
        f"{format_bytes(memory_per_device)} per device, at {cost * 1e3:.3g} ms more communication per step on "
        f"{hardware.name}; the rest stay replicated"
    )
    return dataclasses.replace(result, notes=result.notes + (note,))


def _priced(
    before: spmd.StateLayout,
    after: spmd.StateLayout,
    hardware: costmodel.Hardware,
    mesh_axes: Mapping[str, int],
    axis: str,
) -> list[tuple[float, int, float, str]]:
    """Every array the fsdp part splits, cheapest first: (extra seconds per byte saved, bytes saved, extra
    seconds, path)."""
    bandwidth, latency = hardware.link((axis,), mesh_axes)
    n = mesh_axes[axis]
    options = []
    for old, new in zip(before.params.leaves, after.params.leaves, strict=True):
        if old.bytes_per_device == new.bytes_per_device:
            continue  # not split by the fsdp part (too small, or no divisible dimension)
        suffix = "/" + old.path.split("/", 1)[-1]
        mirrors = sum(1 for r in after.opt_state.leaves if r.shape == old.shape and r.path.endswith(suffix))
        saved = (old.bytes_per_device - new.bytes_per_device) * (2 + mirrors)
        lookup = old.path.endswith("embedding")
        gathers = 1 if lookup else 2  # the layers are rematerialised, so weights are gathered twice
        layers = old.shape[0] if old.names and old.names[0] == A.LAYERS else 1
        extra = (gathers - 1) * (n - 1) / n * old.bytes / bandwidth + gathers * layers * latency
        options.append((extra / saved, saved, extra, old.path))
    return sorted(options)
