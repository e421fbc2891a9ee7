"""The plan report: what the plan asked for, next to what the compiler made of it."""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Any

import jax
from rich.console import Console, Group
from rich.table import Table

from spmd import costmodel
from spmd._hlo import Collective, collectives
from spmd._plan import LeafLayout, Plan
from spmd._train import TrainStep
from spmd.costmodel import Traffic

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
            "params": [row.to_dict() for row in self.params],
            "per_device_bytes": self.per_device_bytes,
            "compiled_memory": self.compiled_memory,
            "collectives": [c.to_dict() for c in self.collectives],
            "analytic_collectives": [t.to_dict() for t in self.analytic_collectives],
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "warnings": list(self.warnings),
        }

    def tables(self, *, max_rows: int = 40) -> Group:
        """The report as rich renderables (the terminal view)."""
        mesh = " × ".join(f"{k}={v}" for k, v in self.mesh_axes.items())
        params = Table(title=f"Plan on mesh {mesh}: {self.plan.describe()}", title_justify="left")
        for col in ("parameter", "shape", "dtype", "spec", "per device", "replicas"):
            params.add_column(col, justify="right" if col in ("per device", "replicas") else "left")
        for row in self.params[:max_rows]:
            params.add_row(
                row.path, str(row.shape), row.dtype, _spec(row), _mb(row.bytes_per_device), str(row.replicas)
            )
        if len(self.params) > max_rows:
            params.add_row(f"... {len(self.params) - max_rows} more", "", "", "", "", "")
        memory = Table(title="Memory per device", title_justify="left")
        memory.add_column("planned (model state)")
        memory.add_column("bytes", justify="right")
        memory.add_column("compiled program")
        memory.add_column("bytes", justify="right")
        planned = list(self.per_device_bytes.items())
        compiled = list(self.compiled_memory.items())
        for i in range(max(len(planned), len(compiled))):
            a = planned[i] if i < len(planned) else ("", None)
            b = compiled[i] if i < len(compiled) else ("", None)
            memory.add_row(a[0], _mb(a[1]), b[0], _mb(b[1]))
        comms = Table(title="Collectives the compiler generated (per step)", title_justify="left")
        for col in ("kind", "mesh axes", "group", "count", "bytes", "traffic/device"):
            comms.add_column(col, justify="left" if col in ("kind", "mesh axes") else "right")
        for c in self.collectives:
            comms.add_row(
                c.kind,
                ",".join(c.axes) or "-",
                str(c.group_size),
                str(c.count),
                _mb(c.bytes),
                _mb(c.traffic_bytes),
            )
        if not self.collectives:
            comms.add_row("none", "", "", "", "", "")
        traffic = self.comm_bytes_per_step
        comms.caption = (
            f"traffic per device per step: compiled {_mb(traffic['compiled'])}, analytic {_mb(traffic['analytic'])}"
        )
        parts: list[Any] = [params, memory, comms]
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


def report(step: TrainStep, batch: Any) -> Report:
    """Compiles ``step`` for ``batch`` (if not done) and joins the plan's layout with the compiled program.

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
    layout = step.layout
    inventory = tuple(collectives(compiled.as_text(), step.mesh))
    analytic = tuple(costmodel.data_parallel_traffic(layout, step.plan, step.mesh.shape))
    warnings = list(layout.params.unused_rules) + list(layout.params.notes)
    flag = costmodel.compare(sum(c.traffic_bytes for c in inventory), sum(t.traffic_bytes for t in analytic))
    if flag:
        warnings.append(f"collective traffic: {flag}")
    if step.mesh.size > 1:
        warnings += [
            f"{row.path} ({_mb(row.bytes)}) is fully replicated on all {row.replicas} devices; "
            f"add a rule or an fsdp part to split it"
            for row in layout.params.leaves
            if row.replicas == step.mesh.size and row.bytes >= LARGE_REPLICATED_BYTES
        ]
    return Report(
        mesh_axes=dict(step.mesh.shape),
        plan=step.plan,
        params=layout.params.leaves,
        per_device_bytes=costmodel.model_state_bytes(layout),
        compiled_memory=memory_of(compiled),
        collectives=inventory,
        analytic_collectives=analytic,
        warnings=tuple(warnings),
    )


def memory_of(compiled: jax.stages.Compiled) -> dict[str, int]:
    """The compiled program's ``memory_analysis()`` per device, with a peak estimate."""
    stats = compiled.memory_analysis()
    if stats is None:  # some backends do not report
        return {}
    out = {ours: int(getattr(stats, theirs, 0)) for ours, theirs in _MEMORY_FIELDS.items()}
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    return out


def _spec(row: LeafLayout) -> str:
    return "(" + ", ".join("-" if e is None else e if isinstance(e, str) else "+".join(e) for e in row.spec) + ")"


def _mb(n: int | None) -> str:
    if n is None:
        return ""
    if n < 1024:
        return f"{n} B"
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1 << 20):.2f} MiB"
