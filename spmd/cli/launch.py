"""``spmd launch``: a command as several JAX processes on this host (``jax.distributed`` with gloo)."""

from __future__ import annotations

import argparse

from spmd import _launch

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return _launch.launch(cmd, processes=args.processes, devices_per_process=args.devices_per_process)
