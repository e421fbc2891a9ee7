"""Uneven tensor parallelism (HAP): the positions of a tensor axis whose devices differ in speed compute heads and
hidden units in proportion to their speeds (the plan's execution a :class:`spmd.execution.TensorShares`).

- :func:`tensor_units`: the units per position, water-filled over the work every position runs whole;
- :func:`tensor_position_flops`: one device's FLOPs per step under the even split and at each position;
- :func:`tensor_step_times`: the modelled compute of the even and of the uneven split;
- :func:`units_split_over`: the unit dimensions a plan splits over an axis (what a profile can make uneven).

>>> import jax
>>> from spmd import models
>>> from spmd.devices import Profile
>>> params = jax.eval_shape(models.get("gpt-tiny").init, jax.random.key(0))
>>> tensor_units(params, Profile.from_speeds([3, 1]), {"tensor": 2}).describe()
'uneven tensor shares over tensor: heads [3, 1], mlp [192, 64] per device'
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from spmd import Plan, PlanWarning, costmodel
from spmd import axes as A
from spmd.devices import Profile
from spmd.execution import TensorShares
from spmd.rules import leaves_with_paths
from strategies._split import position_name, proportional_split, rank_speeds

__all__ = ["tensor_position_flops", "tensor_step_times", "tensor_units", "units_split_over"]


def tensor_units(
    params: Any,
    profile: Profile,
    mesh_axes: Mapping[str, int],
    *,
    axis: str = "tensor",
    names: Sequence[str] = (),
    plan: Plan | None = None,
    workload: costmodel.Workload | None = None,
) -> TensorShares:
    """Uneven tensor shares: each unit dimension of ``names`` (default: ``heads`` and ``mlp``, those the
    parameters carry) divided over ``axis`` by each position's speed (its slowest device's), as an exact integer
    split. Given the tensor-parallel ``plan`` and a ``workload``, the split also counts the work every device of
    the axis does whatever its units (what the plan does not split over it: embeddings, the head, norms), priced
    by the cost model: position ``j`` takes the share ``x_j`` of the units that makes ``(R + x_j·U) / s_j`` the
    same everywhere (``R`` that fixed work, ``U`` all units' work), so a slow position takes fewer units than its
    speed's share, but at least one; without them, units in proportion to speed. A position whose speed's share
    is no unit is refused, naming its devices.

    >>> import jax
    >>> from spmd import models
    >>> params = jax.eval_shape(models.get("gpt-tiny").init, jax.random.key(0))
    >>> tensor_units(params, Profile.from_speeds([2, 1]), {"tensor": 2}).describe()
    'uneven tensor shares over tensor: heads [3, 1], mlp [171, 85] per device'
    """
    profile.check(math.prod(mesh_axes.values()))
    if mesh_axes.get(axis, 1) < 2:
        raise ValueError(f"uneven tensor shares need a {axis!r} axis of two or more devices; the mesh is {mesh_axes}")
    sizes = _unit_sizes(params, names or (A.HEADS, A.MLP))
    speeds = rank_speeds(profile, mesh_axes, axis)
    weights: Sequence[float] = speeds
    if plan is not None and workload is not None:
        # Per device: E = R + U/T with every position's even units, R + 2U/T with twice as many.
        rows = _even_rows(plan, params, mesh_axes)
        even = _unit_flops(plan, rows, mesh_axes, workload, sizes)
        double = _unit_flops(plan, rows, mesh_axes, workload, {n: 2 * k for n, k in sizes.items()})
        ways = len(speeds)
        units_work, fixed = ways * (double - even), 2 * even - double
        step = (units_work + ways * fixed) / sum(speeds)  # the time every position then takes, at unit speed
        weights = [max(step * x - fixed, 0.0) for x in speeds]
    units = []
    for name, size in sizes.items():
        counts = proportional_split(size, speeds)
        if weights is not speeds and 0 not in counts:
            # The fixed work may leave a slow position less than a unit: it keeps one, from the largest.
            counts = list(proportional_split(size, weights))
            for i in [i for i, c in enumerate(counts) if c == 0]:
                counts[i], counts[int(np.argmax(counts))] = 1, max(counts) - 1
            counts = tuple(counts)
        if 0 in counts:
            i = counts.index(0)
            raise ValueError(
                f"{position_name(mesh_axes, axis, i)} gets none of the model's {size} {name} units (split "
                f"{list(counts)} by speeds {list(speeds)}); leave the device out of the tensor axis, or split the "
                f"batch instead (a data axis of one kind per rank)"
            )
        units.append((name, counts))
    return TensorShares(axis, tuple(units))


def tensor_position_flops(
    plan: Plan, params: Any, mesh_axes: Mapping[str, int], workload: costmodel.Workload
) -> tuple[float, tuple[float, ...]]:
    """A plan with uneven tensor shares: one device's FLOPs per step under the even split, and at each position
    of the tensor axis with its own units: the cost model's count over the even layout whose unit dimensions
    are that position's units times the axis's ways, so each device of the axis holds that position's units.
    The layout is resolved once, at the model's own widths, and only its shapes change: a width that exists
    for no real model is never resolved (the rules might split it otherwise).

    >>> import jax
    >>> import strategies
    >>> from spmd import models
    >>> params = jax.eval_shape(models.get("gpt-tiny").init, jax.random.key(0))
    >>> plan = strategies.tensor_parallel(axis="tensor")
    >>> plan += Plan(execution=tensor_units(params, Profile.from_speeds([3, 1]), {"tensor": 2}))
    >>> even, (fast, slow) = tensor_position_flops(plan, params, {"tensor": 2}, costmodel.Workload(4, 32))
    >>> slow < even < fast
    True
    """
    spec = plan.execution
    ways = len(spec.of(spec.names[0]))
    rows = _even_rows(plan, params, mesh_axes)
    even = _unit_flops(plan, rows, mesh_axes, workload, {n: sum(spec.of(n)) for n in spec.names})
    at = tuple(
        _unit_flops(plan, rows, mesh_axes, workload, {n: ways * spec.of(n)[j] for n in spec.names}) for j in range(ways)
    )
    return even, at


def tensor_step_times(
    spec: TensorShares,
    profile: Profile,
    mesh_axes: Mapping[str, int],
    tensor_flops: tuple[float, Sequence[float]],
    rate: float,
) -> dict[str, float]:
    """The modelled compute of the even and of the uneven split, each position's FLOPs (``tensor_flops``, from
    :func:`tensor_position_flops`) at its speed relative to the fastest device's ``rate`` (FLOP/s); the speedup
    and the ideal Σs / (N · min s) over the axis (``hetero.summary`` adds each split's communication).

    >>> spec = TensorShares("tensor", (("mlp", (3, 1)),))
    >>> t = tensor_step_times(spec, Profile.from_speeds([3, 1]), {"tensor": 2}, (2.0, (3.0, 1.0)), 1.0)
    >>> t["even"], t["hetero"], t["speedup"], t["ideal"]
    (6.0, 3.0, 2.0, 2.0)
    """
    even_flops, at = tensor_flops
    relative = [x / max(profile.speeds) for x in rank_speeds(profile, mesh_axes, spec.axis)]
    t_even = max(even_flops / rate / r for r in relative)
    t = max(f / rate / r for f, r in zip(at, relative, strict=True))
    return {"even": t_even, "hetero": t, "speedup": t_even / t, "ideal": sum(relative) / (len(at) * min(relative))}


def units_split_over(plan: Plan, params: Any, mesh_axes: Mapping[str, int], axis: str) -> tuple[str, ...]:
    """The unit dimensions (``heads``, ``mlp``) that ``plan`` splits over ``axis`` (tensor parallelism's).

    >>> import jax
    >>> import strategies
    >>> from spmd import models
    >>> params = jax.eval_shape(models.get("gpt-tiny").init, jax.random.key(0))
    >>> units_split_over(strategies.tensor_parallel(axis="tensor"), params, {"tensor": 2}, "tensor")
    ('heads', 'mlp')
    """
    if mesh_axes.get(axis, 1) < 2:
        return ()
    rows = _even_rows(plan, params, mesh_axes, keep_execution=True)
    split = {n for r in rows for n, e in zip(r.names or (), r.spec, strict=False) if e == axis}
    return tuple(n for n in (A.HEADS, A.MLP) if n in split)


def _unit_sizes(params: Any, names: Sequence[str]) -> dict[str, int]:
    """The size of each of ``names`` in the parameters' logical dimensions (those they carry)."""
    sizes: dict[str, int] = {}
    for leaf in leaves_with_paths(params)[0]:
        for name in names:
            if leaf.names and name in leaf.names:
                sizes.setdefault(name, leaf.shape[leaf.names.index(name)])
    if not sizes:
        raise ValueError(f"uneven tensor shares: no parameter carries the logical dimensions {list(names)}")
    return {n: sizes[n] for n in names if n in sizes}


def _even_rows(plan: Plan, params: Any, mesh_axes: Mapping[str, int], *, keep_execution: bool = False) -> list[Any]:
    """The parameters' layout under ``plan`` (without its execution, unless kept), its warnings left to the
    step, which resolves the layout again and warns there."""
    plan = plan if keep_execution else dataclasses.replace(plan, execution=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanWarning)
        return list(plan.resolve(params, mesh_axes).leaves)


def _unit_flops(
    plan: Plan,
    rows: Sequence[Any],
    mesh_axes: Mapping[str, int],
    workload: costmodel.Workload,
    units: Mapping[str, int],
) -> float:
    """One device's FLOPs per step under ``plan`` (evenly split) when each logical dimension of ``units`` has
    that size in the layout ``rows`` (its partition kept)."""

    def widened(row: Any) -> Any:
        if not row.names or not any(n in units for n in row.names):
            return row
        shape = tuple(units.get(n, d) if isinstance(n, str) else d for n, d in zip(row.names, row.shape, strict=True))
        return dataclasses.replace(row, shape=shape)

    return costmodel.flops_per_device([widened(r) for r in rows], plan, mesh_axes, workload)
