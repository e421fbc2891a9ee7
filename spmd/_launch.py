"""Several JAX processes on one host, as on a cluster: ``spmd launch --processes 2 --devices-per-process 4 -- cmd``.

The launcher picks a free port on 127.0.0.1, starts ``processes`` copies of the command with the environment
:func:`initialize` reads (coordinator address, process count and id, local CPU devices), forwards their output —
the first process's standard output as it is (the job's result: spmd prints only there), every other line with a
``[process i]`` prefix — and exits with the first non-zero status: when one process fails or dies, the others
are stopped rather than left waiting on a collective that can never complete.

The launcher owns its processes: each runs in a process group of its own, and whenever the job ends early every
group is stopped — SIGTERM, then SIGKILL after ``grace_s`` (or at once on a second signal to the launcher) — so
none outlives it. SIGTERM or SIGINT (Ctrl-C) to the launcher stops the job that way — the processes get SIGTERM
either way, which a process that has joined handles at once — with one line on standard error and status 128 +
the signal. A job that hangs ends with status 124 and one line naming the processes still running: after
``timeout_s`` (``--timeout``, default none), or when the others are still running ``exit_grace_s``
(``--exit-grace``, 60 s) after one exited with status 0 — the processes of one JAX job finish together, at the
final barrier. A command that cannot be started is a ValueError.

On a real cluster there is no launcher: :func:`initialize` calls ``jax.distributed.initialize()``, which reads
the cluster's own environment (SLURM, Open MPI, Cloud TPU, Kubernetes...) — by itself when the environment says
the job has several processes (:func:`cluster_processes`), or when asked (``--distributed``). Either way, a
process that has joined exits on SIGTERM (status 143, ``finally`` blocks run), which jax.distributed alone would
swallow.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
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
# How long a process told to stop (SIGTERM) may unwind before it exits regardless: JAX's exit handler waits up to
# 5 minutes at a shutdown barrier for peers that may be gone. Under the launcher's grace (10 s), so a process
# ends by itself, with status 143, rather than by SIGKILL.
UNWIND_S = 5.0
# How often the launcher looks at its processes.
POLL_S = 0.05


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
    backend: a program of your own started by ``spmd launch`` calls it first. A process that has joined exits
    on SIGTERM (status 143).

    >>> initialize()  # one process, neither a launcher nor a cluster around it: nothing to join
    False
    """
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
        # jax.distributed starts a preemption notifier that catches SIGTERM and only records it, for
        # multihost_utils.reached_preemption_sync_point, which spmd never asks: without this, the launcher's
        # SIGTERM would be ignored and every stop would wait for SIGKILL.
        _exit_on_sigterm()
        return True
    if cluster or cluster_processes() > 1:
        jax.distributed.initialize(heartbeat_timeout_seconds=HEARTBEAT_S)
        # Likewise on a cluster: SLURM, Kubernetes and the TPU runtime send SIGTERM first and SIGKILL after a
        # grace; exiting on SIGTERM lets ``finally`` blocks run, for at most UNWIND_S seconds (a save still in
        # flight then is cut off; orbax's atomic rename keeps the previous step whole).
        _exit_on_sigterm()
        return jax.process_count() > 1
    return False


def _exit_on_sigterm() -> None:
    """Makes SIGTERM end this process: SystemExit(143) in the main thread, so ``finally`` blocks run, and
    ``os._exit(143)`` if it has not ended :data:`UNWIND_S` seconds later."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set signal handlers; such a caller keeps JAX's behaviour
    exiting = threading.Event()

    def on_sigterm(signum: int, frame: object) -> None:
        if not exiting.is_set():  # a repeated SIGTERM must not interrupt the ``finally`` blocks of the first
            exiting.set()
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if previous != -1:  # someone listens already (an asyncio loop): keep theirs; the handler alone still works
        signal.set_wakeup_fd(previous)
        os.close(read), os.close(write)
        return
    threading.Thread(target=_watch, args=(read, exiting), name="spmd-sigterm", daemon=True).start()


def _watch(fd: int, exiting: threading.Event) -> None:
    """Python runs signal handlers in the main thread only, and only when it next runs Python code: a SIGTERM
    that lands on one of JAX's threads while the main thread sleeps in a system call, or waits in C++ (a
    collective whose peer is gone, JAX's shutdown barrier at exit), would wait there. This thread hears every
    signal through the wakeup descriptor, interrupts the main thread's system call, and exits regardless after
    :data:`UNWIND_S` seconds."""
    while os.read(fd, 1) != bytes([signal.SIGTERM]):
        pass  # other signals Python handles (SIGINT) write here too
    if not exiting.wait(0.2):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    time.sleep(UNWIND_S)
    os._exit(128 + signal.SIGTERM)


def _forward(stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            print(f"{prefix}{line}", file=out, flush=True)
    stream.close()


def launch(
    command: Sequence[str],
    *,
    processes: int,
    devices_per_process: int,
    grace_s: float = 10.0,
    exit_grace_s: float = 60.0,
    timeout_s: float | None = None,
) -> int:
    """Runs ``command`` as ``processes`` JAX processes of ``devices_per_process`` CPU devices each; returns 0 when
    all succeed, else the first failure's status (a signal as 128 + its number), 124 when the job hangs (past
    ``timeout_s``, or ``exit_grace_s`` after one process exited with status 0), 128 + the signal when SIGTERM or
    SIGINT stops it. No process outlives the call: the ones still running get SIGTERM, then SIGKILL after
    ``grace_s``.

    >>> launch(["sh", "-c", "exit 0"], processes=2, devices_per_process=1)
    0
    """
    if processes < 1 or devices_per_process < 1:
        raise ValueError("spmd launch: --processes and --devices-per-process must be positive integers")
    if not command:
        raise ValueError("spmd launch: give the command to run after --, e.g. spmd launch -- spmd run ...")
    if not (math.isfinite(grace_s) and grace_s >= 0):
        raise ValueError(f"spmd launch: grace_s must be a number of seconds, 0 or more, got {grace_s}")
    for name, value in (("exit_grace_s", exit_grace_s), ("timeout_s", timeout_s)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"spmd launch: {name} must be a positive number of seconds, got {value}")
    lock = threading.Lock()
    children: list[subprocess.Popen] = []
    received: list[int] = []  # the signals the launcher has been sent, in order
    with _catching((signal.SIGTERM, signal.SIGINT), received):
        try:
            threads = _start(command, children, processes, devices_per_process, lock)
            status = _supervise(
                children, lock, received, grace_s=grace_s, exit_grace_s=exit_grace_s, timeout_s=timeout_s
            )
        finally:
            _stop(children, grace_s, received)  # whatever ended the job, and what the processes started
    for t in threads:
        t.join(timeout=5)
    return status


@contextlib.contextmanager
def _catching(signals: Sequence[int], received: list[int]) -> Iterator[None]:
    """Records ``signals`` in ``received`` instead of dying of them, so that the launcher can stop its processes
    first (they run in sessions of their own: a terminal's Ctrl-C reaches the launcher alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set signal handlers; its caller then stops the job by other means
        return
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _start(
    command: Sequence[str], children: list[subprocess.Popen], processes: int, devices: int, lock: threading.Lock
) -> list[threading.Thread]:
    """Starts the processes (appending each to ``children`` as it starts) and the threads forwarding their
    output."""
    port = free_port()
    threads = []
    for i in range(processes):
        env = {
            **os.environ,
            ENV["coordinator"]: f"127.0.0.1:{port}",
            ENV["processes"]: str(processes),
            ENV["process"]: str(i),
            ENV["devices"]: str(devices),
        }
        try:
            child = subprocess.Popen(
                list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            )
        except OSError as e:  # not found, not executable, not a program: the caller stops those already started
            raise ValueError(f"spmd launch: cannot run {command[0]!r}: {e.strerror or e}") from None
        children.append(child)
        for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
            prefix = "" if i == 0 and out is sys.stdout else f"[process {i}] "
            t = threading.Thread(target=_forward, args=(stream, prefix, out, lock), daemon=True)
            t.start()
            threads.append(t)
    return threads


def _supervise(
    children: list[subprocess.Popen],
    lock: threading.Lock,
    received: list[int],
    *,
    grace_s: float,
    exit_grace_s: float,
    timeout_s: float | None,
) -> int:
    """Waits for the processes to end; returns the job's status, having stopped them all when it ends early."""
    start, first_done = time.monotonic(), None
    while True:
        codes = [c.poll() for c in children]
        running = [i for i, code in enumerate(codes) if code is None]
        failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
        now = time.monotonic()
        if received:
            stopped, killed = _stop(children, grace_s, received)
            name = signal.Signals(received[0]).name
            after = f" ({killed} with SIGKILL)" if killed else ""
            _say(lock, f"interrupted by {name}; stopped {stopped} process{'es' * (stopped != 1)}{after}")
            return 128 + received[0]
        if failed:
            i, code = failed[0]
            _say(lock, f"process {i} {_describe(code)}; stopping the others")
            _stop(children, grace_s, received)
            return _status(code)
        if not running:
            return 0
        if first_done is None and 0 in codes:
            first_done = now
        if timeout_s is not None and now - start >= timeout_s:
            _say(lock, f"--timeout {timeout_s:g} s reached; stopping {_names(running)}, still running")
        elif first_done is not None and now - first_done >= exit_grace_s:
            done = codes.index(0)
            _say(
                lock,
                f"{_names(running)} still running {exit_grace_s:g} s after process {done} exited with status 0 "
                "(the processes of one job end together); stopping",
            )
        else:
            time.sleep(POLL_S)
            continue
        _stop(children, grace_s, received)
        return 124


def _say(lock: threading.Lock, text: str) -> None:
    with lock:
        print(f"spmd launch: {text}", file=sys.stderr, flush=True)


def _names(indices: Sequence[int]) -> str:
    return f"process{'es' * (len(indices) != 1)} {', '.join(map(str, indices))}"


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _signal_group(pgid: int, sig: int) -> bool:
    """Sends ``sig`` to a process group; whether the group still exists."""
    try:
        os.killpg(pgid, sig)
    except OSError:  # gone (or, its id reused by someone else's group, not ours)
        return False
    return True


def _stop(children: list[subprocess.Popen], grace_s: float, received: Sequence[int] = ()) -> tuple[int, int]:
    """Stops each child's process group (the command and whatever it started): SIGTERM, then SIGKILL what is
    left after ``grace_s``, or at once when the launcher is sent another signal meanwhile. Returns how many
    children were running, and how many of those needed SIGKILL."""
    running = [c for c in children if c.poll() is None]
    for c in children:
        _signal_group(c.pid, signal.SIGTERM)  # a child that has exited may have left processes in its group
    seen, deadline = len(received), time.monotonic() + grace_s
    while time.monotonic() < deadline and len(received) == seen:
        if all(c.poll() is not None and not _signal_group(c.pid, 0) for c in children):
            break
        time.sleep(0.02)
    killed = sum(c.poll() is None for c in running)
    for c in children:
        _signal_group(c.pid, signal.SIGKILL)
        c.wait()
    return len(running), killed
