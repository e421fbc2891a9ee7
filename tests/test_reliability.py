"""Nothing lost, nothing silent: checkpoint directories that hold another run, locks, checksums, non-finite
losses, values checked at the door, flags that do not apply, unused mesh axes, clean exits — and, in the slow
tier, faults injected into saved checkpoints (flipped bytes, a truncated file, a full disk) and Ctrl-C."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
import strategies
from spmd import CheckpointError, Checkpoints, PlanError, PlanWarning, data, models
from spmd._checkpoint import digests
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
SPMD = [sys.executable, "-m", "spmd"]
TINY = ["--model", "gpt-tiny", "--layers", "1", "--batch-size", "8"]


def strict_json(text):
    """The last JSON line of ``text``, read as standard JSON (Python's NaN and Infinity are refused)."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    line = [x for x in text.splitlines() if x.startswith("{")][-1]
    return json.loads(line, parse_constant=refuse)


def one_line_error(code, err, pattern, status=2):
    assert code == status, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(pattern, lines[0]), lines[0]


def steps_in(directory):
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


# -- checkpoint directories --------------------------------------------------------------------------------
@pytest.mark.slow  # more checkpoint-directory cases; the default tier keeps the resume mistakes
def test_another_runs_directory_is_refused_and_its_run_still_resumes(capsys, tmp_path):
    ck = str(tmp_path / "ck")
    straight = strict_json(run_cli(capsys, "run", *TINY, "--steps", "3", "--json")[1])["losses"]
    code, out, _ = run_cli(capsys, "run", *TINY, "--mesh", "fsdp=8", "--strategy", "fsdp", "--steps", "2",
                           "--checkpoint-dir", ck, "--json")  # fmt: skip
    assert code == 0 and steps_in(ck) == [2]
    # Another run (another plan and seed) into the same directory: refused up front, nothing saved over.
    code, out, err = run_cli(capsys, "run", *TINY, "--strategy", "dp", "--steps", "2", "--seed", "5",
                             "--checkpoint-dir", ck, "--json")  # fmt: skip
    one_line_error(code, err, r"already holds checkpoints up to step 2 .*seed 0.*seed 5.*--resume.*--overwrite")
    assert out == "" and steps_in(ck) == [2]
    # Resuming it with another seed would train on other data: refused, naming both.
    code, _, err = run_cli(capsys, "run", *TINY, "--steps", "3", "--seed", "5", "--checkpoint-dir", ck, "--resume")
    one_line_error(code, err, r"saved by a run with --seed 0, this run has --seed 5")
    # The first run's checkpoint still resumes, onto another plan, to the losses of a run never stopped.
    code, out, _ = run_cli(capsys, "run", *TINY, "--steps", "3", "--checkpoint-dir", ck, "--resume", "--json")
    assert code == 0 and steps_in(ck) == [2, 3]
    np.testing.assert_allclose(strict_json(out)["losses"], straight[2:], atol=1e-5)
    # --overwrite deletes them only once the new run has a step to save: a run refused first deletes nothing.
    code, _, err = run_cli(capsys, "run", *TINY[:4], "--batch-size", "100000000", "--steps", "1", "--checkpoint-dir",
                           ck, "--overwrite")  # fmt: skip
    assert code == 2 and steps_in(ck) == [2, 3], err
    # --overwrite is the explicit way to start again there.
    code, _, err = run_cli(capsys, "run", *TINY, "--steps", "3", "--checkpoint-dir", ck, "--resume", "--overwrite")
    one_line_error(code, err, r"--resume continues the checkpoints that --overwrite would delete")
    code, _, _ = run_cli(capsys, "run", *TINY, "--steps", "1", "--seed", "5", "--checkpoint-dir", ck, "--overwrite")
    assert code == 0 and steps_in(ck) == [1]
    assert json.loads((Path(ck) / "1" / "record" / "metadata").read_text())["seed"] == 5


@pytest.fixture
def nothing_compiles(monkeypatch):
    """A run that compiles fails: what must be refused before any work is refused before this."""

    def compile(self, batch):
        raise AssertionError("compiled before refusing")

    monkeypatch.setattr(spmd.TrainStep, "compile", compile)


def test_a_second_writer_is_refused_at_once_and_a_killed_one_leaves_no_lock(capsys, tmp_path, nothing_compiles):
    ck = tmp_path / "ck"
    with Checkpoints(str(ck)):
        code, _, err = run_cli(capsys, "run", *TINY, "--steps", "1", "--checkpoint-dir", str(ck))
        one_line_error(code, err, r"--checkpoint-dir .*ck is in use by .*this very process")
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import spmd, time; c = spmd.Checkpoints({str(ck)!r}); print('held', flush=True); "
         "time.sleep(600)"],
        env=ENV, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=rf"in use by another run \(process {holder.pid} on "):
            Checkpoints(str(ck))
    finally:
        holder.kill()
        holder.wait()
    with Checkpoints(str(ck)) as again:  # the lock died with its process
        assert again.latest() is None


def test_the_directory_must_be_writable_before_any_work(capsys, tmp_path, nothing_compiles):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    (tmp_path / "photos" / "2023").mkdir(parents=True)  # someone's directory, named like a step
    for directory, message in (
        (str(a_file), r"--checkpoint-dir .*file: it is a file, not a directory"),
        (str(a_file / "ck"), r"--checkpoint-dir .*file/ck: cannot write there \(Not a directory\)"),
        (str(tmp_path / "photos"), r"holds .*photos/2023, named like a saved step but not one; move it out"),
        ("/proc/spmd-checkpoints", r"--checkpoint-dir /proc/spmd-checkpoints: cannot write there"),
    ):
        code, _, err = run_cli(capsys, "run", *TINY, "--steps", "1", "--checkpoint-dir", directory)
        one_line_error(code, err, message)


def _saved(tmp_path, steps, *, scale=1.0):
    ck = Checkpoints(str(tmp_path / "ck"), asynchronous=False)
    state = {"w": np.arange(4096, dtype=np.float32) * scale, "b": np.ones(3, np.float32)}
    for step in steps:
        ck.save(step, state, {"model": "toy"})
    ck.close()
    return tmp_path / "ck", jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def test_a_corrupt_array_is_named_and_the_previous_step_offered(tmp_path):
    ck, target = _saved(tmp_path, [1, 2])
    # Flip bytes in the middle of the largest data file of step 2: it still decodes, to other numbers.
    victim = max((p for p in (ck / "2" / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 16] = bytes(b ^ 0xFF for b in raw[middle : middle + 16])
    victim.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as caught, Checkpoints(str(ck)) as checkpoints:
        checkpoints.restore(target)
    message = str(caught.value)
    assert re.search(r"checkpoint step 2 in .* is corrupt: state\['w'\] does not match the checksum", message)
    assert f"move {ck / '2'} aside to resume from step 1" in message
    shutil.move(ck / "2", tmp_path / "set-aside")
    with Checkpoints(str(ck)) as checkpoints:
        step, state, _ = checkpoints.restore(target)
    assert step == 1 and np.array_equal(np.asarray(state["w"]), np.arange(4096, dtype=np.float32))


def test_nothing_non_finite_is_saved_and_no_step_is_skipped(tmp_path):
    ck, _ = _saved(tmp_path, [3])
    with Checkpoints(str(ck), asynchronous=False) as checkpoints:
        with pytest.raises(CheckpointError, match=r"step 4 not saved: state\['w'\] holds NaN or inf.*step 3 stays"):
            checkpoints.save(4, {"w": np.array([1.0, np.nan], np.float32)}, {})
        with pytest.raises(CheckpointError, match=r"already holds step 3; saving would not replace it"):
            checkpoints.save(2, {"w": np.ones(2, np.float32)}, {})
        assert checkpoints.steps() == [3]


def test_digests_do_not_depend_on_the_sharding():
    mesh = spmd.make_mesh({"data": 8})
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    assert digests({"x": sharded}) == digests({"x": x})
    y = x.copy()
    y[3, 4] = np.nextafter(y[3, 4], np.float32(np.inf))  # one bit
    assert digests({"x": y})[0] != digests({"x": x})[0]
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same values in another order
    assert digests({"x": swapped})[0] != digests({"x": x})[0]


# -- non-finite losses -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_naming_the_step_and_the_last_checkpoint(capsys, tmp_path):
    ck = tmp_path / "ck"
    code, out, err = run_cli(capsys, "run", *TINY, "--steps", "4", "--lr", "1e6", "--checkpoint-dir", str(ck),
                             "--checkpoint-every", "1", "--json")  # fmt: skip
    one_line_error(code, err, r"step 2: the loss is nan; .*the last checkpoint is step 1 in .*ck.*--on-nan skip")
    assert out == "" and steps_in(ck) == [1]  # the NaN state was never saved
    # Skipping instead: the steps are reported, the JSON stays JSON (null for a NaN loss).
    code, out, _ = run_cli(capsys, "run", *TINY, "--steps", "4", "--lr", "1e6", "--on-nan", "skip", "--json")
    result = strict_json(out)
    assert code == 0 and result["skipped_steps"] == [2, 3, 4] and result["losses"][1:] == [None] * 3


def test_skip_nonfinite_keeps_the_state_of_a_bad_step():
    model = models.get("gpt-tiny", layers=1)
    params = jax.eval_shape(model.init, jax.random.key(0))
    mesh = spmd.make_mesh({"data": 8})
    plan = spmd.Plan(batch_axes=("data",))
    step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=params, skip_nonfinite=True)
    state = step.init(model.init, jax.random.key(0))
    good = data.batch(0, 0, 8, model.config.seq_len, model.config.vocab)
    bad = {"tokens": good["tokens"].copy()}
    bad["tokens"][0, 3] = model.config.vocab  # a token id outside the vocabulary
    before = jax.tree.map(np.asarray, (step.params_of(state), state.opt_state))
    state, loss = step(state, bad)
    assert np.isnan(float(loss)) and int(state.step) == 1
    after = jax.tree.map(np.asarray, (step.params_of(state), state.opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)
    state, loss = step(state, good)
    assert np.isfinite(float(loss)) and int(state.step) == 2
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), step.params_of(state), before[0])
    assert any(jax.tree.leaves(moved))


def test_a_step_skipped_for_its_gradients_alone_reports_a_nan_loss():
    # sqrt(|w| * 0) is 0 for every w, but its gradient is 0 * inf = NaN: the loss alone would hide the skip.
    loss_fn = lambda p, b: jnp.sum(jnp.sqrt(jnp.abs(p["w"]) * b["scale"][0]))  # noqa: E731
    mesh = spmd.make_mesh({"data": 8})
    params = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    step = spmd.TrainStep(loss_fn, optax.adam(0.1), spmd.Plan(batch_axes=("data",)), mesh, params=params,
                          skip_nonfinite=True)  # fmt: skip
    state = step.init(lambda rng: {"w": jnp.ones(4)}, jax.random.key(0))
    state, loss = step(state, {"scale": jnp.zeros(8)})
    assert np.isnan(float(loss)) and np.array_equal(np.asarray(state.params["w"]), np.ones(4))
    state, loss = step(state, {"scale": jnp.ones(8)})
    assert float(loss) == 4.0 and not np.array_equal(np.asarray(state.params["w"]), np.ones(4))


# -- values and flags at the door --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--lr", "nan"], r"--lr must be a positive finite number, got nan"),
        (["run", "--lr", "inf"], r"--lr must be a positive finite number, got inf"),
        (["plan", "--seed", "99999999999999999999999"], r"--seed must be an integer from 0 to 4294967295"),
        (["plan", "--seed", "-1"], r"--seed must be an integer from 0 to 4294967295"),
        (["plan", "--devices", "100000"], r"--devices 100000: at most 1024 emulated CPU devices"),
        (["plan", "--coverage", "1.5", "--strategy", "sdp"], r"--coverage must be in \(0, 1\]"),
        (["compare", "--strategy", "dp"], r"--strategy does not apply to compare: give .* --strategies"),
        (["plan", "--coverage", "0.3"], r"--coverage applies to subnetwork data parallelism.*\(sdp\)"),
        (["run", "--granularity", "neuron"], r"--granularity applies to subnetwork data parallelism"),
        (["plan", "--microbatches", "4"], r"--microbatches applies to pipeline parallelism.*\(pp\)"),
        (["plan", "--axis-bandwidth", "tensor=50", "--mesh", "data=8"], r"names 'tensor', which the mesh data=8 has"),
        (["run", "--checkpoint-every", "2"], r"--checkpoint-every applies to checkpoints: give --checkpoint-dir"),
        (["run", "--overwrite"], r"--overwrite applies to checkpoints: give --checkpoint-dir"),
        (["plan", "--even"], r"--even applies to uneven devices"),
        (["plan", "--microbatch", "2"], r"--microbatch applies to uneven devices"),
        (["compare", "--plot", "/proc/spmd/chart.png"], r"--plot /proc/spmd/chart.png: cannot write there"),
        (["schedule", "--plot", "/"], r"--plot /: is a directory; give a file name"),
        (["profile", "--out", "/proc/spmd.json"], r"--out /proc/spmd.json: cannot write there"),
        (["plan", "--dcn", "data=2", "--mesh", "data=8"], r"--dcn data=2: .* this job has 1; .*leave --dcn out"),
        (["plan", "--model", "os.path:join"], r"calling the factory failed \(TypeError: .*join"),
        (["plan", "--model", "os:getcwd"], r"--model 'os:getcwd': the factory returned the wrong thing"),
    ],
)
def test_values_and_flags_are_checked_at_the_door(capsys, args, message):
    code, out, err = run_cli(capsys, *args)
    one_line_error(code, err, message)
    assert out == ""


def test_a_schedule_file_fixes_microbatches(capsys, tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps(strategies.pipeline_schedule("gpipe", stages=2, microbatches=2).to_dict()))
    code, _, err = run_cli(capsys, "plan", *TINY, "--mesh", "stage=2,data=4", "--strategy", "pp+dp", "--schedule",
                           str(table), "--microbatches", "4")  # fmt: skip
    one_line_error(code, err, r"--microbatches: the schedule table .*table.json fixes it; remove the flag")


def test_a_batch_that_cannot_fit_is_refused_before_it_is_made(capsys):
    code, out, err = run_cli(capsys, "run", *TINY[:4], "--batch-size", "100000000", "--steps", "1")
    one_line_error(code, err, r"--batch-size 100000000: the step needs .* per device and cpu devices have .* free")


def test_an_unused_mesh_axis_is_a_warning_and_under_a_strict_plan_an_error(capsys):
    params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    mesh = spmd.make_mesh({"data": 2, "tensor": 4})
    plan = spmd.Plan(batch_axes=("data",)) + spmd.Plan.from_rules([("w", (None, None))])  # w kept whole on purpose
    loss = lambda p, b: jnp.mean(b["x"] @ p["w"])  # noqa: E731
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = spmd.TrainStep(loss, optax.sgd(0.1), plan, mesh, params=params)
    assert any(issubclass(w.category, PlanWarning) and "'tensor' (4 devices)" in str(w.message) for w in seen)
    report = spmd.report(step, {"x": jnp.ones((4, 8))})
    assert any("mesh axis 'tensor' is used by no part of the plan" in w for w in report.warnings)
    with pytest.raises(PlanError, match=r"strict plan: mesh axis 'tensor' \(4 devices\) is used by no part"):
        spmd.TrainStep(loss, optax.sgd(0.1), plan.with_strict(), mesh, params=params)
    # The command line says it once, in one line on standard error, and goes on.
    code, out, err = run_cli(capsys, "plan", *TINY, "--mesh", "data=2,tensor=4", "--json")
    lines = [x for x in err.splitlines() if "mesh axis" in x]
    assert code == 0 and len(lines) == 1 and lines[0].startswith("spmd: warning: mesh axis 'tensor' (4 devices)")


def test_a_report_is_of_the_batch_it_is_given():
    model = models.get("mlp")
    params = jax.eval_shape(model.init, jax.random.key(0))
    step = spmd.TrainStep(models.loss_fn(model), optax.sgd(0.1), spmd.Plan(batch_axes=("data",)),
                          spmd.make_mesh({"data": 8}), params=params)  # fmt: skip
    small, large = (spmd.report(step, data.batch(0, 0, n, 32, model.config.vocab)) for n in (8, 64))
    tokens = 32 * 4 // 8  # int32 tokens per example, split over 8 devices
    grew = large.compiled_memory["argument_bytes"] - small.compiled_memory["argument_bytes"]
    assert grew == (64 - 8) * tokens
    assert large.analytic_memory["argument_bytes"] - small.analytic_memory["argument_bytes"] == grew


def test_out_of_vocabulary_tokens_never_give_a_plausible_loss():
    model = models.get("gpt-tiny", layers=1)
    params = models.unbox(jax.jit(model.init)(jax.random.key(0)))
    tokens = data.batch(0, 0, 2, model.config.seq_len, model.config.vocab)["tokens"]
    loss = jax.jit(models.loss_fn(model))
    assert np.isfinite(float(loss(params, {"tokens": tokens})))
    for bad in (-1, model.config.vocab):
        wrong = tokens.copy()
        wrong[1, 0] = bad
        assert np.isnan(float(loss(params, {"tokens": wrong})))


def test_json_output_is_always_json():
    from spmd.cli.common import dumps

    assert json.loads(dumps({"x": [float("nan"), float("-inf"), 1.0]}), parse_constant=float) == {
        "x": [None, None, 1.0]
    }


def test_distributed_outside_a_cluster_says_so_in_one_line():
    r = subprocess.run([*SPMD, "plan", "--distributed"], capture_output=True, text=True, env=ENV, timeout=120)
    one_line_error(r.returncode, r.stderr, r"--distributed: no multi-process job found .* spmd launch")


# -- faults and interrupts (slow) --------------------------------------------------------------------------
def _spmd(*args, timeout=300):
    return subprocess.run([*SPMD, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


@pytest.mark.slow
def test_ctrl_c_prints_one_line_exits_130_and_leaves_whole_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    proc = subprocess.Popen(
        [*SPMD, "run", *TINY, "--steps", "100000", "--checkpoint-dir", str(ck), "--checkpoint-every", "3"],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not (ck.exists() and steps_in(ck)):
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    one_line_error(proc.returncode, err, r"^spmd: interrupted", status=130)
    latest = steps_in(ck)[-1]
    r = _spmd("run", *TINY, "--steps", str(latest + 1), "--checkpoint-dir", str(ck), "--resume", "--json")
    assert r.returncode == 0 and len(strict_json(r.stdout)["losses"]) == 1, r.stderr[-2000:]


@pytest.mark.slow
def test_faults_in_saved_checkpoints_end_in_one_clear_line_or_a_clean_resume(tmp_path):
    straight = strict_json(_spmd("run", *TINY, "--steps", "3", "--json").stdout)["losses"]
    ck = tmp_path / "ck"
    saving = ["--checkpoint-dir", str(ck), "--checkpoint-every", "1"]
    assert _spmd("run", *TINY, "--steps", "2", *saving).returncode == 0 and steps_in(ck) == [1, 2]
    files = sorted((p for p in (ck / "2" / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    original = files[-1].read_bytes()
    resume = ["run", *TINY, "--steps", "3", *saving, "--resume", "--json"]
    # A truncated file, then flipped bytes: each is named, in one line (no flood of orbax's echoes).
    files[-1].write_bytes(original[: len(original) // 3])
    r = _spmd(*resume)
    one_line_error(r.returncode, r.stderr, r"checkpoint step 2 in .* cannot be read .*move .*2 aside.* step 1")
    flipped = bytearray(original)
    flipped[len(flipped) // 2 : len(flipped) // 2 + 32] = bytes(32)
    files[-1].write_bytes(bytes(flipped))
    r = _spmd(*resume)
    one_line_error(r.returncode, r.stderr, r"checkpoint step 2 in .* (is corrupt: state.* does not match|cannot be)")
    # Set aside as the message says, the previous step resumes to the losses of a run never stopped.
    shutil.move(ck / "2", tmp_path / "aside")
    r = _spmd(*resume)
    assert r.returncode == 0, r.stderr[-2000:]
    np.testing.assert_allclose(strict_json(r.stdout)["losses"], straight[1:], atol=1e-5)


def _small_filesystem(path, size):
    """A tmpfs of ``size`` at ``path`` where this machine lets us mount one (True), else False."""
    path.mkdir()
    if shutil.which("mount") is None:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


@pytest.mark.slow
def test_a_full_disk_ends_in_one_line_and_the_run_resumes_once_there_is_room(tmp_path):
    small = tmp_path / "small"
    mounted = _small_filesystem(small, "3m")  # room for two checkpoints of this model (1.2 MB each), not three
    ck = small / "ck"
    saving = ["run", *TINY, "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--json"]
    try:
        if mounted:
            r = _spmd(*saving, "--steps", "3")
        else:  # a quota-like simulation where mounting is not allowed: no file may grow beyond 256 KiB
            quota = (
                "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18)); "
                "from spmd.cli import command_line; sys.argv[0] = 'spmd'; command_line()"
            )
            r = subprocess.run([sys.executable, "-c", quota, *saving, "--steps", "3"], capture_output=True,
                               text=True, env=ENV, timeout=300)  # fmt: skip
        one_line_error(r.returncode, r.stderr, r"saving a checkpoint into .*ck failed \(.*\); (step \d is|none is)")
        latest = (steps_in(ck) or [0])[-1]
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        r = _spmd(*saving, "--steps", str(latest + 2), *(["--resume"] if latest else []))
        assert r.returncode == 0, r.stderr[-2000:]
        straight = strict_json(_spmd("run", *TINY, "--steps", str(latest + 2), "--json").stdout)["losses"]
        np.testing.assert_allclose(strict_json(r.stdout)["losses"], straight[latest:], atol=1e-5)
        assert steps_in(ck)[-1] == latest + 2
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=False)
