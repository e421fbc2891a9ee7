"""Device profiles: what each device of a mesh can do, so plans can give devices of different speeds uneven
shares (heterogeneous meshes).

A profile lists, in mesh device order (``mesh.devices.flat``), each device's kind, relative throughput, memory
capacity and link bandwidth per mesh axis. It comes from a JSON file (``--device-profile``), from flags
(``--device-speeds 3,3,1,1``, ``--device-memory 16GiB``), or from measuring the devices present
(:func:`measure`, ``spmd profile``). On emulated CPU devices the profile is declared, so heterogeneous plans are
testable anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Device", "Profile", "measure", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_bytes(text: str, flag: str) -> int:
    """A size like ``16GiB``, ``512MB`` or ``1048576``.

    >>> parse_bytes("16GiB", "--memory-per-device"), parse_bytes("1.5MB", "--memory-per-device")
    (17179869184, 1500000)
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{flag} {text!r}: give a positive size like 16GiB, 512MiB or 4GB")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclasses.dataclass(frozen=True)
class Device:
    """One device: ``speed`` is its throughput relative to the others (e.g. its FLOP/s); ``memory`` in bytes
    (None: not limiting); ``bandwidth`` per mesh axis in bytes/s (missing axes: the hardware's defaults).

    >>> fast = Device(kind="h100", speed=3, memory=parse_bytes("80GiB", "memory"), bandwidth=(("data", 4.5e11),))
    >>> Profile((fast, Device(kind="a100"))).ideal_speedup()  # (3 + 1) / (2 · 1)
    2.0
    """

    kind: str = "device"
    speed: float = 1.0
    memory: int | None = None
    bandwidth: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.speed, (int, float)) and math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"device profile: speed must be a positive number, got {self.speed!r}")
        if self.memory is not None and self.memory <= 0:
            raise ValueError(f"device profile: memory must be a positive number of bytes, got {self.memory!r}")


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per device, in mesh device order, what it can do.

    >>> p = Profile.from_speeds([3, 3, 1, 1])
    >>> p.speeds, p.ideal_speedup()
    ((3.0, 3.0, 1.0, 1.0), 2.0)
    """

    devices: tuple[Device, ...]

    @property
    def speeds(self) -> tuple[float, ...]:
        return tuple(float(d.speed) for d in self.devices)

    @property
    def memory(self) -> tuple[int | None, ...]:
        return tuple(d.memory for d in self.devices)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(d.kind for d in self.devices)

    def ideal_speedup(self) -> float:
        """What a throughput-proportional split gains over an even one when compute bounds the step:
        Σ s / (N · min s)."""
        return sum(self.speeds) / (len(self.devices) * min(self.speeds))

    def link_bandwidth(self, axes: Sequence[str]) -> dict[str, float]:
        """Per mesh axis, the bandwidth its collectives run at: a ring moves at the pace of its slowest link, so
        the least any device declares for the axis (or for ``"all"``, which ``spmd profile`` measures). Axes
        no device declares are left to the hardware's defaults.

        >>> slow = Device(bandwidth=(("data", 1e10),))
        >>> Profile((Device(bandwidth=(("all", 4e10),)), slow)).link_bandwidth(["data", "tensor"])
        {'data': 10000000000.0, 'tensor': 40000000000.0}
        """
        out = {}
        for axis in axes:
            declared = [dict(d.bandwidth).get(axis, dict(d.bandwidth).get("all")) for d in self.devices]
            known = [b for b in declared if b is not None and math.isfinite(b)]
            if known:
                out[axis] = min(known)
        return out

    def check(self, devices: int) -> Profile:
        if len(self.devices) != devices:
            raise ValueError(
                f"device profile: {len(self.devices)} devices given but the mesh has {devices}; give one entry per "
                f"device, in mesh order"
            )
        return self

    def reordered(self, order: Sequence[int]) -> Profile:
        return Profile(tuple(self.devices[i] for i in order))

    # -- sources ------------------------------------------------------------------------------------------
    @classmethod
    def from_speeds(
        cls, speeds: Sequence[float], memory: Sequence[int | None] | None = None, kinds: Sequence[str] | None = None
    ) -> Profile:
        """From per-device speeds (and optionally memory in bytes and kinds), e.g. ``--device-speeds``."""
        n = len(speeds)
        memory = [None] * n if memory is None else list(memory)
        kinds = [None] * n if kinds is None else list(kinds)
        if len(memory) == 1:
            memory = memory * n
        if len(memory) != n or len(kinds) != n:
            raise ValueError(
                f"device profile: {n} speeds but {len(memory)} memory sizes and {len(kinds)} kinds; give one of "
                f"each per device (or one memory size for all)"
            )
        # Without kinds, devices of one speed are taken to be of one kind.
        return cls(
            tuple(
                Device(kind=k or f"speed-{s:g}", speed=float(s), memory=mem)
                for s, mem, k in zip(speeds, memory, kinds, strict=True)
            )
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "device profile") -> Profile:
        """``{"devices": [{"kind": "h100", "speed": 3, "memory": 85899345920, "bandwidth": {"data": 4.5e11}}]}``
        (memory may also be a string like ``"80GiB"``). A field of the wrong type or value raises ValueError
        naming ``source``, the device and the field.

        >>> Profile.from_dict({"devices": [{"speed": 2}, {"kind": "slow", "speed": 1}]}).speeds
        (2.0, 1.0)
        >>> Profile.from_dict({"devices": [{"speed": "fast"}]})
        Traceback (most recent call last):
        ...
        ValueError: device profile: device 0: speed must be a positive number (relative throughput), got 'fast'
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("devices"), list) or not data["devices"]:
            got = f"{type(data).__name__} {_short(data)}"
            raise ValueError(f'{source}: expected {{"devices": [{{"kind": ..., "speed": ...}}, ...]}}, got {got}')
        extra = sorted(str(k) for k in data if k != "devices")
        if extra:
            raise ValueError(f"{source}: unknown field {extra[0]!r}; a profile holds only devices")
        return cls(tuple(_device(entry, f"{source}: device {i}", i) for i, entry in enumerate(data["devices"])))

    @classmethod
    def load(cls, path: str) -> Profile:
        """A profile from a JSON file (:meth:`to_dict`'s form, as ``spmd profile --out`` writes); a file that
        cannot be read or holds no profile raises ValueError naming the file and the field."""
        where = f"--device-profile {path!r}"
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except FileNotFoundError:
            raise ValueError(f"{where}: no such file") from None
        except OSError as e:  # a directory, no permission
            raise ValueError(f"{where}: cannot read it ({e.strerror}); give a readable JSON file") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text (byte offset {e.start}); save it as UTF-8 JSON") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None
        return cls.from_dict(data, source=where)

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": [
                {"kind": d.kind, "speed": d.speed, "memory": d.memory, "bandwidth": dict(d.bandwidth)}
                for d in self.devices
            ]
        }


_FIELDS = ("kind", "speed", "memory", "bandwidth")


def _device(entry: Any, where: str, index: int) -> Device:
    """One device of a profile file, each field checked for its type: a string where a number goes, or a
    misspelt field, is an error rather than a guess."""
    if not isinstance(entry, Mapping):
        raise ValueError(f'{where}: expected an object like {{"kind": "h100", "speed": 3}}, got {_short(entry)}')
    unknown = sorted(str(k) for k in entry if k not in _FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(_FIELDS)}")
    if "speed" not in entry:
        raise ValueError(f"{where}: missing field 'speed' (its throughput relative to the others, e.g. 3)")
    speed = entry["speed"]
    if not _number(speed) or not speed > 0:
        raise ValueError(f"{where}: speed must be a positive number (relative throughput), got {_short(speed)}")
    kind = entry.get("kind", f"device-{index}")
    if not isinstance(kind, str):
        raise ValueError(f"{where}: kind must be a string like 'h100', got {_short(kind)}")
    memory = entry.get("memory")
    if isinstance(memory, str):
        memory = parse_bytes(memory, f"{where}: memory")
    elif memory is not None:
        if not _number(memory) or not memory >= 1:
            raise ValueError(f"{where}: memory must be a size like '80GiB' or a number of bytes, got {_short(memory)}")
        memory = int(memory)
    bandwidth = entry.get("bandwidth")
    bandwidth = {} if bandwidth is None else bandwidth
    if not isinstance(bandwidth, Mapping):
        raise ValueError(f'{where}: bandwidth must map mesh axes to bytes/s, e.g. {{"data": 4.5e11}}')
    for axis, value in bandwidth.items():
        # inf is allowed: a single device's measured all-reduce bandwidth is infinite (nothing to move)
        if not _number(value, infinite=True) or not value > 0:
            raise ValueError(
                f"{where}: bandwidth of axis {axis!r} must be a positive number of bytes/s, got {_short(value)}"
            )
    return Device(kind, float(speed), memory, tuple(sorted((str(k), float(v)) for k, v in bandwidth.items())))


def _number(value: Any, *, infinite: bool = False) -> bool:
    """A JSON number that is a float: not a string, a boolean or NaN; infinity only if ``infinite``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        as_float = float(value)  # an integer of hundreds of digits overflows
    except OverflowError:
        return False
    return not math.isnan(as_float) and (infinite or math.isfinite(as_float))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def measure(devices: Sequence[Any] | None = None, *, size: int = 1024, repeats: int = 5) -> Profile:
    """A profile of the devices present: each device's speed is the TFLOP/s of a ``size × size`` float32 matmul
    on it (median of ``repeats``), its memory what the runtime reports, and its bandwidth the ring bandwidth of
    an all-reduce over all the devices, recorded under the axis name ``"all"``.

    >>> import jax
    >>> p = measure(jax.devices("cpu")[:2], size=64, repeats=1)  # tiny: a smoke run, not a benchmark
    >>> len(p.devices), all(s > 0 for s in p.speeds), [name for name, _ in p.devices[0].bandwidth]
    (2, True, ['all'])
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    devices = list(devices or jax.devices())
    out = []
    for device in devices:
        x = jax.device_put(jnp.ones((size, size), jnp.float32), device)
        matmul = jax.jit(lambda a: a @ a)
        matmul(x).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            matmul(x).block_until_ready()
            times.append(time.perf_counter() - start)
        flops = 2 * size**3 / float(np.median(times))
        memory = (device.memory_stats() or {}).get("bytes_limit") if hasattr(device, "memory_stats") else None
        out.append((device.device_kind, flops / 1e12, memory))
    bandwidth = _all_reduce_bandwidth(devices, repeats=repeats)
    return Profile(
        tuple(
            Device(kind=str(kind), speed=max(speed, 1e-9), memory=memory, bandwidth=(("all", bandwidth),))
            for kind, speed, memory in out
        )
    )


def _all_reduce_bandwidth(devices: Sequence[Any], *, repeats: int, nbytes: int = 1 << 22) -> float:
    """Ring bus bandwidth of an all-reduce over ``devices``: 2(N−1)/N · bytes / time."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    n = len(devices)
    if n < 2:
        return float("inf")
    mesh = Mesh(np.array(devices), ("all",))
    f = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "all"), mesh=mesh, in_specs=PartitionSpec("all"), out_specs=PartitionSpec()
        )
    )
    x = jnp.ones((n, nbytes // 4), jnp.float32)
    f(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * (n - 1) / n * (nbytes) / float(np.median(times))
