"""Plan families. Each strategy is a pure function returning a :class:`spmd.Plan`; plans compose with ``+``.

``REGISTRY`` maps the names the CLI's ``--strategy`` joins with ``+`` to factories. ``CHOSEN`` holds the
strategies the cost model chooses for a given model and hardware (``tp2d``'s axis roles, ``osdp``'s per-parameter
choice): they need a :class:`Context` and are applied last, on top of the rest of the composition.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from spmd import Plan, costmodel
from strategies.data_parallel import data_parallel
from strategies.expert import expert_parallel
from strategies.fsdp import fsdp
from strategies.osdp import osdp
from strategies.tensor import choose_tensor_2d, sequence_parallel, tensor_parallel, tensor_parallel_2d
from strategies.zero import hsdp, zero1, zero2, zero3

__all__ = [
    "CHOSEN",
    "REGISTRY",
    "Context",
    "choose_tensor_2d",
    "data_parallel",
    "expert_parallel",
    "from_names",
    "fsdp",
    "hsdp",
    "osdp",
    "sequence_parallel",
    "tensor_parallel",
    "tensor_parallel_2d",
    "zero1",
    "zero2",
    "zero3",
]

REGISTRY: dict[str, Callable[[], Plan]] = {
    "dp": lambda: data_parallel(axis="data"),
    "fsdp": lambda: fsdp(axis="fsdp"),
    "tp": lambda: tensor_parallel(axis="tensor"),
    "sp": lambda: sequence_parallel(axis="tensor"),
    "zero1": lambda: zero1(axis="data"),
    "zero2": lambda: zero2(axis="data"),
    "zero3": lambda: zero3(axis="data"),
    "hsdp": lambda: hsdp(shard_axis="fsdp", replicate_axis="data"),
    "ep": lambda: expert_parallel(axis="expert"),
}


@dataclasses.dataclass(frozen=True)
class Context:
    """What the strategies the cost model chooses need to know: the model's abstract (annotated) parameters,
    the step's workload, the hardware, the optimizer, and for ``osdp`` the memory budget per device (bytes)."""

    params: Any
    workload: costmodel.Workload
    hardware: costmodel.Hardware
    optimizer: Any
    memory_per_device: int | None = None


def _osdp(base: Plan, mesh_axes: Mapping[str, int], ctx: Context) -> Plan:
    if ctx.memory_per_device is None:
        raise ValueError("strategy osdp chooses what to shard under a memory budget: give --memory-per-device")
    return osdp(
        ctx.params,
        mesh_axes,
        ctx.workload,
        ctx.hardware,
        memory_per_device=ctx.memory_per_device,
        optimizer=ctx.optimizer,
        base=base,
    )


CHOSEN: dict[str, Callable[[Plan, Mapping[str, int], Context], Plan]] = {
    "tp2d": lambda base, mesh_axes, ctx: choose_tensor_2d(
        ctx.params, mesh_axes, ctx.workload, ctx.hardware, base=base, optimizer=ctx.optimizer
    ),
    "osdp": _osdp,
}


def from_names(spec: str, mesh_axes: Mapping[str, int] | None = None, *, context: Context | None = None) -> Plan:
    """Composes registry strategies named like ``"dp+fsdp+tp"`` into one plan; names in :data:`CHOSEN` are
    applied last and need ``mesh_axes`` and a ``context``.

    >>> from_names("dp+tp").batch_axes
    ('data',)
    """
    names = [n.strip() for n in spec.split("+")]
    unknown = [n for n in names if n not in REGISTRY and n not in CHOSEN]
    if unknown or not names:
        raise ValueError(
            f"--strategy {spec!r}: unknown strategy {unknown[0] if unknown else ''!r}; "
            f"choose from {', '.join([*REGISTRY, *CHOSEN])} joined with '+' (e.g. dp+fsdp+tp)"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"--strategy {spec!r}: a strategy appears twice; name each once")
    plan = Plan()
    for name in names:
        if name in REGISTRY:
            plan = plan + REGISTRY[name]()
    chosen = [n for n in names if n in CHOSEN]
    if chosen and (context is None or mesh_axes is None):
        raise ValueError(
            f"strategy {chosen[0]} is chosen by the cost model for a model and hardware: pass mesh_axes and "
            f"context=strategies.Context(...) (the spmd command does)"
        )
    for name in chosen:
        plan = CHOSEN[name](plan, dict(mesh_axes), context)
    if mesh_axes is not None:
        plan.check_mesh(mesh_axes)
    return plan
