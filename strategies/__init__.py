"""Plan families. Each strategy is a pure function returning a :class:`spmd.Plan`; plans compose with ``+``.

``REGISTRY`` maps the names the CLI's ``--strategy`` joins with ``+`` to factories. ``CHOSEN`` holds the
strategies the cost model chooses for a given model and hardware (``tp2d``'s axis roles, ``osdp``'s per-parameter
choice): they need a :class:`Context` and are applied last, on top of the rest of the composition. ``pp`` (pipeline
parallelism over the ``stage`` axis) needs the mesh, for its number of stages, and :class:`PipelineOptions`.

>>> import strategies
>>> plan = strategies.data_parallel() + strategies.tensor_parallel(axis="tensor")
>>> plan.describe(), plan == strategies.from_names("dp+tp")  # the CLI's --strategy dp+tp
('batch over data; tensor_parallel', True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from spmd import Plan, costmodel
from spmd.devices import Profile
from strategies import hetero
from strategies.accumulate import accumulate
from strategies.context import context_parallel
from strategies.data_parallel import data_parallel
from strategies.expert import expert_parallel
from strategies.fsdp import fsdp
from strategies.offload import offload
from strategies.osdp import osdp
from strategies.pipeline import SCHEDULES, pipeline, pipeline_schedule
from strategies.precision import mixed_precision
from strategies.subnet import subnetwork_dp
from strategies.tensor import choose_tensor_2d, sequence_parallel, tensor_parallel, tensor_parallel_2d
from strategies.zero import hsdp, zero1, zero2, zero3

__all__ = [
    "CHOSEN",
    "REGISTRY",
    "Context",
    "ContextOptions",
    "accumulate",
    "choose_tensor_2d",
    "context_parallel",
    "data_parallel",
    "expert_parallel",
    "from_names",
    "fsdp",
    "hetero",
    "hsdp",
    "mixed_precision",
    "offload",
    "osdp",
    "PipelineOptions",
    "SCHEDULES",
    "pipeline",
    "pipeline_schedule",
    "sequence_parallel",
    "SubnetOptions",
    "subnetwork_dp",
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
    """What the strategies chosen for a model and its devices need to know: the model's abstract (annotated)
    parameters, the step's workload, the hardware, the optimizer, for ``osdp`` the memory budget per device
    (bytes), and for heterogeneous devices their ``profile`` (the plan is then made uneven by
    :func:`strategies.hetero.apply_profile`, in multiples of ``microbatch`` examples).

    >>> Context(None, costmodel.Workload(8, 32), costmodel.HARDWARE["cpu"], None).profile is None
    True
    """

    params: Any
    workload: costmodel.Workload
    hardware: costmodel.Hardware
    optimizer: Any
    memory_per_device: int | None = None
    profile: Profile | None = None
    microbatch: int = 1


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


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How ``pp`` pipelines: the schedule's name (see :data:`SCHEDULES`) or a table, the number of
    microbatches (default: twice the stages), chunks per device, and layers per global stage (default even).

    >>> options = PipelineOptions("interleaved", microbatches=4, virtual=2)
    >>> from_names("pp", {"stage": 2}, pipeline_options=options).execution.describe()
    'pipeline interleaved over stage (2 stages, 4 microbatches, 2 chunks per device)'
    """

    schedule: Any = "1f1b"
    microbatches: int | None = None
    virtual: int | None = None  # None: the schedule's own (2 for zb-v, else 1)
    layers_per_stage: tuple[int, ...] | None = None


PIPELINE_AXIS = "stage"


@dataclasses.dataclass(frozen=True)
class SubnetOptions:
    """How ``sdp`` cuts the model (see :func:`subnetwork_dp`).

    >>> from_names("sdp", {"data": 4}, subnet_options=SubnetOptions(coverage=0.25)).execution.describe()
    'subnetworks over data (coverage 0.25, block, forward masking)'
    """

    coverage: float = 0.5
    granularity: str = "block"
    masking: str = "forward"
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ContextOptions:
    """How ``cp`` splits the sequence over the ``context`` axis (see :func:`context_parallel`).

    >>> from_names("dp+cp", {"data": 2, "context": 4}, context_options=ContextOptions("ring")).describe()
    'batch over data; context parallel over context (ring, load-balanced)'
    """

    method: str = "allgather"
    load_balance: bool = True
    shard_params: bool = False


CONTEXT_AXIS = "context"


CHOSEN: dict[str, Callable[[Plan, Mapping[str, int], Context], Plan]] = {
    "tp2d": lambda base, mesh_axes, ctx: choose_tensor_2d(
        ctx.params, mesh_axes, ctx.workload, ctx.hardware, base=base, optimizer=ctx.optimizer
    ),
    "osdp": _osdp,
}


def from_names(
    spec: str,
    mesh_axes: Mapping[str, int] | None = None,
    *,
    context: Context | None = None,
    pipeline_options: PipelineOptions | None = None,
    subnet_options: SubnetOptions | None = None,
    context_options: ContextOptions | None = None,
    block: int | None = None,
) -> Plan:
    """Composes registry strategies named like ``"dp+fsdp+tp"`` into one plan; names in :data:`CHOSEN` are
    applied last and need ``mesh_axes`` and a ``context``; ``pp`` needs ``mesh_axes`` (its ``stage`` axis). A
    context with a device profile then makes the plan uneven, and ``block`` aligns its FSDP splits to blocks.

    >>> from_names("dp+tp").batch_axes
    ('data',)
    >>> from_names("pp+dp", {"stage": 4, "data": 2}, pipeline_options=PipelineOptions("zb-h1", 8)).execution.describe()
    'pipeline zb-h1 over stage (4 stages, 8 microbatches)'
    """
    names = [n.strip() for n in spec.split("+")]
    unknown = [n for n in names if n not in REGISTRY and n not in CHOSEN and n not in ("pp", "sdp", "cp")]
    if unknown or not names:
        raise ValueError(
            f"--strategy {spec!r}: unknown strategy {unknown[0] if unknown else ''!r}; "
            f"choose from {', '.join([*REGISTRY, 'pp', 'sdp', 'cp', *CHOSEN])} joined with '+' (e.g. dp+fsdp+tp)"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"--strategy {spec!r}: a strategy appears twice; name each once")
    plan = Plan()
    for name in names:
        if name in REGISTRY:
            plan = plan + REGISTRY[name]()
    if "pp" in names:
        plan = plan + _pipeline(mesh_axes, pipeline_options or PipelineOptions())
    if "cp" in names:
        plan = plan + _context(mesh_axes, context_options or ContextOptions())
    if "sdp" in names:
        o = subnet_options or SubnetOptions()
        plan = plan + subnetwork_dp(coverage=o.coverage, granularity=o.granularity, masking=o.masking, seed=o.seed)
    chosen = [n for n in names if n in CHOSEN]
    if chosen and (context is None or mesh_axes is None):
        raise ValueError(
            f"strategy {chosen[0]} is chosen by the cost model for a model and hardware: pass mesh_axes and "
            f"context=strategies.Context(...) (the spmd command does)"
        )
    for name in chosen:
        plan = CHOSEN[name](plan, dict(mesh_axes), context)
    if context is not None and context.profile is not None:
        plan = hetero.apply_profile(
            plan,
            dict(mesh_axes),
            context.profile,
            params=context.params,
            workload=context.workload,
            optimizer=context.optimizer,
            microbatch=context.microbatch,
        )
    if block:
        plan = plan.with_block(block)
    if mesh_axes is not None:
        plan.check_mesh(mesh_axes)
    return plan


def _pipeline(mesh_axes: Mapping[str, int] | None, options: PipelineOptions) -> Plan:
    if mesh_axes is None or PIPELINE_AXIS not in mesh_axes:
        shown = ",".join(f"{k}={v}" for k, v in (mesh_axes or {}).items()) or "none given"
        raise ValueError(
            f"strategy pp puts pipeline stages on mesh axis {PIPELINE_AXIS!r}, but the mesh has only {shown}; "
            f"add it (e.g. --mesh stage=4,data=2)"
        )
    stages = mesh_axes[PIPELINE_AXIS]
    return pipeline(
        options.schedule,
        stages=stages,
        microbatches=options.microbatches or 2 * stages,
        virtual=options.virtual,
        axis=PIPELINE_AXIS,
        layers_per_stage=options.layers_per_stage,
    )


def _context(mesh_axes: Mapping[str, int] | None, options: ContextOptions) -> Plan:
    if mesh_axes is not None and CONTEXT_AXIS not in mesh_axes:
        shown = ",".join(f"{k}={v}" for k, v in mesh_axes.items()) or "none given"
        raise ValueError(
            f"strategy cp splits the sequence over mesh axis {CONTEXT_AXIS!r}, but the mesh has only {shown}; add it "
            f"(e.g. --mesh data=2,context=4)"
        )
    return context_parallel(
        axis=CONTEXT_AXIS, method=options.method, load_balance=options.load_balance, shard_params=options.shard_params
    )
