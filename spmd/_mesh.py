"""Logical device meshes: named axes with sizes, laid out on the devices by JAX's mesh utilities."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh


def _check_axes(axes: Mapping[str, int], what: str) -> None:
    if not axes:
        raise ValueError(f"spmd.make_mesh: {what} is empty; give at least one axis, e.g. {{'data': 8}}")
    for name, size in axes.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"spmd.make_mesh: axis name {name!r} in {what} must be an identifier like 'data'")
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ValueError(
                f"spmd.make_mesh: axis {name!r} has size {size!r} in {what}; sizes are positive integers "
                f"(one axis may be -1 to take the remaining devices)"
            )


def resolve_sizes(axes: Mapping[str, int], n_devices: int) -> dict[str, int]:
    """Fills in the one axis of size -1 so the sizes multiply to ``n_devices``; checks the product otherwise.

    >>> resolve_sizes({"data": -1, "tensor": 2}, 8)
    {'data': 4, 'tensor': 2}
    """
    _check_axes(axes, "the mesh axes")
    shown = ",".join(f"{k}={v}" for k, v in axes.items())
    inferred = [k for k, v in axes.items() if v == -1]
    if len(inferred) > 1:
        raise ValueError(f"spmd.make_mesh: mesh {shown} has more than one axis of size -1; at most one can be inferred")
    known = math.prod(v for v in axes.values() if v != -1)
    sizes = dict(axes)
    if inferred:
        if n_devices % known:
            raise ValueError(
                f"spmd.make_mesh: cannot infer {inferred[0]!r} in mesh {shown}: {n_devices} devices are not "
                f"divisible by {known}; choose sizes whose product divides {n_devices}"
            )
        sizes[inferred[0]] = n_devices // known
    elif known != n_devices:
        raise ValueError(
            f"spmd.make_mesh: mesh {shown} needs {known} devices but {n_devices} are present; make the sizes "
            f"multiply to {n_devices} (or use -1 for one axis), or run with --devices {known} on CPU"
        )
    return sizes


def make_mesh(
    axes: Mapping[str, int],
    /,
    *,
    dcn: Mapping[str, int] | None = None,
    devices: Sequence[jax.Device] | None = None,
    explicit: bool = False,
) -> Mesh:
    """Builds a ``jax.sharding.Mesh`` from logical axis names and sizes.

    Device order comes from JAX's mesh utilities, so neighbouring mesh coordinates are close in the physical
    topology on TPU/GPU. With ``dcn={"data": 2}`` the ``data`` axis is split across slices/processes (the slow
    DCN links) and the rest stays inside each one (ICI): sizes in ``axes`` are the totals. Axis types are Auto
    (the compiler propagates shardings) unless ``explicit=True``.

    >>> import spmd
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> mesh.axis_names, mesh.devices.size == len(jax.devices())
    (('data',), True)
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_sizes(axes, len(devices))
    names = tuple(sizes)
    shape = tuple(sizes.values())
    if dcn:
        _check_axes(dcn, "dcn")
        unknown = sorted(set(dcn) - set(sizes))
        if unknown:
            raise ValueError(f"spmd.make_mesh: dcn axes {unknown} are not mesh axes {list(names)}")
        for name, parts in dcn.items():
            if parts < 1 or sizes[name] % parts:
                raise ValueError(
                    f"spmd.make_mesh: dcn size {parts} for axis {name!r} does not divide its total size "
                    f"{sizes[name]}; the total is dcn × ici, so choose a divisor"
                )
        dcn_shape = tuple(dcn.get(n, 1) for n in names)
        ici_shape = tuple(s // d for s, d in zip(shape, dcn_shape, strict=True))
        # Slices on multi-slice TPU; elsewhere (one slice, or none) each process is one granule of fast-connected
        # devices.
        by_process = len({getattr(d, "slice_index", None) for d in devices} - {None}) <= 1
        grid = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices, process_is_granule=by_process)
    elif len(devices) == 1:
        grid = np.array(devices).reshape(shape)
    else:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(grid, names, axis_types=(kind,) * len(names))


def parse_mesh(text: str) -> dict[str, int]:
    """Parses ``"data=2,fsdp=2,tensor=2"`` (the CLI's ``--mesh``) into ordered axis sizes.

    >>> parse_mesh("data=2,tensor=-1")
    {'data': 2, 'tensor': -1}
    """
    axes: dict[str, int] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(-?\d+)\s*", part)
        if not m:
            raise ValueError(f"--mesh {text!r}: cannot read {part!r}; write axis=size pairs like data=2,tensor=4")
        name, size = m.group(1), int(m.group(2))
        if name in axes:
            raise ValueError(f"--mesh {text!r}: axis {name!r} appears twice; give each axis once")
        if size < 1 and size != -1:
            raise ValueError(f"--mesh {text!r}: axis {name!r} has size {size}; sizes are positive (or -1 to infer)")
        axes[name] = size
    return axes
