"""Emulated CPU devices, so that multi-device plans run on a laptop or a CI machine."""

from __future__ import annotations

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
