"""Beyond one process: spmd launch with jax.distributed, checkpoints that restore onto another mesh, and faults
(a dead peer, a save killed halfway)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
import strategies
from spmd import Checkpoints, models
from spmd._launch import free_port
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
SPMD = [sys.executable, "-m", "spmd"]


def last_json(text):
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


@pytest.mark.slow
def test_launch_two_processes_on_a_hybrid_mesh_equals_one_device():
    cmd = [*SPMD, "launch", "--processes", "2", "--devices-per-process", "4", "--", *SPMD, "run", "--model",
           "gpt-tiny", "--mesh", "data=2,fsdp=4", "--dcn", "data=2", "--strategy", "dp+fsdp", "--steps", "3",
           "--check", "--json"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    # Standard output is the first process's result alone: the other process prints nothing, and what gloo
    # writes itself (a line per connection) goes to standard error.
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout[-2000:]
    j = json.loads(lines[0])
    assert j["processes"] == 2 and len(j["losses"]) == 3 and j["max_abs_diff"] <= 1e-4


DYING = textwrap.dedent(
    """
    import os, signal, time
    from spmd import _launch
    _launch.initialize()
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((jax.device_count(),), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), jnp.ones(jax.local_device_count()))
    for step in range(10**6):
        float(total(x)[0])
        if step == 20 and jax.process_index() == 1:
            print("dying", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)
    """
)


@pytest.mark.slow
def test_a_dead_peer_stops_the_job_within_a_minute(tmp_path):
    script = tmp_path / "dying.py"
    script.write_text(DYING)
    start = time.monotonic()
    cmd = [*SPMD, "launch", "--processes", "2", "--devices-per-process", "2", "--", sys.executable, str(script)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    elapsed = time.monotonic() - start
    assert r.returncode == 128 + signal.SIGKILL and elapsed <= 60, (r.returncode, elapsed)
    assert "spmd launch: process 1 was killed by signal SIGKILL; stopping the others" in r.stderr
    # Without the launcher, JAX's coordination service notices the missing heartbeats and stops the survivor.
    port = free_port()
    env = {**ENV, "SPMD_COORDINATOR": f"127.0.0.1:{port}", "SPMD_NUM_PROCESSES": "2", "SPMD_LOCAL_DEVICES": "2"}
    start = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, str(script)], env={**env, "SPMD_PROCESS_ID": str(i)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]  # fmt: skip
    _, err0 = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=10)
    assert procs[0].returncode != 0 and time.monotonic() - start <= 60
    assert "another task died" in err0 or "unhealthy" in err0, err0[-2000:]


def _steps(directory):
    """The saved steps of a checkpoint directory (beside them: the directory's lock file)."""
    return sorted(name for name in os.listdir(directory) if name.isdigit())


@pytest.mark.slow
def test_resume_onto_another_mesh_continues_the_same_run(capsys, tmp_path):
    ck = str(tmp_path / "ck")
    _, out, _ = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--layers", "2", "--mesh", "data=8", "--steps", "4", "--json"
    )
    straight = json.loads(out)["losses"]
    code, out, _ = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--layers", "2", "--mesh", "fsdp=8", "--strategy", "fsdp", "--steps",
        "2", "--checkpoint-dir", ck, "--json",
    )  # fmt: skip
    assert code == 0 and json.loads(out)["checkpoint_step"] == 2
    code, out, _ = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--layers", "2", "--mesh", "data=2,tensor=4", "--strategy", "dp+tp",
        "--steps", "4", "--checkpoint-dir", ck, "--resume", "--json",
    )  # fmt: skip
    resumed = json.loads(out)["losses"]
    assert code == 0 and len(resumed) == 2
    np.testing.assert_allclose(resumed, straight[2:], atol=1e-5)
    assert _steps(ck) == ["2", "4"]
    # A pipeline stores its layers stacked per stage; checkpoints hold the model's layout, so it resumes too.
    shutil.rmtree(os.path.join(ck, "4"))
    code, out, _ = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--layers", "2", "--mesh", "stage=2,data=4", "--strategy", "pp+dp",
        "--microbatches", "2", "--steps", "4", "--checkpoint-dir", ck, "--resume", "--json",
    )  # fmt: skip
    assert code == 0
    np.testing.assert_allclose(json.loads(out)["losses"], straight[2:], atol=1e-5)
    # Uneven tensor shares store their units padded; the checkpoint's model layout restores onto them too.
    shutil.rmtree(os.path.join(ck, "4"))
    code, out, err = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--layers", "2", "--mesh", "data=2,tensor=4", "--strategy", "dp+tp",
        "--device-speeds", "2,2,2,2,2,2,1,1", "--steps", "4", "--checkpoint-dir", ck, "--resume", "--json",
    )  # fmt: skip
    assert code == 0 and json.loads(out)["tensor_units"]["mlp"][2] < 64, err
    np.testing.assert_allclose(json.loads(out)["losses"], straight[2:], atol=1e-5)


def test_the_one_device_reference_saves_nothing(capsys, tmp_path, monkeypatch):
    # --check trains a reference on one device after the run: it opens no checkpoints of its own, and the
    # directory keeps the run's alone.
    ck, opened = tmp_path / "ck", []

    class Counted(spmd.Checkpoints):
        def __init__(self, directory, **options):
            opened.append(directory)
            super().__init__(directory, **options)

    monkeypatch.setattr(spmd, "Checkpoints", Counted)
    code, out, _ = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--layers", "2", "--mesh", "fsdp=8", "--strategy", "fsdp", "--steps",
        "2", "--checkpoint-every", "1", "--checkpoint-dir", str(ck), "--check", "--json",
    )  # fmt: skip
    assert code == 0 and json.loads(out)["max_abs_diff"] < 1e-4
    assert opened == [str(ck)]
    assert _steps(ck) == ["1", "2"]
    record = json.loads((ck / "2" / "record" / "metadata").read_text())
    assert record["mesh"] == {"fsdp": 8} and "fsdp(axis=fsdp" in record["plan"]


def _stored_layout_step(kind, model):
    """A training step whose state is not stored in the model's own layout, and its mesh sizes."""
    if kind == "pipeline":  # stacked [stage, chunk, layer, ...], uneven stages padded
        options = strategies.PipelineOptions("1f1b", 2, 1, (3, 1))
        mesh = {"stage": 2, "data": 4}
        plan = strategies.from_names("pp+dp", mesh, pipeline_options=options)
    elif kind == "fsdp-blocks":  # block-aligned shards: arrays padded
        mesh = {"fsdp": 8}
        plan = strategies.fsdp(min_bytes=0, block=128)
    else:  # owned parts copied per worker: the parameters too (forward masking) or the optimizer state only
        mesh = {"data": 8}
        plan = strategies.subnetwork_dp(coverage=0.5, granularity="neuron", masking=kind.removeprefix("sdp-"))
    narrow = lambda kept: models.loss_fn(models.narrowed(model, kept))  # noqa: E731
    params = jax.eval_shape(model.init, jax.random.key(0))
    return spmd.TrainStep(
        models.loss_fn(model),
        optax.adam(1e-3),
        plan,
        spmd.make_mesh(mesh),
        params=params,
        staged=model.staged,
        narrow=narrow,
    )


def _same(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("kind", ["pipeline", "fsdp-blocks", "sdp-forward", "sdp-backward"])
def test_every_stored_layout_converts_to_the_models_and_back(kind):
    model = models.get("gpt-tiny", layers=4)
    step = _stored_layout_step(kind, model)
    state = step.init(model.init, jax.random.key(0))
    layout = spmd.ModelLayout(step)
    assert not layout.is_identity
    exported = layout.to_model(state)
    _same(exported.params, step.params_of(state))
    # What an unsharded Adam keeps: the model's parameters and two moments shaped like them.
    single = jax.eval_shape(optax.adam(1e-3).init, exported.params)
    shapes = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]  # noqa: E731
    assert jax.tree.structure(exported.opt_state) == jax.tree.structure(single)
    assert shapes(exported.opt_state) == shapes(single)
    # Model layout -> stored -> model layout is exact, with a different value in every element of every array.
    numbered = jax.tree.map(
        lambda x: jax.device_put((np.arange(x.size) % 997).astype(x.dtype).reshape(x.shape), x.sharding), exported
    )
    _same(layout.to_model(layout.from_model(numbered)), numbered)
    # And the stored state comes back from the model layout as it was, in its own shardings.
    back = layout.from_model(exported)
    _same(back, state)
    assert jax.tree.map(lambda x: x.sharding, back) == step.shardings


@pytest.mark.slow
def test_a_save_killed_halfway_leaves_the_previous_checkpoint(tmp_path):
    ck = tmp_path / "ck"

    def spmd_run(steps, *extra):
        return [*SPMD, "run", "--model", "gpt-tiny", "--layers", "2", "--steps", str(steps), "--json", *extra]

    saving = ["--checkpoint-dir", str(ck), "--checkpoint-every", "1"]
    proc = subprocess.Popen(spmd_run(400, *saving), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    # Kill it the moment a save is in flight: orbax writes a step into a temporary directory first.
    while time.monotonic() < deadline and proc.poll() is None:
        names = os.listdir(ck) if ck.exists() else []
        if any("tmp" in n for n in names) and any(n.isdigit() for n in names):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run ended before a save could be interrupted"
    committed = sorted(int(n) for n in os.listdir(ck) if n.isdigit())
    assert committed, os.listdir(ck)
    latest = committed[-1]
    # The interrupted save is not taken for a checkpoint: resuming starts from the last committed step.
    r = subprocess.run(spmd_run(latest + 2, *saving, "--resume"), capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    straight = subprocess.run(spmd_run(latest + 2), capture_output=True, text=True, timeout=300, env=ENV)
    np.testing.assert_allclose(last_json(r.stdout)["losses"], last_json(straight.stdout)["losses"][latest:], atol=1e-5)


def test_resume_mistakes_are_explained(capsys, tmp_path):
    ck = str(tmp_path / "ck")
    base = ["run", "--model", "gpt-tiny", "--layers", "2", "--mesh", "data=8"]
    assert run_cli(capsys, *base, "--steps", "2", "--checkpoint-dir", ck, "--json")[0] == 0
    (tmp_path / "empty").mkdir()
    cases = [
        (["--checkpoint-dir", str(tmp_path / "none")], r"checkpoint directory '.*none' does not exist"),
        (["--checkpoint-dir", str(tmp_path / "empty")], r"no checkpoint in .*empty; run without --resume first"),
        (
            ["--checkpoint-dir", ck, "--layers", "1"],
            r"saved from another model or optimizer: "
            r"state.params\['params'\]\['layers'\]\['attn'\]\['key'\]\['kernel'\] "
            r"is shape \(2, 64, 4, 16\) there but shape \(1, 64, 4, 16\) here",
        ),
        (["--checkpoint-dir", ck, "--steps", "2"], r"the checkpoint is at step 2; --steps 2 asks for none more"),
    ]
    for extra, message in cases:
        code, _, err = run_cli(capsys, *base, "--steps", "4", "--resume", *extra)  # later flags win
        assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), (extra, err)
    # A corrupt checkpoint: one of its array files cut in half.
    victim = next(
        p for p in sorted((tmp_path / "ck" / "2" / "state").rglob("*")) if p.is_file() and p.stat().st_size > 1000
    )
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    code, _, err = run_cli(capsys, *base, "--steps", "4", "--resume", "--checkpoint-dir", ck)
    assert code == 2 and re.search(r"checkpoint step 2 in .* cannot be read .* corrupt", err), err
    for args, message in (
        (["--resume"], r"--resume needs --checkpoint-dir"),
        (["--resume", "--checkpoint-dir", ck, "--check"], r"--check .* cannot follow --resume"),
    ):
        code, _, err = run_cli(capsys, *base, *args)
        assert code == 2 and re.search(message, err), err


def test_explicit_axis_arrays_survive_a_round_trip(tmp_path):
    mesh = spmd.make_mesh({"data": 2, "model": 4}, explicit=True)
    sharding = NamedSharding(mesh, P("data", "model"))
    state = {"w": jax.device_put(np.arange(64.0, dtype=np.float32).reshape(8, 8), sharding), "step": np.int32(3)}
    saver = Checkpoints(str(tmp_path / "ck"))
    saver.save(3, state, {"model": "toy"})
    saver.close()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)), state
    )
    step, restored, record = Checkpoints(str(tmp_path / "ck")).restore(target)
    assert step == 3 and record["model"] == "toy"
    assert restored["w"].sharding == sharding and mesh.axis_types == restored["w"].sharding.mesh.axis_types
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
