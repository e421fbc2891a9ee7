"""Emulated CPU devices, so that multi-device plans run on a laptop or a CI machine, and the memory each
device has free."""

from __future__ import annotations

import os

import jax
from jax._src import xla_bridge


def backend_started() -> bool:
    """Whether JAX has already created its backends (after which the device count is fixed).

    >>> _ = jax.devices()  # anything that asks for devices starts them
    >>> backend_started()
    True
    """
    return xla_bridge.backends_are_initialized()


def emulate_devices(n: int) -> None:
    """Makes the CPU backend expose ``n`` devices; call it before anything touches ``jax.devices()``.

    Only the CPU platform is affected: on a machine with an accelerator JAX still picks that by default.

    >>> import spmd
    >>> spmd.emulate_devices(len(jax.devices()))  # the backend is up: only a no-op request is accepted
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"spmd.emulate_devices: n must be a positive integer, got {n!r}")
    if backend_started():
        have = jax.device_count()
        if jax.default_backend() == "cpu" and have == n:
            return
        raise RuntimeError(
            f"spmd.emulate_devices({n}): JAX's backend has already started with {have} "
            f"{jax.default_backend()} device(s), and the device count cannot change after that. "
            f"Call spmd.emulate_devices({n}) first thing in the program (before any jax.devices(), jnp array "
            f"or jit), or set XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python."
        )
    jax.config.update("jax_num_cpu_devices", n)


def free_memory(device: jax.Device) -> int | None:
    """The bytes ``device`` can still allocate: an accelerator's limit less what it holds; for emulated CPU
    devices, this host's available memory (page cache counts as available, a cgroup's limit caps it) shared
    among this process's CPU devices. None when unknown.

    >>> free_memory(jax.devices()[0]) > 0
    True
    """
    if device.platform == "cpu":
        import psutil

        available = psutil.virtual_memory().available
        limit = _cgroup_memory_left()
        if limit is not None:
            available = min(available, limit)
        return available // max(1, len(jax.local_devices(backend="cpu")))
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def _cgroup_memory_left(root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's cgroup (v2) still lets it use, if it sets a limit."""
    try:
        with open(os.path.join(root, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(root, "memory.current")) as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)
