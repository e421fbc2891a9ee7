"""Offload: parts of the training state kept in host memory between steps (ZeRO-Offload's optimizer state).

A plan names what it offloads (``Plan.offload``, e.g. ``("optimizer",)``). The training step then gives those
arrays shardings with ``memory_kind="pinned_host"``: they are created, stored, checkpointed and restored in host
memory; inside the step they are moved to the device for the update and the updated ones written back to host
(the step's outputs are laid out in host memory). The update itself runs on the device: the state streams in
and out once per step, which the cost model counts as host-transfer traffic, not as a collective.

What the CPU backend does not model: on CPU, host and device memory are the same RAM. JAX still types the
offloaded arrays ``pinned_host`` and the compiled program places them in host memory space (``S(5)`` in the
entry computation's layout), but the moves inside the step lower to nothing (no copy is made), and
``memory_analysis()`` reports no host bytes (its ``host_*`` fields are 0) and counts host arguments among the
device's. :func:`host_memory` therefore reads host placement from the compiled HLO's layout where the backend
does not report it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from spmd._rules import PlanError

__all__ = [
    "HOST", "OFFLOADABLE", "check_host_memory", "check_offload", "entry_layout", "host_memory", "offloaded",
    "on_device", "on_host",
]  # fmt: skip

HOST = "pinned_host"
OFFLOADABLE: dict[str, str] = {"optimizer": "optimizer state in host memory"}

# XLA's memory space of host memory in a layout, e.g. f32[8,16]{1,0:S(5)}.
_HOST_SPACE = "S(5)"


def check_offload(names: Iterable[str], api: str = "Plan(offload=)") -> tuple[str, ...]:
    """The offloaded parts, each once in the order given; an unknown name is a :class:`spmd.PlanError` naming
    the valid ones.

    >>> check_offload(["optimizer", "optimizer"])
    ('optimizer',)
    >>> check_offload(["params"])
    Traceback (most recent call last):
    ...
    spmd._rules.PlanError: Plan(offload=): cannot offload 'params'; offloadable: optimizer (e.g. offload=("optimizer",))
    """
    if isinstance(names, str):
        names = (names,)
    out: list[str] = []
    for name in names:
        if name == "activations":  # kept for the backward pass, so the layer's remat policy says where
            raise PlanError(
                f"{api}: activations are offloaded by the layers' remat policy, not the plan's offload: "
                f'dataclasses.replace(plan, remat=spmd.Remat("offload", names)) (the built-in models\' '
                f"matmul outputs: spmd._remat.MATMUL_OUTPUTS; on the command line, --offload activations)"
            )
        if name not in OFFLOADABLE:
            raise PlanError(
                f'{api}: cannot offload {name!r}; offloadable: {", ".join(OFFLOADABLE)} (e.g. offload=("optimizer",))'
            )
        if name not in out:
            out.append(name)
    return tuple(out)


def offloaded(offload: tuple[str, ...], role: str) -> bool:
    """Whether a plan offloading ``offload`` keeps the state's ``role`` ("params", "optimizer") on host.

    >>> offloaded(("optimizer",), "optimizer"), offloaded(("optimizer",), "params")
    (True, False)
    """
    return role in offload


def _with_kind(shardings: Any, kind: str) -> Any:
    return jax.tree.map(
        lambda s: s.with_memory_kind(kind), shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )


def on_host(shardings: Any) -> Any:
    """The same shardings in host memory (``pinned_host``).

    >>> import spmd
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> on_host({"m": NamedSharding(spmd.make_mesh({"data": -1}), P())})["m"].memory_kind
    'pinned_host'
    """
    return _with_kind(shardings, HOST)


def on_device(shardings: Any) -> Any:
    """The same shardings in device memory.

    >>> import spmd
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> on_device(NamedSharding(spmd.make_mesh({"data": -1}), P(), memory_kind="pinned_host")).memory_kind
    'device'
    """
    return _with_kind(shardings, "device")


def check_host_memory(mesh: jax.sharding.Mesh, offload: tuple[str, ...]) -> None:
    """Raises when ``offload`` names what cannot be offloaded, or the mesh's devices have no ``pinned_host``
    memory to offload to.

    >>> import spmd
    >>> check_host_memory(spmd.make_mesh({"data": -1}), ("optimizer",))
    """
    if not check_offload(offload):
        return
    device = mesh.devices.flat[0]
    kinds = [m.kind for m in device.addressable_memories()]
    if HOST not in kinds:
        raise PlanError(
            f"offload {', '.join(offload)}: the {device.platform} devices have no {HOST} memory (they have "
            f"{', '.join(kinds)}); train without offload on this backend"
        )


_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1}


def _array_bytes(text: str) -> int:
    """Bytes of one array type of an HLO layout, e.g. ``f32[8,16]{1,0:S(5)}``."""
    match = re.match(r"\s*(\w+)\[([\d,]*)\]", text)
    if match is None:
        return 0
    dtype, dims = match.groups()
    count = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    if dtype in _DTYPE_BYTES:
        return count * _DTYPE_BYTES[dtype]
    bits = int(re.sub(r"\D", "", dtype) or 8)
    return count * max(1, bits // 8)


def _split_top(text: str) -> list[str]:
    """The comma-separated items of a layout list, commas inside brackets and braces kept."""
    items, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    return [*items, current] if current.strip() else items


def _braced(text: str, key: str) -> str | None:
    """What stands between the braces after ``key`` (nested braces kept), or None."""
    start = text.find(key + "{")
    if start < 0:
        return None
    start += len(key) + 1
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def entry_layout(hlo: str) -> tuple[list[str], list[str]]:
    """The compiled entry computation's parameter and result types (per device), from its HLO text.

    >>> hlo = "HloModule m, entry_computation_layout={(f32[8]{0:S(5)}, /*index=1*/s32[])->(f32[8]{0:S(5)}, f32[])}"
    >>> entry_layout(hlo)
    (['f32[8]{0:S(5)}', 's32[]'], ['f32[8]{0:S(5)}', 'f32[]'])
    """
    body = _braced(hlo, "entry_computation_layout=")
    if body is None or ")->" not in body:
        return [], []
    body = re.sub(r"/\*.*?\*/", "", body)  # index comments, /*index=5*/
    params, result = body.split(")->", 1)
    params = params[1:]
    result = result[1:-1] if result.startswith("(") else result
    return [p.strip() for p in _split_top(params)], [r.strip() for r in _split_top(result)]


def host_memory(hlo: str) -> dict[str, int]:
    """Bytes per device the compiled program keeps in host memory: its parameters and results whose layout
    places them in host memory space (``S(5)``), and the host results donated into host parameters.

    >>> host_memory("HloModule m, input_output_alias={ {0}: (0, {}, may-alias) }, "
    ...             "entry_computation_layout={(f32[8]{0:S(5)}, s32[])->(f32[8]{0:S(5)}, f32[])}")
    {'host_argument_bytes': 32, 'host_output_bytes': 32, 'host_alias_bytes': 32}
    """
    params, results = entry_layout(hlo)
    host = lambda types: [_array_bytes(t) if _HOST_SPACE in t else 0 for t in types]  # noqa: E731
    on_host_params, on_host_results = host(params), host(results)
    aliased = _braced(hlo, "input_output_alias=") or ""
    alias = 0
    if aliased:
        for out, _param in re.findall(r"\{(\d*)\}:\s*\((\d+)", aliased):
            index = int(out or 0)
            alias += on_host_results[index] if index < len(on_host_results) else 0
    return {
        "host_argument_bytes": sum(on_host_params),
        "host_output_bytes": sum(on_host_results),
        "host_alias_bytes": alias,
    }
