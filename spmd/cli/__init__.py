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
import logging
import os
import sys
import threading
import warnings
from typing import Any, NoReturn

import jax

from spmd import _launch
from spmd._devices import backend_started, emulate_devices
from spmd._rules import PlanError
from spmd.cli.parser import UsageError, parse

__all__ = ["UsageError", "command_line", "main"]

_NO_DEVICES = ("schedule", "launch")  # a simulation, and a launcher of other processes


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spmd`` command: its exit status.

    >>> main(["schedule", "--schedule", "gpipe", "--stages", "2", "--json"])  # doctest: +ELLIPSIS
    {"schedule": ...}
    0
    """
    absl = logging.getLogger("absl")
    level = absl.level
    if not os.environ.get("SPMD_DEBUG"):
        # Orbax logs a failed background save with its traceback, on every thread it touched; the failure
        # reaches the command as an error, said once in one line.
        absl.setLevel(logging.CRITICAL)
    hooks = sys.excepthook, sys.unraisablehook
    sys.excepthook, sys.unraisablehook = _quiet_excepthook, _quiet_unraisablehook
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return _main(argv)
    finally:
        absl.setLevel(level)
        sys.excepthook, sys.unraisablehook = hooks


def _closed_loop(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _quiet_excepthook(kind: type, error: BaseException, tb: object) -> None:
    """After a failed save or restore, TensorStore completes the other arrays' reads and writes on orbax's
    closed event loop, and prints each failure through this hook: those are echoes of the error the command
    reports, so they are dropped; anything else is printed as always."""
    if not _closed_loop(error) or os.environ.get("SPMD_DEBUG"):
        sys.__excepthook__(kind, error, tb)


def _quiet_unraisablehook(unraisable: Any) -> None:
    if not _closed_loop(unraisable.exc_value) or os.environ.get("SPMD_DEBUG"):
        sys.__unraisablehook__(unraisable)


def _show_warning(message: Warning | str, category: type, *_: object, **__: object) -> None:
    """Warnings in one line on standard error, like errors (not Python's file, line and source)."""
    print(f"spmd: warning: {' '.join(str(message).split())}", file=sys.stderr)


def _main(argv: list[str] | None) -> int:
    args = None
    try:
        args = parse(argv)
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
    except KeyboardInterrupt:
        if os.environ.get("SPMD_DEBUG"):
            raise
        saving = getattr(args, "checkpoint_dir", None)
        print(f"spmd: interrupted{'; the checkpoints saved so far are whole' if saving else ''}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every user mistake becomes one line; SPMD_DEBUG shows the rest
        if os.environ.get("SPMD_DEBUG") or not isinstance(
            e, (UsageError, PlanError, ValueError, RuntimeError, ImportError)
        ):
            raise
        message = " ".join(str(e).split())
        print(f"spmd: error: {message}", file=sys.stderr)
        return 2


def command_line() -> NoReturn:
    """The ``spmd`` executable: :func:`main`, then exit with its status, at once if threads of a library
    (orbax's background writers after a failure) would otherwise keep the process alive or print while the
    interpreter shuts down."""
    # `--model mymodule:factory` finds a module in the working directory, as under `python -m spmd` (a console
    # script's path starts at its own directory instead); last, so that no file there shadows a library.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if status != 0 and not os.environ.get("SPMD_DEBUG"):
        # The line just said is the last word: after a failed restore, orbax's abandoned reads are collected
        # while the interpreter shuts down, and each would print its own traceback of the same fault.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        os._exit(status)
    sys.exit(status)


def _start_devices(args: argparse.Namespace) -> int:
    """Starts JAX's devices: this process's share of a multi-process job (under ``spmd launch``, or with
    ``--distributed`` on a cluster), else ``--devices`` emulated CPU devices or the accelerators. Returns this
    process's index."""
    devices = getattr(args, "devices", None)
    started = backend_started()
    cluster = getattr(args, "distributed", False)
    try:
        joined = not started and _launch.initialize(cluster=cluster)
    except (ValueError, RuntimeError) as e:
        if not cluster:
            raise
        first = (str(e).splitlines() or [""])[0]
        raise UsageError(
            f"--distributed: no multi-process job found in the environment (jax.distributed: {first}); run under "
            f"srun, mpirun or on a TPU pod, or use spmd launch to start several processes on this host"
        ) from None
    if joined:
        if devices is not None:
            raise UsageError(
                "--devices: in a multi-process run each process has the devices its launcher gives it; drop "
                "--devices (under spmd launch, set --devices-per-process there)"
            )
        return jax.process_index()
    if devices is not None:
        if not started:
            jax.config.update("jax_platforms", "cpu")  # an explicit count means emulated CPU devices
        emulate_devices(devices)
    elif not started:
        emulate_devices(8)  # only the CPU platform listens; accelerators are used as they are
    return jax.process_index()
