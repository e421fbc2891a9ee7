"""The plan report: what the plan asked for, next to what the compiler made of it."""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Any

import jax
import numpy as np
from rich.console import Console, Group
from rich.table import Table

from spmd import costmodel
from spmd._hlo import Collective, collectives
from spmd._pipeline import TICK_SCOPE
from spmd._plan import LeafLayout, Plan
from spmd._train import TrainStep
from spmd.costmodel import StepTime, Traffic

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
    """Per-parameter layout, per-device totals, the compiled program's memory and its collectives."""

    mesh_axes: dict[str, int]
    plan: Plan
    params: tuple[LeafLayout, ...]
    per_device_bytes: dict[str, int]
    compiled_memory: dict[str, int]
    collectives: tuple[Collective, ...]
    analytic_collectives: tuple[Traffic, ...]
    warnings: tuple[str, ...]
    analytic_memory: dict[str, int] = dataclasses.field(default_factory=dict)
    flops_per_device: float = 0.0
    modelled_step_time: StepTime | None = None
    pipeline: dict[str, Any] | None = None  # the schedule's figures (spmd.Pipeline.summary), for pipeline plans
    subnet: dict[str, Any] | None = None  # who owns what (spmd.Subnetworks.summary), for subnetwork plans
    # Subnetwork plans are measured against data parallelism: its report for the same model, batch and mesh.
    data_parallel: Report | None = None

    @property
    def comm_bytes_per_step(self) -> dict[str, int]:
        """Per-device collective traffic per step (ring terms): what the compiler made, what the model expects."""
        return {
            "compiled": sum(c.traffic_bytes for c in self.collectives),
            "analytic": int(sum(t.traffic_bytes for t in self.analytic_collectives)),
        }

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``spmd plan --json``)."""
        return {
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
            "pipeline": self.pipeline,
            "subnet": self.subnet,
            "data_parallel": None if self.data_parallel is None else self.data_parallel.essentials(),
            "vs_data_parallel": self.vs_data_parallel(),
            "warnings": list(self.warnings),
        }

    def essentials(self) -> dict[str, Any]:
        """Per-device bytes, the compiled memory and the collectives: what another plan is compared on."""
        d = self.to_dict()
        return {k: d[k] for k in ("plan", "per_device_bytes", "compiled_memory", "collectives", "comm_bytes_per_step")}

    def vs_data_parallel(self) -> dict[str, float] | None:
        """This plan's figures as fractions of data parallelism's (subnetwork plans), or None."""
        dp = self.data_parallel
        if dp is None:
            return None
        out = {f"{k}_bytes": self.per_device_bytes[k] / dp.per_device_bytes[k] for k in ("params", "grads", "total")}
        out["optimizer_bytes"] = self.per_device_bytes["optimizer"] / dp.per_device_bytes["optimizer"]
        for key in ("argument_bytes", "peak_bytes"):
            if self.compiled_memory.get(key) and dp.compiled_memory.get(key):
                out[f"compiled_{key}"] = self.compiled_memory[key] / dp.compiled_memory[key]
        out["comm_bytes"] = self.comm_bytes_per_step["compiled"] / max(1, dp.comm_bytes_per_step["compiled"])
        return out

    def tables(self, *, max_rows: int = 40) -> Group:
        """The report as rich renderables (the terminal view)."""
        mesh = " × ".join(f"{k}={v}" for k, v in self.mesh_axes.items())
        params = Table(title=f"Plan on mesh {mesh}: {self.plan.describe()}", title_justify="left")
        for col in ("parameter", "shape", "dtype", "spec", "per device", "replicas"):
            params.add_column(col, justify="right" if col in ("per device", "replicas") else "left")
        for row in self.params[:max_rows]:
            params.add_row(
                row.path, _shape(row), row.dtype, _spec(row), format_bytes(row.bytes_per_device), str(row.replicas)
            )
        if len(self.params) > max_rows:
            params.add_row(f"... {len(self.params) - max_rows} more", "", "", "", "", "")
        memory = Table(title="Memory per device", title_justify="left")
        for col in ("", "analytic", "compiled"):
            memory.add_column(col, justify="left" if not col else "right")
        pd, am, cm = self.per_device_bytes, self.analytic_memory, self.compiled_memory
        memory.add_row("parameters", format_bytes(pd["params"]), "")
        memory.add_row("gradients", format_bytes(pd["grads"]), "")
        memory.add_row("optimizer state", format_bytes(pd["optimizer"]), "")
        memory.add_row(
            "arguments (state + batch)", format_bytes(am.get("argument_bytes")), format_bytes(cm.get("argument_bytes"))
        )
        if am.get("padding_bytes"):
            memory.add_row("  of which block padding", format_bytes(am["padding_bytes"]), "")
        kept = "stage inputs kept, one tick's working set" if self.pipeline else "activations kept for backward"
        memory.add_row(kept, format_bytes(am.get("activation_bytes")), "")
        memory.add_row(
            "temporaries (grads, update, activations)",
            format_bytes(am.get("temp_bytes")),
            format_bytes(cm.get("temp_bytes")),
        )
        memory.add_row("peak", format_bytes(am.get("peak_bytes")), format_bytes(cm.get("peak_bytes")))
        comms = Table(title="Collectives the compiler generated (per step)", title_justify="left")
        for col in ("kind", "mesh axes", "group", "count", "bytes", "traffic/device"):
            comms.add_column(col, justify="left" if col in ("kind", "mesh axes") else "right")
        for c in self.collectives:
            comms.add_row(
                c.kind,
                ",".join(c.axes) or "-",
                str(c.group_size),
                str(c.count),
                format_bytes(c.bytes),
                format_bytes(c.traffic_bytes),
            )
        if not self.collectives:
            comms.add_row("none", "", "", "", "", "")
        traffic = self.comm_bytes_per_step
        compiled, analytic = format_bytes(traffic["compiled"]), format_bytes(traffic["analytic"])
        comms.caption = f"traffic per device per step: compiled {compiled}, analytic {analytic}"
        if self.modelled_step_time is not None:
            t = self.modelled_step_time
            comms.caption += (
                f"; modelled step on {t.hardware}: compute {_ms(t.compute_s)} + communication {_ms(t.comm_s)}"
            )
        parts: list[Any] = [params, memory, comms]
        if self.pipeline:
            pl = self.pipeline
            parts.append(
                f"pipeline: {pl['schedule']} on {pl['stages']} stages × {pl['virtual']} chunk(s), "
                f"{pl['microbatches']} microbatches, layers per stage {pl['layers_per_stage']}; simulated bubble "
                f"{pl['bubble_fraction']:.3f}, peak in flight {pl['peak_inflight']}, held until W {pl['peak_held']}; "
                f"executed in {pl['ticks']} ticks with {pl['slots']} input slots of "
                f"{format_bytes(pl['slot_bytes'])} per device"
            )
        if self.subnet:
            s = self.subnet
            kept = (
                f"{format_bytes(s['owned_param_bytes'])} of owned parameters and "
                f"{format_bytes(s['shared_param_bytes'])} shared by all"
                if s["masking"] == "forward"
                else f"the full parameters, {format_bytes(s['owned_grad_bytes'])} of owned gradients"
            )
            parts.append(
                f"subnetworks: {s['parts']} parts ({s['granularity']}: {s['groups']}), each owned by "
                f"{s['owners_per_group']} workers {s['owner_groups']}; per device {kept}"
            )
        if self.data_parallel is not None:
            dp, v = self.data_parallel, self.vs_data_parallel()
            reductions = ", ".join(
                f"{c.count} {c.kind} over {'×'.join(c.axes)} (group {c.group_size})" for c in dp.collectives
            )
            compiled = (
                f", compiled arguments {format_bytes(dp.compiled_memory['argument_bytes'])} "
                f"({v['compiled_argument_bytes']:.3f}×)"
                if "compiled_argument_bytes" in v
                else ""
            )
            parts.append(
                f"against data parallelism on this mesh: model state {format_bytes(dp.per_device_bytes['total'])} "
                f"per device (this plan {v['total_bytes']:.3f}×){compiled}; its collectives {reductions or 'none'}, "
                f"{format_bytes(dp.comm_bytes_per_step['compiled'])} per device per step ({v['comm_bytes']:.3f}×)"
            )
        parts += [f"note: {n}" for n in self.plan.notes]
        parts += [f"[yellow]warning:[/] {w}" for w in self.warnings]
        return Group(*parts)

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
    against_data_parallel: bool = True,
) -> Report:
    """Compiles ``step`` for ``batch`` (if not done) and joins the plan's layout with the compiled program and
    the cost model's expectation (``workload``: read from the batch's ``[batch, seq]`` array unless given;
    ``hardware``: detected from the mesh's devices unless given). A subnetwork plan's report also compiles data
    parallelism for the same model, batch and mesh and holds its report (``against_data_parallel=False``
    skips that).

    >>> import spmd, optax, jax, jax.numpy as jnp
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> step = spmd.train_step(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1),
    ...                        spmd.Plan(batch_axes=("data",)), mesh)
    >>> step.prepare({"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}).params.leaves[0].spec
    P(None, None)
    >>> r = spmd.report(step, {"x": jnp.ones((mesh.size, 4))})
    >>> r.per_device_bytes["params"]
    32
    """
    compiled = step.compiled if step.compiled is not None else step.compile(batch)
    layout, plan, mesh = step.layout, step.plan, step.mesh
    workload = workload or costmodel.Workload.from_batch(batch)
    pipeline = step.pipeline
    weights = {TICK_SCOPE: pipeline.branch_weights} if pipeline else None
    inventory = tuple(collectives(compiled.as_text(), mesh, branch_weights=weights))
    uses = pipeline.weight_uses() if pipeline is not None else None
    analytic = costmodel.traffic(layout, plan, mesh.shape, workload, stage_uses=uses)
    summary = None
    if pipeline is not None:
        params = step.abstract_state().params
        message = pipeline.activation(params, batch, step.data_axes)
        # Batch axes the program does not run manual over (those that split parameters: FSDP) split the
        # activations further, as the model lays them out.
        auto = math.prod(mesh.shape[a] for a in plan.batch_axes if a not in step.data_axes)
        message_bytes = math.prod(message.shape) * np.dtype(message.dtype).itemsize // auto
        prefix = "/".join(step.staged.layers_key) + "/"
        outer = sum(row.bytes_per_device for row in layout.params.leaves if not row.path.startswith(prefix))
        extra = costmodel.pipeline_traffic(pipeline.program.ticks, message_bytes, outer, plan.pipeline.axis, mesh.shape)
        analytic = costmodel.merge_traffic([*analytic, *extra])
        summary = {**pipeline.summary(), "slot_bytes": message_bytes}
    subnet = None
    if step.subnet is not None:
        # The reductions follow the ownership, not the layouts: the subnetwork's own figures replace data
        # parallelism's.
        subnet = step.subnet.summary(layout)
        activations = costmodel.activation_traffic(layout, plan, mesh.shape, workload)
        own = costmodel.subnet_traffic(subnet, plan.subnet.axis, masking=plan.subnet.masking)
        analytic = costmodel.merge_traffic([*activations, *own])
    analytic = tuple(analytic)
    if pipeline is None:
        activation_bytes = int(costmodel.activation_bytes(layout.params.leaves, plan, mesh.shape, workload))
    else:
        # A pipeline keeps stage inputs and their gradients in slots, and one tick's working set is live.
        schedule = pipeline.spec.schedule
        micro = dataclasses.replace(workload, batch=workload.batch // schedule.microbatches)
        tick = costmodel.pipeline_tick_bytes(layout.params.leaves, plan, mesh.shape, micro, schedule.virtual)
        activation_bytes = 2 * summary["slots"] * summary["slot_bytes"] + int(tick)
    state = costmodel.model_state_bytes(layout)
    batch_ways = math.prod(mesh.shape[a] for a in plan.batch_axes)
    batch_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(batch)) // batch_ways
    analytic_memory = {
        # The step's arguments: the training state (parameters, optimizer state, the int32 step) and the batch.
        "argument_bytes": state["params"] + state["optimizer"] + 4 + batch_bytes,
        "activation_bytes": activation_bytes,
        "padding_bytes": costmodel.padding_bytes(layout),
    }
    # Temporaries: the gradients, the optimizer's parameter-sized update, and the kept activations.
    analytic_memory["temp_bytes"] = state["grads"] + state["params"] + analytic_memory["activation_bytes"]
    analytic_memory["peak_bytes"] = analytic_memory["argument_bytes"] + analytic_memory["temp_bytes"]
    compiled_memory = memory_of(compiled)
    # Block padding is asked for and shown in the parameter table; other row notes are warnings.
    notes = [f"{row.path}: {row.note}" for row in layout.params.leaves if row.note and row.padded_shape is None]
    warnings = list(layout.params.unused_rules) + notes
    flag = costmodel.compare(sum(c.traffic_bytes for c in inventory), sum(t.traffic_bytes for t in analytic))
    if flag:
        warnings.append(f"collective traffic: {flag}")
    if "argument_bytes" in compiled_memory:
        flag = costmodel.compare(compiled_memory["argument_bytes"], analytic_memory["argument_bytes"])
        if flag:
            warnings.append(f"argument memory: {flag.split(':')[0]}: a buffer the plan does not lay out")
        ratio = compiled_memory["temp_bytes"] / max(1, analytic_memory["temp_bytes"])
        if not 1 / TEMP_SLACK <= ratio <= TEMP_SLACK:
            warnings.append(
                f"temporaries: compiled {ratio:.2f}× the estimate; "
                + (
                    "XLA keeps more alive than the activations the model counts (without remat, every layer's "
                    "activations; a replicated intermediate; fusion buffers of a small model)"
                    if ratio > 1
                    else "XLA rematerialised or fused away activations the estimate keeps"
                )
            )
    if mesh.size > 1:
        warnings += [
            f"{row.path} ({format_bytes(row.bytes)}) is fully replicated on all {row.replicas} devices; "
            f"add a rule or an fsdp part to split it"
            for row in layout.params.leaves
            if row.replicas == mesh.size and row.bytes >= LARGE_REPLICATED_BYTES
        ]
    device = mesh.devices.flat[0]
    hw = hardware or costmodel.detect(device.device_kind, device.platform)
    flops = costmodel.flops_per_device(layout.params.leaves, plan, mesh.shape, workload)
    return Report(
        mesh_axes=dict(mesh.shape),
        plan=plan,
        params=layout.params.leaves,
        per_device_bytes=state,
        compiled_memory=compiled_memory,
        collectives=inventory,
        analytic_collectives=analytic,
        warnings=tuple(warnings),
        analytic_memory=analytic_memory,
        flops_per_device=flops,
        modelled_step_time=costmodel.step_time(flops, analytic, hw, mesh.shape),
        pipeline=summary,
        subnet=subnet,
        data_parallel=(
            _data_parallel(step, batch, workload, hw) if step.subnet is not None and against_data_parallel else None
        ),
    )


def _data_parallel(step: TrainStep, batch: Any, workload: costmodel.Workload, hw: costmodel.Hardware) -> Report:
    """The report of plain data parallelism over the same batch axes, for the model ``step`` trains."""
    dp = TrainStep(step.loss_fn, step.optimizer, Plan(batch_axes=step.plan.batch_axes), step.mesh)
    params = jax.eval_shape(step.params_of, step.abstract_state())  # the whole model, in its own layout
    dp.prepare(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    return report(dp, batch, workload=workload, hardware=hw)


def memory_of(compiled: jax.stages.Compiled) -> dict[str, int]:
    """The compiled program's ``memory_analysis()`` per device, with a peak estimate."""
    stats = compiled.memory_analysis()
    if stats is None:  # some backends do not report
        return {}
    out = {ours: int(getattr(stats, theirs, 0)) for ours, theirs in _MEMORY_FIELDS.items()}
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    return out


def _shape(row: LeafLayout) -> str:
    if row.padded_shape is None:
        return str(row.shape)
    dims = [str(n) if n == p else f"{n}→{p}" for n, p in zip(row.shape, row.padded_shape, strict=True)]
    return "(" + ", ".join(dims) + ")"


def _spec(row: LeafLayout) -> str:
    return "(" + ", ".join("-" if e is None else e if isinstance(e, str) else "+".join(e) for e in row.spec) + ")"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} µs"


def format_bytes(n: float | None) -> str:
    """Bytes for people: ``B``, ``KiB`` or ``MiB`` (empty for None).

    >>> format_bytes(3 << 20)
    '3.00 MiB'
    """
    if n is None:
        return ""
    if n < 1024:
        return f"{n} B"
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1 << 20):.2f} MiB"
