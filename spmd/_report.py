"""The plan report: what the plan asked for, next to what the compiler made of it and what the cost model expected.

:func:`report` only joins three views of one compiled step: the layout (the plan applied to the training state),
the compiled program (``memory_analysis()`` and the collectives read from its HLO) and the cost model's estimate
(with what the step's execution mode contributes to it). A comparison with another plan is a second report
(:meth:`Report.with_data_parallel`).
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from rich.console import Console, Group

from spmd import costmodel
from spmd._executor import Summary
from spmd._format import format_bytes
from spmd._hlo import Collective, collectives
from spmd._layout import LeafLayout
from spmd._plan import Plan
from spmd._report_tables import tables
from spmd._resolve import idle_axes, idle_axes_text, unused_axes
from spmd.costmodel import StepTime, Traffic

if TYPE_CHECKING:
    from spmd._train import TrainStep

__all__ = ["Report", "memory_of", "report"]

# The temporaries estimate is rough (XLA's buffer assignment decides): flagged beyond this factor either way.
TEMP_SLACK = 1.5
# A parameter at least this large left fully replicated on a multi-device mesh earns a warning.
LARGE_REPLICATED_BYTES = 1 << 20

_MEMORY_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
}


@dataclasses.dataclass(frozen=True)
class Report:
    """Per-parameter layout, per-device totals, the compiled program's memory and its collectives, next to the
    cost model's estimate; the execution mode's own figures (``execution``); and, when compared, the report of
    data parallelism for the same model, batch and mesh (``data_parallel``). See :func:`report`.

    >>> import spmd, optax, jax, jax.numpy as jnp
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> step = spmd.TrainStep(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.adam(0.1), spmd.Plan(batch_axes=("data",)),
    ...                       mesh, params={"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)})
    >>> r = spmd.report(step, {"x": jnp.ones((mesh.size, 4))})
    >>> r, r.comm_bytes_per_step["analytic"]  # the 32-byte gradient's ring all-reduce over 8 devices: 2 · 7/8 · 32
    (Report(mesh data=8; batch over data; parameters replicated; ...), 56)
    >>> r.with_data_parallel(r).vs_data_parallel()["total_bytes"]
    1.0
    """

    mesh_axes: dict[str, int]
    plan: Plan
    params: tuple[LeafLayout, ...]
    per_device_bytes: dict[str, int]
    compiled_memory: dict[str, int]
    collectives: tuple[Collective, ...]
    analytic_collectives: tuple[Traffic, ...]
    warnings: tuple[str, ...]
    analytic_memory: dict[str, int] = dataclasses.field(default_factory=dict)
    flops_per_device: float | None = 0.0  # None: the workload is unknown (see :func:`report`)
    modelled_step_time: StepTime | None = None
    execution: Summary | None = None
    activation_note: str = "activations kept for backward"
    data_parallel: Report | None = None

    @property
    def comm_bytes_per_step(self) -> dict[str, int]:
        """Per-device collective traffic per step (ring terms): what the compiler made, what the model expects."""
        return {
            "compiled": sum(c.traffic_bytes for c in self.collectives),
            "analytic": int(sum(t.traffic_bytes for t in self.analytic_collectives)),
        }

    def with_data_parallel(self, baseline: Report) -> Report:
        """This report measured against ``baseline``, the report of data parallelism for the same model, batch
        and mesh: :meth:`vs_data_parallel` gives the ratios, and the tables a line comparing the two."""
        return dataclasses.replace(self, data_parallel=dataclasses.replace(baseline, data_parallel=None))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``spmd plan --json``); an execution mode's figures appear under its kind
        (``pipeline``, ``subnet``)."""
        out = {
            "mesh": {"axes": self.mesh_axes, "devices": math.prod(self.mesh_axes.values())},
            "plan": self.plan.describe(),
            "notes": list(self.plan.notes),
            "params": [row.to_dict() for row in self.params],
            "per_device_bytes": self.per_device_bytes,
            "compiled_memory": self.compiled_memory,
            "collectives": [c.to_dict() for c in self.collectives],
            "analytic_collectives": [t.to_dict() for t in self.analytic_collectives],
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "analytic_memory": self.analytic_memory,
            "flops_per_device": self.flops_per_device,
            "modelled_step_time": None if self.modelled_step_time is None else self.modelled_step_time.to_dict(),
            "execution": None if self.execution is None else self.execution.kind,
        }
        if self.execution is not None:
            if self.execution.kind in out:
                raise ValueError(f"an execution mode's summary kind {self.execution.kind!r} names a report field")
            out[self.execution.kind] = dict(self.execution.figures)
        return out | {
            "data_parallel": None if self.data_parallel is None else self.data_parallel.essentials(),
            "vs_data_parallel": self.vs_data_parallel(),
            "warnings": list(self.warnings),
        }

    def essentials(self) -> dict[str, Any]:
        """Per-device bytes, the compiled memory and the collectives: what another plan is compared on."""
        d = self.to_dict()
        return {k: d[k] for k in ("plan", "per_device_bytes", "compiled_memory", "collectives", "comm_bytes_per_step")}

    def vs_data_parallel(self) -> dict[str, float] | None:
        """This plan's figures as fractions of data parallelism's (see :meth:`with_data_parallel`), or None."""
        dp = self.data_parallel
        if dp is None:
            return None
        # A stateless optimizer (SGD) keeps nothing on either side: no ratio to give.
        out = {
            f"{k}_bytes": self.per_device_bytes[k] / dp.per_device_bytes[k]
            for k in ("params", "grads", "total", "optimizer")
            if dp.per_device_bytes[k]
        }
        for key in ("argument_bytes", "peak_bytes"):
            if self.compiled_memory.get(key) and dp.compiled_memory.get(key):
                out[f"compiled_{key}"] = self.compiled_memory[key] / dp.compiled_memory[key]
        out["comm_bytes"] = self.comm_bytes_per_step["compiled"] / max(1, dp.comm_bytes_per_step["compiled"])
        return out

    def tables(self, *, max_rows: int = 40) -> Group:
        """The report as rich renderables (the terminal view)."""
        return tables(self, max_rows=max_rows)

    def __rich__(self) -> Group:
        return self.tables()

    def __str__(self) -> str:
        """The terminal tables as plain text, so ``print(report)`` shows them."""
        console = Console(record=True, width=130, file=io.StringIO(), force_jupyter=False, color_system=None)
        console.print(self.tables())
        return console.export_text()

    def __repr__(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh_axes.items())
        counts = f"{len(self.params)} params; {len(self.collectives)} collectives"
        return f"Report(mesh {mesh}; {self.plan.describe()}; {counts})"

    def _repr_html_(self) -> str:
        # force_jupyter=False: otherwise rich, seeing a notebook, displays the tables itself and they show twice.
        console = Console(record=True, width=130, file=io.StringIO(), force_jupyter=False)
        console.print(self.tables())
        return console.export_html(inline_styles=True, code_format='<pre style="font-family:monospace">{code}</pre>')


def report(
    step: TrainStep,
    batch: Any,
    *,
    workload: costmodel.Workload | None = None,
    hardware: costmodel.Hardware | None = None,
) -> Report:
    """Compiles ``step`` for ``batch`` (once per batch shape) and joins the plan's layout with the compiled
    program and the cost model's expectation (``workload``: read from the batch's ``[batch, seq]`` array unless
    given; ``hardware``: detected from the mesh's devices unless given).

    A batch with no such array (images, say) and no ``workload`` leaves what depends on it unknown: the
    analytic side counts the parameters' traffic and memory only, FLOPs and the modelled step time are None,
    and a warning says so; the compiled side is whole.

    >>> import spmd, optax, jax, jax.numpy as jnp
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> step = spmd.TrainStep(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1), spmd.Plan(batch_axes=("data",)),
    ...                       mesh, params={"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)})
    >>> r = spmd.report(step, {"x": jnp.ones((mesh.size, 4))})
    >>> r.params[0].spec, r.per_device_bytes["params"]
    (P(None, None), 32)
    """
    compiled = step.compile(batch)
    layout, plan, mesh, ex = step.layout, step.plan, step.mesh, step.executor
    plan = step.plan_carried_out(batch)  # the estimate counts the activations a model ignoring remat keeps
    ignored_remat = step.plan.remat and not plan.remat
    workload = workload or _workload_of(batch)
    known = workload is not None
    # Without one, sequences of no tokens: the activations' traffic, memory and FLOPs count nothing.
    workload = workload or costmodel.Workload(batch=_leading_size(batch), seq_len=0)
    device = mesh.devices.flat[0]
    hw = hardware or costmodel.detect(device.device_kind, device.platform)
    estimate = costmodel.estimate_layout(layout, plan, mesh.shape, workload, hw, ex.costs(layout, batch, workload))
    batch_ways = math.prod(mesh.shape[a] for a in plan.batch_axes)
    batch_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(batch)) // batch_ways
    compiled_memory = memory_of(compiled)
    inventory = tuple(collectives(compiled.as_text(), mesh, branch_weights=ex.branch_weights))
    analytic_memory = estimate.step_memory(batch_bytes)
    if not known:
        analytic_memory = {k: v for k, v in analytic_memory.items() if k in ("argument_bytes", "padding_bytes")}
    return Report(
        mesh_axes=dict(mesh.shape),
        plan=plan,
        params=layout.params.leaves,
        per_device_bytes=estimate.per_device_bytes,
        compiled_memory=compiled_memory,
        collectives=inventory,
        analytic_collectives=estimate.traffic,
        warnings=tuple(
            (_IGNORED_REMAT,) * ignored_remat
            + tuple(_warnings(step, inventory, estimate, compiled_memory, analytic_memory, known))
        ),
        analytic_memory=analytic_memory,
        flops_per_device=estimate.flops if known else None,
        modelled_step_time=estimate.time if known else None,
        execution=ex.summary(layout, batch),
        activation_note=estimate.activation_note,
    )


_IGNORED_REMAT = (
    "remat: the plan asks the model to rematerialise its layers (plan.remat), and the model applies no remat; "
    "the estimate keeps every layer's activations. Wrap its layers in nn.remat or jax.checkpoint "
    "(models.rematerialised does it for the built-in models), or build the plan with remat=False"
)


def _workload_of(batch: Any) -> costmodel.Workload | None:
    try:
        return costmodel.Workload.from_batch(batch)
    except ValueError:
        return None


def _leading_size(batch: Any) -> int:
    """The batch's examples: the leading dimension its arrays share (1 for a batch of scalars)."""
    return max((int(np.shape(x)[0]) for x in jax.tree.leaves(batch) if np.ndim(x)), default=1)


def _warnings(
    step: TrainStep,
    inventory: tuple[Collective, ...],
    estimate: costmodel.Estimate,
    compiled_memory: dict[str, int],
    analytic_memory: dict[str, int],
    workload_known: bool = True,
) -> list[str]:
    """Where the plan, the compiler and the cost model disagree, and what the plan leaves replicated."""
    rows, mesh = step.layout.params, step.mesh
    # Block padding is asked for and shown in the parameter table; other row notes are warnings.
    out = (
        list(rows.unused_rules)
        + list(rows.advice)
        + [f"{r.path}: {r.note}" for r in rows.leaves if r.note and r.padded_shape is None]
    )
    out += [
        f"mesh axis {a!r} is used by no part of the plan: all work is replicated over it"
        for a in unused_axes(step.plan, mesh)
    ]
    idle = idle_axes(step.plan, step.layout, mesh)
    if idle:
        out.append(idle_axes_text(idle, mesh))
    if not workload_known:
        out.append(
            "workload unknown: the batch has no (batch, seq) token array, so the analytic side counts the "
            "parameters only (no activations, FLOPs or step time); pass workload=costmodel.Workload(batch, seq_len)"
        )
    flag = costmodel.compare(sum(c.traffic_bytes for c in inventory), sum(t.traffic_bytes for t in estimate.traffic))
    if flag and workload_known:  # without activations the analytic traffic is a floor, not an estimate
        out.append(f"collective traffic: {flag}")
    if "argument_bytes" in compiled_memory:
        flag = costmodel.compare(compiled_memory["argument_bytes"], analytic_memory["argument_bytes"])
        if flag:
            out.append(f"argument memory: {flag.split(':')[0]}: a buffer the plan does not lay out")
        ratio = compiled_memory["temp_bytes"] / max(1, analytic_memory.get("temp_bytes", compiled_memory["temp_bytes"]))
        if not 1 / TEMP_SLACK <= ratio <= TEMP_SLACK:
            out.append(
                f"temporaries: compiled {ratio:.2f}× the estimate; "
                + (
                    "XLA keeps more alive than the activations the model counts (without remat, every layer's "
                    "activations; a replicated intermediate; fusion buffers of a small model)"
                    if ratio > 1
                    else "XLA rematerialised or fused away activations the estimate keeps"
                )
            )
    if mesh.size > 1:
        out += [
            f"{r.path} ({format_bytes(r.bytes)}) is fully replicated on all {r.replicas} devices; "
            f"add a rule or an fsdp part to split it"
            for r in rows.leaves
            if r.replicas == mesh.size and r.bytes >= LARGE_REPLICATED_BYTES
        ]
    return out


def memory_of(compiled: jax.stages.Compiled) -> dict[str, int]:
    """The compiled program's ``memory_analysis()`` per device, with a peak estimate.

    >>> import jax, jax.numpy as jnp
    >>> memory_of(jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile())["argument_bytes"]
    16
    """
    stats = compiled.memory_analysis()
    if stats is None:  # some backends do not report
        return {}
    out = {ours: int(getattr(stats, theirs, 0)) for ours, theirs in _MEMORY_FIELDS.items()}
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    return out
