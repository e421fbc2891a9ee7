"""``spmd launch``: a command as several JAX processes on this host (``jax.distributed`` with gloo)."""

from __future__ import annotations

import argparse
import math

from spmd import _launch
from spmd.cli.parser import UsageError

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    for flag, value in (("--timeout", args.timeout), ("--exit-grace", args.exit_grace)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"{flag} must be a positive number of seconds, got {value:g}")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return _launch.launch(
        cmd,
        processes=args.processes,
        devices_per_process=args.devices_per_process,
        exit_grace_s=args.exit_grace,
        timeout_s=args.timeout,
    )
