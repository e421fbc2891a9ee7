"""Logical device meshes: named axes with sizes, laid out on the devices by JAX's mesh utilities."""

from __future__ import annotations

import keyword
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Emulated CPU devices are threads of one process: past this many, building a program for them takes minutes
# (the spmd command refuses more with --devices), so no emulation is suggested for a larger mesh.
MAX_EMULATED_DEVICES = 1024


def _axis_problem(name: object, size: object) -> str | None:
    """What is wrong with one axis (a name that is not an identifier, a size that is not a positive integer or
    -1), or None. Python's keywords are refused too: an axis named ``None`` reads as "not split" in a spec."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or keyword.iskeyword(name):
        return f"axis name {name!r} must be an identifier (letters, digits, _) that is not a Python keyword"
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
        return f"axis {name!r} has size {size!r}; sizes are positive integers (one axis may be -1 to infer it)"
    return None


def _check_axes(axes: Mapping[str, int], what: str) -> None:
    example = "e.g. {'data': 2, 'tensor': 4}"
    if not isinstance(axes, Mapping) or not axes:
        raise ValueError(f"spmd.make_mesh: {what} {axes!r} must map axis names to sizes, {example}")
    for name, size in axes.items():
        problem = _axis_problem(name, size)
        if problem:
            raise ValueError(f"spmd.make_mesh: {what} {dict(axes)!r}: {problem}; {example}")
    if sum(1 for size in axes.values() if size == -1) > 1:
        raise ValueError(
            f"spmd.make_mesh: {what} {dict(axes)!r} has more than one axis of size -1; at most one can be inferred"
        )


def resolve_sizes(axes: Mapping[str, int], n_devices: int, *, platform: str = "cpu") -> dict[str, int]:
    """Fills in the one axis of size -1 so the sizes multiply to ``n_devices``; checks the product otherwise (the
    error says how to get more devices of ``platform``).

    >>> resolve_sizes({"data": -1, "tensor": 2}, 8)
    {'data': 4, 'tensor': 2}
    """
    _check_axes(axes, "mesh")
    shown = ",".join(f"{k}={v}" for k, v in axes.items())
    inferred = [k for k, v in axes.items() if v == -1]
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
            f"multiply to {n_devices} (or use -1 for one axis){_more_devices(known, platform)}"
        )
    return sizes


def _more_devices(needed: int, platform: str) -> str:
    """How to get ``needed`` devices where that can be done: a multi-process job gets its devices from its
    launcher (a process's own --devices is refused there); a single process can emulate CPU devices, up to what
    the spmd command emulates."""
    if jax.process_count() > 1:
        return (
            f", or start the job with {needed} devices in all (under spmd launch: --processes × "
            f"--devices-per-process = {needed})"
        )
    if needed > MAX_EMULATED_DEVICES:
        return ""
    if platform != "cpu":  # emulation replaces the accelerators by CPU devices: for planning, not for speed
        return f", or plan it on {needed} emulated CPU devices (--devices {needed} with the spmd command)"
    return (
        f", or emulate {needed} CPU devices: spmd.emulate_devices({needed}) before JAX starts, or --devices {needed} "
        f"with the spmd command"
    )


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
    sizes = resolve_sizes(axes, len(devices), platform=devices[0].platform if devices else "cpu")
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
    """Parses ``"data=2,fsdp=2,tensor=2"`` (the CLI's ``--mesh``) into ordered axis sizes: names are identifiers
    (not Python keywords), each once; sizes positive integers, or -1 for at most one axis.

    >>> parse_mesh("data=2,tensor=-1")
    {'data': 2, 'tensor': -1}
    >>> parse_mesh("data=1,None=2")
    Traceback (most recent call last):
    ...
    ValueError: mesh 'data=1,None=2': axis name 'None' must be an identifier ... e.g. data=2,tensor=4
    """
    example = "write axis=size pairs, e.g. data=2,tensor=4"
    if not isinstance(text, str):
        raise ValueError(f"mesh {text!r}: expected text like 'data=2,tensor=4'")
    axes: dict[str, int] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([^=\s]*)\s*=\s*(-?\d{1,9})\s*", part)
        if not m:
            raise ValueError(f"mesh {text!r}: cannot read {part!r}; {example}")
        name, size = m.group(1), int(m.group(2))
        problem = _axis_problem(name, size)
        if problem:
            raise ValueError(f"mesh {text!r}: {problem}; {example}")
        if name in axes:
            raise ValueError(f"mesh {text!r}: axis {name!r} appears twice; give each axis once, e.g. data=2,tensor=4")
        axes[name] = size
    if sum(1 for size in axes.values() if size == -1) > 1:
        raise ValueError(
            f"mesh {text!r}: more than one axis of size -1; at most one can be inferred, e.g. data=-1,tensor=4"
        )
    return axes


def auto_twin(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis Auto (``mesh`` itself when they already are): the mesh a plan's program is traced
    over. A plan lays out the parameters, the batch and a few activations and leaves the rest to the compiler's
    propagation, which is what Auto axes mean; on a mesh with Explicit axes (``jax.make_mesh``'s default) the
    step's inputs and outputs keep their Explicit types, and only its inside is Auto (see :func:`traced_auto`).

    >>> import spmd
    >>> mesh = spmd.make_mesh({"data": -1}, explicit=True)
    >>> twin = auto_twin(mesh)
    >>> twin.axis_types, auto_twin(twin) is twin, bool((twin.devices == mesh.devices).all())
    ((Auto,), True, True)

    A mesh mixing Explicit and Auto axes is refused: a plan's layout would be half a type and half a hint
    (flax's eager sharding refuses such meshes too).
    """
    kinds = set(mesh.axis_types)
    if kinds <= {AxisType.Auto}:
        return mesh
    if kinds != {AxisType.Explicit}:
        shown = ", ".join(f"{name}: {kind.name}" for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True))
        raise ValueError(
            f"mesh axes of types {shown}; a plan needs every axis Explicit (jax.make_mesh's default, "
            f"spmd.make_mesh(..., explicit=True)) or every axis Auto"
        )
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def traced_auto(fn: Callable[..., Any], mesh: Mesh, out_specs: Any) -> Callable[..., Any]:
    """``fn`` traced with every axis of ``mesh`` Auto, its outputs typed ``out_specs`` on ``mesh``: the body of a
    jitted step whose arrays live on a mesh with Explicit axes. Inside, constraints name :func:`auto_twin`'s
    mesh. ``fn`` itself on a mesh whose axes are all Auto.

    >>> import spmd, jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = spmd.make_mesh({"data": -1}, explicit=True)
    >>> x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    >>> y = jax.jit(traced_auto(lambda x: x @ x.T, mesh, P("data")))(x)
    >>> y.sharding.spec, y.sharding.mesh.axis_types
    (P('data', None), (Explicit,))
    """
    if auto_twin(mesh) is mesh:
        return fn

    def traced(*args: Any) -> Any:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.sharding.auto_axes(fn, out_sharding=out_specs)(*args)

    return traced


def retyped(tree: Any, mesh: Mesh) -> Any:
    """The arrays (or ShapeDtypeStructs, or NamedShardings) of ``tree`` on ``mesh``, a mesh of the same devices
    and axes with other axis types: the same shards, relabelled (no data moves), typed by ``mesh``. For the few
    conversions spmd makes outside a step (a pipeline's stages unstacked for a checkpoint), which run eagerly
    over :func:`auto_twin`; inside ``jit`` (tracers) use :func:`traced_auto`.

    >>> import spmd, jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = spmd.make_mesh({"data": -1}, explicit=True)
    >>> x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    >>> y = retyped(x, auto_twin(mesh))
    >>> y.sharding.spec, y.sharding.mesh.axis_types
    (P('data',), (Auto,))
    """

    def relabelled(sharding: NamedSharding) -> NamedSharding:
        if sharding.mesh == mesh:
            return sharding
        other = sharding.mesh
        if other.axis_names != mesh.axis_names or other.devices.shape != mesh.devices.shape:
            raise ValueError(f"retyped: {other} and {mesh} have other axes; only the axis types may differ")
        if (other.devices != mesh.devices).any():
            raise ValueError(f"retyped: {other} and {mesh} hold other devices; only the axis types may differ")
        return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)  # offloaded state stays on host

    def one(x: Any) -> Any:
        if isinstance(x, NamedSharding):
            return relabelled(x)
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh == mesh:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return x.update(sharding=relabelled(sharding))
        shards = [shard.data for shard in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, relabelled(sharding), shards)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, NamedSharding))
