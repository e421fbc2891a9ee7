"""The ``spmd`` command: plan, run and demo a partitioning plan on a built-in or user model.

One module per command (``plan``, ``run``, ``compare``, ``suggest``, ``schedule``, ``profile``, ``launch``,
``demo``), each with a ``command(args)``; what they share is public in :mod:`spmd.cli.parser` (the grammar),
:mod:`spmd.cli.setup` (the mesh, model, plan, optimizer and hardware a command works with), :mod:`spmd.cli.train`
and :mod:`spmd.cli.common`. User mistakes exit with status 2 and one line on stderr; set SPMD_DEBUG=1 to see the
traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import jax

from spmd import _launch
from spmd._devices import backend_started, emulate_devices
from spmd._rules import PlanError
from spmd.cli.parser import UsageError, check, parser

__all__ = ["UsageError", "main"]

_NO_DEVICES = ("schedule", "launch")  # a simulation, and a launcher of other processes


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spmd`` command: its exit status.

    >>> main(["schedule", "--schedule", "gpipe", "--stages", "2", "--json"])  # doctest: +ELLIPSIS
    {"schedule": ...}
    0
    """
    try:
        args = parser().parse_args(argv)
        check(args)
        if args.command not in _NO_DEVICES and _start_devices(args) > 0:
            # Only the first process speaks: the others run the same program with their standard output (the
            # libraries' too) sent nowhere; errors still show.
            sys.stdout.flush()
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        elif args.command not in _NO_DEVICES and jax.process_count() > 1:
            # The first process's standard output carries only the results: what libraries write to the
            # descriptor themselves (gloo announces each connection) goes to standard error.
            sys.stdout.flush()
            sys.stdout = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
            os.dup2(sys.stderr.fileno(), 1)
        return importlib.import_module(f"spmd.cli.{args.command}").command(args)
    except Exception as e:  # noqa: BLE001 - every user mistake becomes one line; SPMD_DEBUG shows the rest
        if os.environ.get("SPMD_DEBUG") or not isinstance(
            e, (UsageError, PlanError, ValueError, RuntimeError, ImportError)
        ):
            raise
        message = " ".join(str(e).split())
        print(f"spmd: error: {message}", file=sys.stderr)
        return 2


def _start_devices(args: argparse.Namespace) -> int:
    """Starts JAX's devices: this process's share of a multi-process job (under ``spmd launch``, or with
    ``--distributed`` on a cluster), else ``--devices`` emulated CPU devices or the accelerators. Returns this
    process's index."""
    devices = getattr(args, "devices", None)
    started = backend_started()
    if not started and _launch.initialize(cluster=getattr(args, "distributed", False)):
        if devices is not None:
            raise UsageError("--devices: in a multi-process run each process has the devices its launcher gives it")
        return jax.process_index()
    if devices is not None:
        if not started:
            jax.config.update("jax_platforms", "cpu")  # an explicit count means emulated CPU devices
        emulate_devices(devices)
    elif not started:
        emulate_devices(8)  # only the CPU platform listens; accelerators are used as they are
    return jax.process_index()
