"""The analytic cost model: what a plan's layouts imply, per device, before anything is compiled.

Pure functions of the training state's layout (abstract shapes and dtypes, the plan's specs) and the mesh sizes.
Collective traffic uses ring formulas per device: all-reduce 2(N−1)/N·S, all-gather and reduce-scatter
(N−1)/N·S of the full buffer S. Covered: the data-parallel family (DP, ZeRO-1/2/3, FSDP, HSDP) — gradient
reductions, FSDP's parameter gathers (twice with layer rematerialisation: forward and backward) and ZeRO-1/2's
all-gather of updated parameter shards. Activation collectives of tensor parallelism are not modelled yet.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from spmd._plan import LeafLayout, Plan, ShardLargest

# A compiled figure more than this far from the analytic one is flagged in the report.
TOLERANCE = 0.10


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Analytic traffic of one kind of collective over one group of mesh axes, per step and per device."""

    kind: str
    axes: tuple[str, ...]
    bytes: float  # full buffers, summed
    traffic_bytes: float  # ring traffic per device

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "axes": list(self.axes),
            "bytes": int(self.bytes),
            "traffic_bytes": int(self.traffic_bytes),
        }


def model_state_bytes(layout: Any) -> dict[str, int]:
    """Per-device bytes of parameters, gradients and optimizer state, from a :class:`spmd.StateLayout`."""
    params = sum(r.bytes_per_device for r in layout.params.leaves)
    grads = sum(r.bytes_per_device for r in layout.grads.leaves)
    optimizer = sum(r.bytes_per_device for r in layout.opt_state.leaves)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def _axes(row: LeafLayout) -> set[str]:
    return {a for e in row.spec if e for a in ((e,) if isinstance(e, str) else e)}


def data_parallel_traffic(layout: Any, plan: Plan, mesh_shape: Mapping[str, int]) -> list[Traffic]:
    """Collective traffic per step of the gradient reductions and parameter gathers the layouts imply.

    For each parameter, with ``local`` its bytes per device:
    - batch axes that split the parameter (FSDP, set F of size nF): all-gather the full-over-F buffer before use
      ((nF−1)·local, once, or twice with ``plan.remat`` — embedding tables, named ``.../embedding``, once), and
      reduce-scatter its gradient ((nF−1)·local);
    - batch axes over which the gradient is split but the parameter not (ZeRO-2, set E): reduce-scatter the
      gradient over E, then all-gather the updated shards ((nE−1)/nE · full each);
    - batch axes over which only the optimizer state is split (ZeRO-1, set E): all-reduce the gradient, then
      all-gather the updated shards;
    - remaining batch axes (set R): all-reduce the gradient, 2(nR−1)/nR of its buffer.

    >>> import spmd, strategies, optax, jax, jax.numpy as jnp
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> step = spmd.train_step(lambda p, b: 0.0, optax.sgd(0.1), strategies.data_parallel(), mesh)
    >>> layout = step.prepare({"w": jax.ShapeDtypeStruct((256,), jnp.float32)})
    >>> [t.kind for t in data_parallel_traffic(layout, step.plan, mesh.shape)] == ["all-reduce"] * (mesh.size > 1)
    True
    """
    sizes = dict(mesh_shape)
    batch = set(plan.batch_axes)
    # Only splits made by an FSDP part are gathered before use; a dimension split by a rule (e.g. experts over
    # the expert axis) is computed where it lives.
    gathered_by = {part.source for part in plan.parts if isinstance(part, ShardLargest)}
    totals: dict[tuple[str, tuple[str, ...]], list[float]] = {}

    def add(kind: str, axes: set[str], buffer: float) -> None:
        n = math.prod(sizes[a] for a in axes)
        if n <= 1:
            return
        factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
        key = (kind, tuple(a for a in sizes if a in axes))
        acc = totals.setdefault(key, [0.0, 0.0])
        acc[0] += buffer
        acc[1] += factor * buffer

    for p, g, m in zip(layout.params.leaves, layout.grads.leaves, layout.moments.leaves, strict=True):
        local = p.bytes_per_device
        p_axes, g_axes = _axes(p), _axes(g)
        fsdp = {
            a
            for e, src in zip(p.spec, p.sources, strict=True)
            if e and src in gathered_by
            for a in ((e,) if isinstance(e, str) else e)
        } & batch
        n_fsdp = math.prod(sizes[a] for a in fsdp)
        zero2 = (g_axes - p_axes) & batch
        zero1 = ((_axes(m) - p_axes) & batch) - zero2
        rest = batch - p_axes - zero2
        if fsdp:
            # Rematerialised layers use their weights again in the backward pass, so FSDP gathers them twice; an
            # embedding table is gathered once, since the gradient of a lookup does not need the table.
            for _ in range(2 if plan.remat and not p.path.endswith("embedding") else 1):
                add("all-gather", fsdp, local * n_fsdp)
        # The gradient arrives in the gathered (full-over-F) shape and is reduce-scattered over F and E together.
        grad_buffer = local * n_fsdp
        if fsdp or zero2:
            add("reduce-scatter", fsdp | zero2, grad_buffer)
        n_zero2 = math.prod(sizes[a] for a in zero2)
        add("all-reduce", rest, grad_buffer / (n_fsdp * n_zero2))
        if zero2:
            add("all-gather", zero2, local)
        if zero1:
            add("all-gather", zero1, local)
    return [Traffic(kind, axes, b, t) for (kind, axes), (b, t) in sorted(totals.items(), key=lambda kv: -kv[1][1])]


def compare(compiled: float, analytic: float) -> str | None:
    """A flag when compiled and analytic figures differ by more than :data:`TOLERANCE`, else None."""
    if analytic == 0:
        return None if compiled == 0 else "the compiler communicates where the model expects nothing"
    ratio = compiled / analytic
    if abs(ratio - 1) <= TOLERANCE:
        return None
    if ratio < 1:
        return (
            f"compiled is {ratio:.2f}× the analytic figure: the compiler found something cheaper (e.g. gathering "
            f"activations instead of weights when the batch is small, or keeping a gathered weight alive)"
        )
    return (
        f"compiled is {ratio:.2f}× the analytic figure: an unexpected collective usually means an intermediate "
        f"left replicated (add a constraint) or activation traffic the model does not cover (tensor parallelism)"
    )
