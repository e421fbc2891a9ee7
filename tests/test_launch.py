"""spmd launch owns its processes: a signal to the launcher, a hung process, a timeout and a command that cannot
start all end with every process stopped (none outlives the launcher) and one line on standard error.

The processes write their pids to files, so the tests can check with ``os.kill(pid, 0)`` that they are gone;
each test kills whatever it started in a ``finally``, whatever the outcome.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from spmd import _launch
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
SPMD = [sys.executable, "-m", "spmd"]


def sh(script, pids):
    """A command for every process: ``script`` after writing the shell's pid to ``pids/pid.<process id>``."""
    return ["sh", "-c", f"echo $$ > {pids}/pid.$SPMD_PROCESS_ID; {script}"]


def pids_of(pids, count=2, timeout=60):
    """The pids the processes wrote, once ``count`` of them have."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(Path(pids).glob("pid.*"))
        texts = [f.read_text().strip() for f in files]
        if len(files) == count and all(texts):
            return [int(t) for t in texts]
        time.sleep(0.05)
    raise AssertionError(f"the processes did not start: {sorted(os.listdir(pids))}")


def gone(pid, timeout=5):
    """Whether process ``pid`` has ended, allowing ``timeout`` for an orphan's reaper to collect it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def kill_all(pids, launcher=None):
    """Leaves nothing running: the launcher (in a session of its own) and every process that wrote a pid."""
    if launcher is not None and launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    for f in Path(pids).glob("pid.*"):
        for kill in (os.killpg, os.kill):  # a process's group (the launcher's children lead theirs), or itself
            try:
                kill(int(f.read_text()), signal.SIGKILL)
            except (ValueError, OSError):
                pass


def start_launcher(*args):
    return subprocess.Popen(
        [*SPMD, "launch", *args], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_stops_every_process(tmp_path, sig):
    launcher = start_launcher("--processes", "2", "--devices-per-process", "1", "--", *sh("exec sleep 1000", tmp_path))
    try:
        children = pids_of(tmp_path)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + sig, err
        assert f"spmd launch: interrupted by {sig.name}; stopped 2 processes\n" in err, err
        assert all(gone(p) for p in children)
    finally:
        kill_all(tmp_path, launcher)


@pytest.mark.slow
def test_a_second_signal_kills_at_once_what_ignores_the_first(tmp_path):
    # The processes ignore SIGTERM; the launcher would wait its grace (10 s), but a second signal cuts it short.
    script = "trap '' TERM; while :; do sleep 0.1; done"
    launcher = start_launcher("--processes", "2", "--devices-per-process", "1", "--", *sh(script, tmp_path))
    try:
        children = pids_of(tmp_path)
        launcher.send_signal(signal.SIGTERM)
        time.sleep(1)
        start = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 143 and time.monotonic() - start < 5, err
        assert "interrupted by SIGTERM; stopped 2 processes (2 with SIGKILL)" in err, err
        assert all(gone(p) for p in children)
    finally:
        kill_all(tmp_path, launcher)


JAX_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from spmd import _launch
    _launch.initialize()
    import jax
    assert jax.process_count() == 2
    with open(os.path.join(sys.argv[1], "pid." + os.environ["SPMD_PROCESS_ID"]), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(1000)
    """
)


@pytest.mark.slow
def test_a_jax_process_exits_on_the_forwarded_sigterm(tmp_path):
    # jax.distributed's preemption notifier would swallow SIGTERM: the launcher would need SIGKILL, after 10 s.
    (tmp_path / "child.py").write_text(JAX_CHILD)
    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = [sys.executable, str(tmp_path / "child.py"), str(pids)]
    launcher = start_launcher("--processes", "2", "--devices-per-process", "1", "--", *cmd)
    try:
        children = pids_of(pids, timeout=120)
        start = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 143, err[-3000:]
        assert "interrupted by SIGTERM; stopped 2 processes\n" in err, err[-3000:]  # none needed SIGKILL
        assert time.monotonic() - start < _launch.UNWIND_S + 3
        assert all(gone(p) for p in children)
    finally:
        kill_all(pids, launcher)


SIGTERM_ON_ANOTHER_THREAD = textwrap.dedent(
    """
    import signal, sys, threading, time
    from spmd import _launch
    _launch.UNWIND_S = 1.0
    _launch._exit_on_sigterm()
    # A process-wide signal lands on any thread: on one of JAX's, Python's handler waits for the main thread.
    def sigterm_here():
        time.sleep(0.5)  # by then the main thread sleeps in the try block
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    threading.Thread(target=sigterm_here).start()
    try:
        time.sleep(1000)
    finally:
        print("unwound", flush=True)
        if sys.argv[1] == "stuck":
            time.sleep(1000)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("finally_block", ["returns", "stuck"])
def test_sigterm_ends_a_joined_process_wherever_it_lands(tmp_path, finally_block):
    script = tmp_path / "child.py"
    script.write_text(SIGTERM_ON_ANOTHER_THREAD)
    r = subprocess.run(
        [sys.executable, str(script), finally_block], env=ENV, capture_output=True, text=True, timeout=60
    )
    # finally blocks run; one that does not end is cut short after UNWIND_S
    assert r.returncode == 143 and r.stdout == "unwound\n", r.stderr[-3000:]


def test_a_process_left_running_after_another_finished_is_stopped(tmp_path, capsys):
    script = 'if [ "$SPMD_PROCESS_ID" = 1 ]; then exec sleep 1000; fi'
    try:
        start = time.monotonic()
        code = _launch.launch(sh(script, tmp_path), processes=2, devices_per_process=1, exit_grace_s=0.5, grace_s=1)
        err = capsys.readouterr().err
        assert code == 124 and time.monotonic() - start < 10
        assert "spmd launch: process 1 still running 0.5 s after process 0 exited with status 0" in err, err
        assert len(err.splitlines()) == 1 and all(gone(p) for p in pids_of(tmp_path))
    finally:
        kill_all(tmp_path)


def test_timeout_stops_the_job_even_when_processes_ignore_sigterm(tmp_path, capsys):
    script = "trap '' TERM; while :; do sleep 0.1; done"
    try:
        code = _launch.launch(sh(script, tmp_path), processes=2, devices_per_process=1, timeout_s=1, grace_s=0.5)
        err = capsys.readouterr().err
        assert code == 124
        assert err == "spmd launch: --timeout 1 s reached; stopping processes 0, 1, still running\n", err
        assert all(gone(p) for p in pids_of(tmp_path))
    finally:
        kill_all(tmp_path)


def test_a_failure_stops_the_others_and_what_they_started(tmp_path, capsys):
    # process 0 leaves a child of its own behind (same process group); process 1 fails
    script = f'sleep 1000 & echo $! > {tmp_path}/pid.bg; [ "$SPMD_PROCESS_ID" = 1 ] && exit 3; wait'
    try:
        code = _launch.launch(sh(script, tmp_path), processes=2, devices_per_process=1, grace_s=1)
        assert code == 3 and "spmd launch: process 1 exited with status 3" in capsys.readouterr().err
        assert all(gone(p) for p in pids_of(tmp_path, count=3))
    finally:
        kill_all(tmp_path)


def test_a_success_leaves_nothing_running(tmp_path):
    script = f"sleep 1000 & echo $! > {tmp_path}/pid.bg.$SPMD_PROCESS_ID; exit 0"
    try:
        assert _launch.launch(sh(script, tmp_path), processes=2, devices_per_process=1, grace_s=1) == 0
        assert all(gone(p) for p in pids_of(tmp_path, count=4))
    finally:
        kill_all(tmp_path)


@pytest.mark.parametrize(
    "program, reason", [("/etc/passwd", "Permission denied"), ("/nonexistent/x", "No such file or directory")]
)
def test_a_command_that_cannot_run_is_one_line(capsys, program, reason):
    code, out, err = run_cli(capsys, "launch", "--processes", "2", "--", program)
    assert code == 2 and err == f"spmd: error: spmd launch: cannot run {program!r}: {reason}\n", err


def test_processes_already_started_are_stopped_when_one_cannot_start(monkeypatch):
    popen, started = subprocess.Popen, []

    def second_fails(*args, **kwargs):
        if started:
            raise PermissionError(13, "Permission denied")
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(_launch.subprocess, "Popen", second_fails)
    try:
        with pytest.raises(ValueError, match="cannot run 'sleep': Permission denied"):
            _launch.launch(["sleep", "1000"], processes=2, devices_per_process=1, grace_s=1)
        assert started and started[0].returncode == -signal.SIGTERM
    finally:
        for child in started:
            child.kill()
            child.wait()


@pytest.mark.parametrize("flag, value", [("--timeout", "0"), ("--timeout", "-1"), ("--exit-grace", "inf"),
                                         ("--exit-grace", "nan"), ("--timeout", "soon")])  # fmt: skip
def test_timeouts_must_be_positive_finite_seconds(capsys, flag, value):
    code, _, err = run_cli(capsys, "launch", flag, value, "--", "true")
    assert code == 2 and err.startswith("spmd: error: ") and flag in err and len(err.splitlines()) == 1, err


def test_the_api_checks_its_seconds_too():
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        _launch.launch(["true"], processes=1, devices_per_process=1, timeout_s=float("inf"))
    with pytest.raises(ValueError, match="grace_s"):
        _launch.launch(["true"], processes=1, devices_per_process=1, grace_s=-1)
