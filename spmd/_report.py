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
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from rich.console import Console, Group

from spmd import costmodel
from spmd._context_parallel import context_weights
from spmd._executor import Summary
from spmd._format import format_bytes
from spmd._hlo import Collective, collectives, matmul_flops, num_devices
from spmd._layout import LeafLayout, StateLayout, resolve_state
from spmd._offload import host_memory
from spmd._plan import Plan
from spmd._report_tables import tables
from spmd._resolve import idle_axes, idle_axes_text, unused_axes
from spmd._rules import PlanError, is_activation_name
from spmd._train import TrainStep, recomputes
from spmd._tree import unbox
from spmd.costmodel import StepTime, Traffic

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
# Host memory (offloaded state), where the backend reports it.
_HOST_FIELDS = {
    "host_argument_bytes": "host_argument_size_in_bytes",
    "host_output_bytes": "host_output_size_in_bytes",
    "host_temp_bytes": "host_temp_size_in_bytes",
    "host_alias_bytes": "host_alias_size_in_bytes",
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
    compiled_flops: float | None = None  # matmul FLOPs per device per step, read from the compiled HLO
    # Where the execution mode gives its axis's positions uneven work: each position's compiled FLOPs.
    compiled_flops_by_position: tuple[float, ...] | None = None
    model_flops: float | None = None  # 6·N·T per device per step (costmodel.model_flops over the devices)
    layout_known: bool = True  # False: a step of your own reported without params= (see :func:`report`)

    @property
    def comm_bytes_per_step(self) -> dict[str, int]:
        """Per-device collective traffic per step (ring terms): what the compiler made, what the model expects."""
        analytic = int(sum(t.traffic_bytes for t in self.analytic_collectives)) if self.layout_known else None
        return {"compiled": sum(c.traffic_bytes for c in self.collectives), "analytic": analytic}

    def with_data_parallel(self, baseline: Report) -> Report:
        """This report measured against ``baseline``, the report of data parallelism for the same model, batch
        and mesh: :meth:`vs_data_parallel` gives the ratios, and the tables a line comparing the two."""
        return dataclasses.replace(self, data_parallel=dataclasses.replace(baseline, data_parallel=None))

    @property
    def wire_note(self) -> str | None:
        """One sentence when the compiled program sends some collective wider than the program's own type (XLA:CPU
        widens bf16 collectives to f32): its ``bytes`` are the program's, as GPU and TPU send them."""
        widened = [c for c in self.collectives if c.widened]
        if not widened:
            return None
        # A combined collective names its largest element's type; the widened ones are the narrow floats.
        program = sorted({c.dtype for c in widened} - {"f32", "f64"}) or ["bf16"]
        wire, narrow = sum(c.wire_bytes for c in widened), sum(c.bytes for c in widened)
        return (
            f"this backend widens {'/'.join(program)} collectives to f32 on its wire: bytes and traffic count the "
            f"program's {'/'.join(program)} (as GPU and TPU send them), {format_bytes(narrow)} of the "
            f"{format_bytes(wire)} these collectives send here"
        )

    @property
    def activation_rules(self) -> list[str]:
        """The plan's logical rules for activation names (MaxText's ``activation_*``, ``seq``) that no parameter
        names: they lay out the activations that model code constrains by those names (flax's
        ``with_logical_constraint``, :func:`spmd.constrain`), and are not rules that matched nothing."""
        named = {n for row in self.params for n in row.names or ()}
        rules = [n for n, _ in self.plan.logical_rules() if n != "batch" and is_activation_name(n) and n not in named]
        return list(dict.fromkeys(rules))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``spmd plan --json``); an execution mode's figures appear under its kind
        (``pipeline``, ``subnet``)."""
        out = {
            "mesh": {"axes": self.mesh_axes, "devices": math.prod(self.mesh_axes.values())},
            "plan": self.plan.describe(),
            "notes": list(self.plan.notes),
            "activation_rules": self.activation_rules,
            "params": [row.to_dict() for row in self.params],
            "per_device_bytes": self.per_device_bytes,
            "compiled_memory": self.compiled_memory,
            "collectives": [c.to_dict() for c in self.collectives],
            "analytic_collectives": [t.to_dict() for t in self.analytic_collectives],
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "wire_note": self.wire_note,
            "analytic_memory": self.analytic_memory,
            "flops_per_device": self.flops_per_device,
            "compiled_flops_per_device": self.compiled_flops,
            "compiled_flops_by_position": None
            if self.compiled_flops_by_position is None
            else list(self.compiled_flops_by_position),
            "model_flops_per_device": self.model_flops,
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
            if dp.per_device_bytes.get(k) and k in self.per_device_bytes
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
    program: Any,
    batch: Any = None,
    *,
    plan: Plan | None = None,
    mesh: jax.sharding.Mesh | None = None,
    params: Any = None,
    optimizer: Any = None,
    workload: costmodel.Workload | None = None,
    hardware: costmodel.Hardware | None = None,
) -> Report:
    """The report of one training step: the plan's layout joined with the compiled program (its memory, its
    collectives and its matmul FLOPs) and the cost model's expectation (``workload``: read from the batch's
    ``[batch, seq]`` array unless given; ``hardware``: detected from the mesh's devices unless given).

    ``program`` is a :class:`spmd.TrainStep` (compiled for ``batch``, once per batch shape: it knows its plan,
    mesh, parameters and optimizer), or a step of your own: ``jax.jit``/``nnx.jit``'s ``train_step.lower(...)``,
    ``.trace(...)`` or ``.lower(...).compile()``, with the ``plan`` and ``mesh`` it was laid out by, its
    ``params`` (arrays, abstract or annotated, or an nnx state: which arguments are parameters only you know)
    and the ``optimizer`` (an optax transformation, e.g. ``nnx.Optimizer``'s ``tx``). What is not given is
    unknown, not guessed: without ``params`` the report has the compiled side only; without ``optimizer`` no
    optimizer state; a batch with no token array (images) and no ``workload`` leaves the activations, FLOPs and
    step time unknown. Each says so in a warning, as does a parameter given as an array placed otherwise than the
    plan lays it out.

    >>> import spmd, optax, jax, jax.numpy as jnp
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> step = spmd.TrainStep(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1), spmd.Plan(batch_axes=("data",)),
    ...                       mesh, params={"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)})
    >>> r = spmd.report(step, {"x": jnp.ones((mesh.size, 4))})
    >>> r.params[0].spec, r.per_device_bytes["params"]
    (P(None, None), 32)

    A step of your own:

    >>> plan, w, x = spmd.Plan(batch_axes=("data",)), jnp.ones((4, 2)), jnp.ones((mesh.size, 4))
    >>> own = jax.jit(jax.grad(lambda w, x: jnp.mean(jnp.tanh(x @ w))), in_shardings=(plan.shardings(w, mesh),
    ...               plan.batch_shardings(x, mesh)))
    >>> r = spmd.report(own.lower(w, x), x, plan=plan, mesh=mesh, params=w)
    >>> r.per_device_bytes["params"], [c.kind for c in r.collectives], r.compiled_flops > 0
    (32, ['all-reduce'], True)
    """
    if isinstance(program, TrainStep):
        named = {"plan": plan, "mesh": mesh, "params": params, "optimizer": optimizer}
        given = [k for k, v in named.items() if v is not None]
        if given or batch is None:
            raise TypeError(
                "spmd.report(step, batch): a TrainStep carries its plan, mesh, parameters and optimizer and is "
                f"compiled for a batch; {'drop ' + ', '.join(f'{k}=' for k in given) if given else 'pass the batch'}"
            )
        return _report_step(program, batch, workload, hardware)
    return _report_program(program, batch, plan, mesh, params, optimizer, workload, hardware)


def _report_step(step: TrainStep, batch: Any, workload: Any, hardware: Any) -> Report:
    plan = step.plan_carried_out(batch)  # the estimate counts the activations a model ignoring remat keeps
    said = (_IGNORED_REMAT,) if step.plan.remat and not plan.remat else ()
    workload, known = _workload(batch, workload)
    ex = step.executor
    side = _Side(step.layout, ex.costs(step.layout, batch, workload), optimizer_known=True, counter_bytes=4)
    return _join(
        step.plan, plan, step.mesh, step.compile(batch), batch, side, workload, known, hardware,
        branch_weights={**ex.branch_weights, **context_weights(step.plan, step.mesh)},
        execution=ex.summary(step.layout, batch), said=said, positions=ex.position_weights,
    )  # fmt: skip


def _report_program(
    program: Any, batch: Any, plan: Any, mesh: Any, params: Any, optimizer: Any, workload: Any, hardware: Any
) -> Report:
    """The report of a step of the user's own (see :func:`report`): the same join, with what was not given
    unknown."""
    if not isinstance(plan, Plan) or not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            "spmd.report(program, batch, plan=, mesh=): a step of your own needs the spmd.Plan and the jax Mesh it "
            f"was laid out by; got plan={type(plan).__name__}, mesh={type(mesh).__name__}"
        )
    if plan.execution is not None:
        raise PlanError(
            f"spmd.report: this plan runs {plan.execution.describe()}, which a step of your own does not; build its "
            "spmd.TrainStep and report that, or report your step with a plan of SPMD annotations only"
        )
    plan.check_mesh(dict(mesh.shape))
    tx = getattr(optimizer, "tx", optimizer)  # nnx.Optimizer keeps its optax transformation as .tx
    if tx is not None and not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"spmd.report: optimizer= takes an optax transformation (or an nnx.Optimizer); got {type(tx).__name__}"
        )
    compiled, jaxpr = _compiled(program)
    devices = num_devices(compiled.as_text())
    if devices != mesh.size:
        raise ValueError(
            f"spmd.report: the program runs on {devices} devices and the mesh {dict(mesh.shape)} has {mesh.size}; "
            "pass the mesh the program was jitted over"
        )
    said, carried = [], plan
    if plan.remat and jaxpr is not None and not recomputes(jaxpr):
        carried, said = dataclasses.replace(plan, remat=False), [_IGNORED_REMAT]
    elif plan.remat and jaxpr is None:
        said = [_REMAT_UNKNOWN]
    workload, known = _workload(batch, workload)
    side = None
    if params is None:
        said.append(_PARAMS_UNKNOWN)
    else:
        layout = resolve_state(plan, params, tx or optax.identity(), mesh)
        side = _Side(layout, costmodel.Contribution(), optimizer_known=tx is not None, counter_bytes=0)
        if tx is None:
            said.append(_OPTIMIZER_UNKNOWN)
        said += _placed_otherwise(params, layout.params.leaves, mesh)
    return _join(plan, carried, mesh, compiled, batch, side, workload, known, hardware, said=tuple(said))


def _placed_otherwise(params: Any, rows: tuple[LeafLayout, ...], mesh: jax.sharding.Mesh) -> list[str]:
    """Where parameters given as placed arrays are not laid out as the plan asks: the report shows the plan's
    layout, and the program ran on theirs."""
    arrays = jax.tree.leaves(unbox(params))
    if len(arrays) != len(rows):
        return []
    out = []
    for array, row in zip(arrays, rows, strict=True):
        sharding = getattr(array, "sharding", None)
        if not isinstance(array, jax.Array) or sharding is None or row.padded_shape is not None:
            continue
        if not sharding.is_equivalent_to(NamedSharding(mesh, row.spec), array.ndim):
            spec = getattr(sharding, "spec", sharding)
            out.append(
                f"{row.path} is laid out as {spec} and the plan asks {row.spec}: the compiled figures are of the "
                "arrays' layout; place them with plan.shardings (or constrain them in the step)"
            )
    return out


def _compiled(program: Any) -> tuple[jax.stages.Compiled, Any]:
    """The compiled program and, when it was given traced, its jaxpr (to see whether it rematerialises)."""
    traced = getattr(program, "traced", program)  # nnx.jit's stages wrap jax's: .traced is jax's Traced
    if isinstance(traced, jax.stages.Traced):
        return program.lower().compile(), traced.jaxpr
    if isinstance(program, jax.stages.Lowered):
        return program.compile(), None
    if isinstance(program, jax.stages.Compiled):
        return program, None
    what = "a function, which jax compiles for its arguments" if callable(program) else type(program).__name__
    raise TypeError(
        "spmd.report takes a spmd.TrainStep or a step of your own as jax made it for its arguments: "
        "train_step.trace(params, opt_state, batch) (or .lower(...), or .lower(...).compile()); "
        f"got {what}"
    )


@dataclasses.dataclass(frozen=True)
class _Side:
    """What the plan asked, where it is known: the training state's layout and what the execution adds."""

    layout: StateLayout
    costs: costmodel.Contribution
    optimizer_known: bool
    counter_bytes: int  # the step counter a TrainStep keeps beside the state; a loop of your own keeps its own


def _join(
    asked: Plan,
    plan: Plan,
    mesh: jax.sharding.Mesh,
    compiled: jax.stages.Compiled,
    batch: Any,
    side: _Side | None,
    workload: costmodel.Workload,
    known: bool,
    hardware: costmodel.Hardware | None,
    *,
    branch_weights: Any = None,
    execution: Summary | None = None,
    said: tuple[str, ...] = (),
    positions: Sequence[Any] = (),
) -> Report:
    """The three views joined: ``asked`` is the plan as given, ``plan`` as the program carries it out;
    ``positions``: per position of an uneven mode's axis, the branch weights that make the counts its own."""
    text = compiled.as_text()
    by_position = tuple(matmul_flops(text, branch_weights={**(branch_weights or {}), **w}) for w in positions)
    compiled_memory = memory_of(compiled)
    inventory = tuple(collectives(text, mesh, branch_weights=branch_weights))
    out = Report(
        mesh_axes=dict(mesh.shape),
        plan=plan,
        params=(),
        per_device_bytes={},
        compiled_memory=compiled_memory,
        collectives=inventory,
        analytic_collectives=(),
        warnings=(),
        flops_per_device=None,
        # The busiest device's: where positions differ, the position computing the most.
        compiled_flops=max(by_position) if by_position else matmul_flops(text, branch_weights=branch_weights),
        compiled_flops_by_position=by_position or None,
        execution=execution,
        layout_known=side is not None,
    )
    warned = list(said)
    if side is not None:
        device = mesh.devices.flat[0]
        hw = hardware or costmodel.detect(device.device_kind, device.platform)
        estimate = costmodel.estimate_layout(side.layout, plan, mesh.shape, workload, hw, side.costs)
        out = _with_estimate(out, estimate, side, batch, known)
        if known:
            out = dataclasses.replace(out, model_flops=costmodel.model_flops(out.params, workload) / mesh.size)
        warned += _warnings(asked, side.layout, mesh, inventory, estimate, compiled_memory, out.analytic_memory, known)
    return dataclasses.replace(out, warnings=tuple(warned))


def _with_estimate(out: Report, estimate: costmodel.Estimate, side: _Side, batch: Any, known: bool) -> Report:
    """``out`` with the plan's layout and the cost model's side, less what is unknown."""
    batch_ways = math.prod(out.mesh_axes[a] for a in out.plan.data_axes)
    memory = estimate.step_memory(_bytes(batch) // batch_ways)
    memory["argument_bytes"] += side.counter_bytes - 4  # step_memory counts a TrainStep's int32 step counter
    keep = set(memory) if known else {"argument_bytes", "padding_bytes", "host_argument_bytes", "host_transfer_bytes"}
    if not side.optimizer_known or batch is None:
        keep -= {"argument_bytes", "peak_bytes"}
    per_device = dict(estimate.per_device_bytes)
    if not side.optimizer_known:
        per_device = {k: v for k, v in per_device.items() if k in ("params", "grads")}
    return dataclasses.replace(
        out,
        params=side.layout.params.leaves,
        per_device_bytes=per_device,
        analytic_collectives=estimate.traffic,
        analytic_memory={k: v for k, v in memory.items() if k in keep},
        flops_per_device=estimate.flops if known else None,
        modelled_step_time=estimate.time if known else None,
        activation_note=estimate.activation_note,
    )


def _workload(batch: Any, workload: costmodel.Workload | None) -> tuple[costmodel.Workload, bool]:
    """The workload, given or read from the batch, and whether it is known. Without one, sequences of no
    tokens: the activations' traffic, memory and FLOPs count nothing."""
    if workload is None and batch is not None:
        workload = _workload_of(batch)
    if workload is not None:
        return workload, True
    return costmodel.Workload(batch=_leading_size(batch), seq_len=0), False


def _bytes(batch: Any) -> int:
    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(batch))


_IGNORED_REMAT = (
    "remat: the plan asks the model to rematerialise its layers (plan.remat), and the model applies no remat; "
    "the estimate keeps every layer's activations. Wrap its layers in spmd.rematerialise (the plan's policy), "
    "nn.remat or jax.checkpoint (models.rematerialised does it for the built-in models), or build the plan with "
    "remat='none'"
)
_REMAT_UNKNOWN = (
    "remat: the plan asks for it (plan.remat) and a lowered or compiled program does not say whether the model "
    "applies it; the estimate assumes it does. Pass train_step.trace(...) to have it checked"
)
_PARAMS_UNKNOWN = (
    "parameters unknown: pass params= (the step's parameters, or their abstract shapes) to see the plan's layout "
    "and the cost model's side; the compiled side is whole"
)
_OPTIMIZER_UNKNOWN = (
    "optimizer unknown: the optimizer state's layout and bytes, and the analytic argument memory, are left out; "
    "pass optimizer= (the optax transformation, or the nnx.Optimizer)"
)
_WORKLOAD_UNKNOWN = (
    "workload unknown: the batch has no (batch, seq) token array, so the analytic side counts the "
    "parameters only (no activations, FLOPs or step time); pass workload=costmodel.Workload(batch, seq_len)"
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
    plan: Plan,
    layout: StateLayout,
    mesh: jax.sharding.Mesh,
    inventory: tuple[Collective, ...],
    estimate: costmodel.Estimate,
    compiled_memory: dict[str, int],
    analytic_memory: dict[str, int],
    workload_known: bool = True,
) -> list[str]:
    """Where the plan, the compiler and the cost model disagree, and what the plan leaves replicated."""
    rows = layout.params
    # Block padding is asked for and shown in the parameter table; other row notes are warnings.
    out = (
        list(rows.unused_rules)
        + list(rows.advice)
        + [f"{r.path}: {r.note}" for r in rows.leaves if r.note and r.padded_shape is None]
    )
    out += [
        f"mesh axis {a!r} is used by no part of the plan: all work is replicated over it"
        for a in unused_axes(plan, mesh)
    ]
    idle = idle_axes(plan, layout, mesh)
    if idle:
        out.append(idle_axes_text(idle, mesh))
    if not workload_known:
        out.append(_WORKLOAD_UNKNOWN)
    flag = costmodel.compare(sum(c.traffic_bytes for c in inventory), sum(t.traffic_bytes for t in estimate.traffic))
    if flag and workload_known:  # without activations the analytic traffic is a floor, not an estimate
        out.append(f"collective traffic: {flag}")
    out += _memory_warnings(compiled_memory, analytic_memory)
    if mesh.size > 1:
        out += [
            f"{r.path} ({format_bytes(r.bytes)}) is fully replicated on all {r.replicas} devices; "
            f"add a rule or an fsdp part to split it"
            for r in rows.leaves
            if r.replicas == mesh.size and r.bytes >= LARGE_REPLICATED_BYTES
        ]
    return out


def _memory_warnings(compiled_memory: dict[str, int], analytic_memory: dict[str, int]) -> list[str]:
    out = []
    if "argument_bytes" in compiled_memory and "argument_bytes" in analytic_memory:
        flag = costmodel.compare(compiled_memory["argument_bytes"], analytic_memory["argument_bytes"])
        if flag:
            out.append(f"argument memory: {flag.split(':')[0]}: a buffer the plan does not lay out")
    if "temp_bytes" in compiled_memory and "temp_bytes" in analytic_memory:
        ratio = compiled_memory["temp_bytes"] / max(1, analytic_memory["temp_bytes"])
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
    return out


def memory_of(compiled: jax.stages.Compiled) -> dict[str, int]:
    """The compiled program's ``memory_analysis()`` per device, with a peak estimate. A program keeping state in
    host memory (offload) adds ``host_*`` figures, and its device figures leave them out (see
    :mod:`spmd._offload` for how the CPU backend's are read).

    >>> import jax, jax.numpy as jnp
    >>> memory_of(jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile())["argument_bytes"]
    16
    """
    stats = compiled.memory_analysis()
    if stats is None:  # some backends do not report
        return {}
    out = {ours: int(getattr(stats, theirs, 0)) for ours, theirs in _MEMORY_FIELDS.items()}
    host = {ours: int(getattr(stats, theirs, 0)) for ours, theirs in _HOST_FIELDS.items()}
    if not any(host.values()):
        # The CPU backend reports no host bytes and counts the arrays its layout places in host memory among the
        # device's arguments and outputs: read them off the layout, and keep the device's figures the device's.
        placed = host_memory(compiled.as_text())
        for key in ("argument_bytes", "output_bytes", "alias_bytes"):
            out[key] -= placed[f"host_{key}"]
            host[f"host_{key}"] = placed[f"host_{key}"]
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    if any(host.values()):
        out |= {k: v for k, v in host.items() if k != "host_alias_bytes"}
        out["host_peak_bytes"] = sum(v for k, v in host.items() if k != "host_alias_bytes") - host["host_alias_bytes"]
    return out
