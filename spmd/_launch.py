"""Several JAX processes on one host, as on a cluster: ``spmd launch --processes 2 --devices-per-process 4 -- cmd``.

The launcher picks a free port on 127.0.0.1, starts ``processes`` copies of the command with the environment
:func:`initialize` reads (coordinator address, process count and id, local CPU devices), forwards their output —
the first process's standard output as it is (the job's result: spmd prints only there), every other line with a
``[process i]`` prefix — and exits with the first non-zero status: when one process fails or dies, the others
are stopped rather than left waiting on a collective that can never complete.

On a real cluster there is no launcher: :func:`initialize` calls ``jax.distributed.initialize()``, which reads
the cluster's own environment (SLURM, Open MPI, Cloud TPU, Kubernetes...) — by itself when the environment says
the job has several processes (:func:`cluster_processes`), or when asked (``--distributed``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

__all__ = ["ENV", "cluster_processes", "initialize", "launch"]

# The environment the launcher gives each process.
ENV = {
    "coordinator": "SPMD_COORDINATOR",
    "processes": "SPMD_NUM_PROCESSES",
    "process": "SPMD_PROCESS_ID",
    "devices": "SPMD_LOCAL_DEVICES",
}
# How long a process may stay silent before the coordination service declares it dead and stops the others.
HEARTBEAT_S = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_processes(environ: Mapping[str, str] = os.environ) -> int:
    """How many processes the cluster's environment says this job step runs (1 when it says nothing): a SLURM
    step (``srun``; a bare allocation is not a step), Open MPI or MPICH (``mpirun``), a multi-host Cloud TPU.

    >>> cluster_processes({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}), cluster_processes({})
    (4, 1)
    >>> cluster_processes({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})  # salloc, no srun: one process
    1
    """
    counts = [
        environ.get("SLURM_STEP_NUM_TASKS") if "SLURM_STEP_ID" in environ else None,
        environ.get("OMPI_COMM_WORLD_SIZE"),
        environ.get("PMI_SIZE"),
        str(len(environ["TPU_WORKER_HOSTNAMES"].split(","))) if environ.get("TPU_WORKER_HOSTNAMES") else None,
    ]
    return max([1, *(int(c) for c in counts if c and c.isdigit())])


def initialize(*, cluster: bool = False) -> bool:
    """Joins the job: from the launcher's environment if present, else from the cluster's own
    (``jax.distributed.initialize()`` detects it) when ``cluster=True`` or when :func:`cluster_processes` finds
    several processes. Returns whether this is a multi-process run. Call it before anything starts JAX's
    backend."""
    import jax

    if ENV["coordinator"] in os.environ:
        devices = int(os.environ[ENV["devices"]])
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=os.environ[ENV["coordinator"]],
            num_processes=int(os.environ[ENV["processes"]]),
            process_id=int(os.environ[ENV["process"]]),
            heartbeat_timeout_seconds=HEARTBEAT_S,
        )
        return True
    if cluster or cluster_processes() > 1:
        jax.distributed.initialize(heartbeat_timeout_seconds=HEARTBEAT_S)
        return jax.process_count() > 1
    return False


def _forward(stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            print(f"{prefix}{line}", file=out, flush=True)
    stream.close()


def launch(command: Sequence[str], *, processes: int, devices_per_process: int, grace_s: float = 10.0) -> int:
    """Runs ``command`` as ``processes`` JAX processes of ``devices_per_process`` CPU devices each; returns 0 when
    all succeed, else the first failure's status (a signal as 128 + its number)."""
    if processes < 1 or devices_per_process < 1:
        raise ValueError("spmd launch: --processes and --devices-per-process must be positive integers")
    if not command:
        raise ValueError("spmd launch: give the command to run after --, e.g. spmd launch -- spmd run ...")
    port = free_port()
    lock = threading.Lock()
    children, threads = [], []
    for i in range(processes):
        env = {
            **os.environ,
            ENV["coordinator"]: f"127.0.0.1:{port}",
            ENV["processes"]: str(processes),
            ENV["process"]: str(i),
            ENV["devices"]: str(devices_per_process),
        }
        try:
            child = subprocess.Popen(
                list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            )
        except FileNotFoundError:
            _stop(children, grace_s)
            raise ValueError(f"spmd launch: cannot run {command[0]!r}: no such command") from None
        children.append(child)
        for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
            prefix = "" if i == 0 and out is sys.stdout else f"[process {i}] "
            t = threading.Thread(target=_forward, args=(stream, prefix, out, lock), daemon=True)
            t.start()
            threads.append(t)
    status = 0
    try:
        while [c.poll() for c in children].count(None):  # polls every child (any() would stop at the first)
            failed = [(i, c.returncode) for i, c in enumerate(children) if c.returncode not in (None, 0)]
            if failed:
                i, code = failed[0]
                status = _status(code)
                with lock:
                    print(f"spmd launch: process {i} {_describe(code)}; stopping the others", file=sys.stderr)
                _stop(children, grace_s)
                break
            time.sleep(0.1)
        else:
            codes = [c.returncode for c in children]
            status = next((_status(c) for c in codes if c != 0), 0)
    except KeyboardInterrupt:
        _stop(children, grace_s)
        status = 130
    for t in threads:
        t.join(timeout=5)
    return status


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _stop(children: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM the processes still running, SIGKILL them after ``grace_s``."""
    for c in children:
        if c.poll() is None:
            os.killpg(c.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(c.pid, signal.SIGKILL)
            c.wait()
