"""The report's terminal view: rich tables of the layout, the memory and the collectives, and its notes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table

from spmd._format import format_bytes, format_seconds
from spmd._layout import LeafLayout

if TYPE_CHECKING:
    from spmd._report import Report

__all__ = ["tables"]


def tables(report: Report, *, max_rows: int = 40) -> Group:
    """The report as rich renderables: parameters, memory, collectives, then the execution mode's line, the
    comparison with data parallelism, notes and warnings."""
    parts: list[Any] = [_params(report, max_rows), _memory(report), _collectives(report)]
    permutes = sorted({",".join(c.axes) for c in report.collectives if c.kind == "collective-permute"})
    if permutes:
        # A reshard between two device orders sends each device's shard around a cycle of the permutation: 3
        # devices of a 4 × 2 mesh, say, which reads like a group no axis has.
        parts.append(
            f"note: collective-permute over {' and '.join(permutes)}: its group is the most devices its "
            "source→target pairs link (a pipeline's shift, its stages; a reshard between two device orders, a cycle "
            "of the permutation)"
        )
    ones = [k for k, v in report.mesh_axes.items() if v == 1]
    if ones:  # a MaxText mesh names 12 axes, 9 of them of one device: they split nothing
        parts.append(f"note: {len(ones)} mesh axes of size 1 not shown ({', '.join(ones)})")
    for_activations = report.activation_rules
    if for_activations:  # MaxText's rules name dozens of activations: they match no parameter by design
        shown = ", ".join(for_activations[:8]) + (", …" if len(for_activations) > 8 else "")
        parts.append(
            f"note: {len(for_activations)} logical rules name activations only, not parameters: {shown} (they lay "
            "out the activations model code constrains by those names)"
        )
    if report.execution is not None:
        parts.append(report.execution.text)
    if report.data_parallel is not None:
        parts.append(_against_data_parallel(report))
    # Escaped: a warning quotes paths and regex rules, whose brackets rich would read as its markup.
    parts += [f"note: {escape(n)}" for n in report.plan.notes]
    parts += [f"[yellow]warning:[/] {escape(w)}" for w in report.warnings]
    return Group(*parts)


def _params(report: Report, max_rows: int) -> Table:
    mesh = " × ".join(f"{k}={v}" for k, v in report.mesh_axes.items() if v > 1) or "of one device"
    table = Table(title=f"Plan on mesh {mesh}: {report.plan.describe()}", title_justify="left")
    for col in ("parameter", "shape", "dtype", "spec", "per device", "replicas"):
        table.add_column(col, justify="right" if col in ("per device", "replicas") else "left")
    for row in report.params[:max_rows]:
        spec = _spec(row, report.mesh_axes)
        table.add_row(row.path, _shape(row), row.dtype, spec, format_bytes(row.bytes_per_device), str(row.replicas))
    if not report.layout_known:
        table.add_row("unknown: pass params=", "", "", "", "", "")
    if len(report.params) > max_rows:
        table.add_row(f"... {len(report.params) - max_rows} more", "", "", "", "", "")
    return table


def _memory(report: Report) -> Table:
    table = Table(title="Memory per device", title_justify="left")
    for col in ("", "analytic", "compiled"):
        table.add_column(col, justify="left" if not col else "right")
    pd, am, cm = report.per_device_bytes, report.analytic_memory, report.compiled_memory
    p = report.plan.precision
    # Under a precision policy each row says its dtype: what is stored, and what the step makes.
    kept, made = ("", "") if p is None else (f" ({p.params} master)", f" ({p.compute})")
    table.add_row(f"parameters{kept}", format_bytes(pd.get("params")), "")
    if p is not None:
        table.add_row(f"  cast copy for compute{made}, each step", format_bytes(pd.get("compute_params")), "")
    table.add_row(f"gradients{made}", format_bytes(pd.get("grads")), "")
    table.add_row("optimizer state", format_bytes(pd.get("optimizer")), "")
    table.add_row(
        "arguments (state + batch)", format_bytes(am.get("argument_bytes")), format_bytes(cm.get("argument_bytes"))
    )
    if am.get("padding_bytes"):
        table.add_row("  of which block padding", format_bytes(am["padding_bytes"]), "")
    table.add_row(report.activation_note, format_bytes(am.get("activation_bytes")), "")
    table.add_row(
        "temporaries (grads, update, activations)",
        format_bytes(am.get("temp_bytes")),
        format_bytes(cm.get("temp_bytes")),
    )
    table.add_row("peak", format_bytes(am.get("peak_bytes")), format_bytes(cm.get("peak_bytes")))
    if pd.get("host_optimizer") or "host_argument_bytes" in cm or "host_argument_bytes" in am:
        # Offloaded state: in host memory between steps, apart from the device's figures above.
        table.add_row(
            "host: arguments (offloaded state)",
            format_bytes(am.get("host_argument_bytes")),
            format_bytes(cm.get("host_argument_bytes")),
        )
        table.add_row("host: outputs", "", format_bytes(cm.get("host_output_bytes")))
    if "host_activation_bytes" in am:  # an offload remat policy's activations, held in host memory in the step
        table.add_row("host: offloaded activations", format_bytes(am["host_activation_bytes"]), "")
    if "host_transfer_bytes" in am:
        table.add_row("host <-> device per step", format_bytes(am["host_transfer_bytes"]), "")
    return table


def _collectives(report: Report) -> Table:
    table = Table(title="Collectives the compiler generated (per step)", title_justify="left")
    for col in ("kind", "mesh axes", "group", "count", "bytes", "traffic/device"):
        table.add_column(col, justify="left" if col in ("kind", "mesh axes") else "right")
    for c in report.collectives:
        table.add_row(
            c.kind, _axes(c, report.mesh_axes), str(c.group_size), str(c.count), format_bytes(c.bytes),
            format_bytes(c.traffic_bytes),
        )  # fmt: skip
    if not report.collectives:
        table.add_row("none", "", "", "", "", "")
    traffic = report.comm_bytes_per_step
    compiled, analytic = format_bytes(traffic["compiled"]), format_bytes(traffic["analytic"]) or "unknown"
    only = " (parameters only: the workload is unknown)" if report.flops_per_device is None else ""
    table.caption = f"traffic per device per step: compiled {compiled}, analytic {analytic}{only}"
    if report.wire_note:
        table.caption += f"; {report.wire_note}"
    if report.compiled_flops is not None:
        model = f" ({report.compiled_flops / report.model_flops:.2f}× 6·N·T)" if report.model_flops else ""
        table.caption += f"; matmul FLOPs per device: compiled {report.compiled_flops:.3g}{model}, analytic " + (
            "unknown" if report.flops_per_device is None else f"{report.flops_per_device:.3g}"
        )
    if report.modelled_step_time is not None:
        t = report.modelled_step_time
        table.caption += (
            f"; modelled step on {t.hardware}: compute {format_seconds(t.compute_s)} + communication "
            f"{format_seconds(t.comm_s)}"
        )
    return table


def _against_data_parallel(report: Report) -> str:
    dp, v = report.data_parallel, report.vs_data_parallel()
    reductions = ", ".join(
        f"{c.count} {c.kind} over {_axes(c, dp.mesh_axes)} (group {c.group_size})" for c in dp.collectives
    )
    compiled = (
        f", compiled arguments {format_bytes(dp.compiled_memory['argument_bytes'])} "
        f"({v['compiled_argument_bytes']:.3f}×)"
        if "compiled_argument_bytes" in v
        else ""
    )
    return (
        f"against data parallelism on this mesh: model state {format_bytes(dp.per_device_bytes['total'])} "
        f"per device (this plan {v['total_bytes']:.3f}×){compiled}; its collectives {reductions or 'none'}, "
        f"{format_bytes(dp.comm_bytes_per_step['compiled'])} per device per step ({v['comm_bytes']:.3f}×)"
    )


def _shape(row: LeafLayout) -> str:
    if row.padded_shape is None:
        return str(row.shape)
    dims = [str(n) if n == p else f"{n}→{p}" for n, p in zip(row.shape, row.padded_shape, strict=True)]
    return "(" + ", ".join(dims) + ")"


def _spec(row: LeafLayout, sizes: dict[str, int]) -> str:
    """The spec without axes of size 1 (they split nothing)."""

    def dim(entry: Any) -> str:
        names = [a for a in ((entry,) if isinstance(entry, str) else entry or ()) if sizes.get(a, 2) > 1]
        return "+".join(names) or "-"

    return "(" + ", ".join(dim(e) for e in row.spec) + ")"


def _axes(c: Any, sizes: dict[str, int]) -> str:
    """The collective's mesh axes; an axis a group spans only part of reads ``fsdp (2 of 4)``."""
    if not c.axes:
        return "-"
    spans = c.spans or tuple(sizes.get(a, 0) for a in c.axes)
    return ",".join(
        a if n == sizes.get(a) else f"{a} ({n} of {sizes.get(a)})" for a, n in zip(c.axes, spans, strict=True)
    )
