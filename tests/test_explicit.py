"""Meshes with Explicit axes (``jax.make_mesh``'s default): every strategy trains on them as on Auto axes, the
state keeps its Explicit types, checkpoints restore onto them, and ``spmd.constrain`` works in either mode."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
import strategies
from spmd import data, models
from tests.conftest import assert_trees_close, run_cli, train_steps

STEPS, BATCH = 3, 16
# Each of dp, fsdp and tp on at least two meshes.
DEFAULT = {
    "dp": {"data": 8},
    "fsdp": {"fsdp": 8},
    "dp+tp": {"data": 2, "tensor": 4},
    "fsdp+tp": {"fsdp": 4, "tensor": 2},
    "dp+fsdp": {"data": 4, "fsdp": 2},
}


def _model():
    return models.get("gpt-tiny", layers=1)


def _train(plan, mesh):
    return train_steps(_model(), plan, mesh, steps=STEPS, batch_size=BATCH)


@pytest.fixture(scope="module")
def one_device():
    return _train(spmd.Plan(), spmd.make_mesh({"data": 1}, devices=jax.devices()[:1]))


def _types(tree):
    return {kind for x in jax.tree.leaves(tree) for kind in x.sharding.mesh.axis_types}


@pytest.mark.parametrize("name", DEFAULT)
def test_a_strategy_on_explicit_axes_equals_one_device_and_keeps_the_types(one_device, name):
    mesh = spmd.make_mesh(DEFAULT[name], explicit=True)
    losses, state, step = _train(strategies.from_names(name, DEFAULT[name]), mesh)
    ref_losses, ref_state, _ = one_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert _types(state) == {AxisType.Explicit}
    # The layout is in the arrays' types: the kernel's split is what the plan asked.
    kernel = state.params["params"]["layers"]["mlp"]["wi"]["kernel"]
    assert jax.typeof(kernel).sharding.spec == step.shardings.params["params"]["layers"]["mlp"]["wi"]["kernel"].spec


def test_checkpoints_restore_onto_explicit_axes_keeping_them(tmp_path):
    # Saved from FSDP on Auto axes, restored onto a pipeline on Explicit axes: the model's own layout in between,
    # the stages stacked again by the step's conversion, and every restored array typed Explicit.
    model = models.get("gpt-tiny", layers=2)
    params = jax.eval_shape(model.init, jax.random.key(0))
    fsdp = strategies.fsdp()
    saving = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), fsdp, spmd.make_mesh({"fsdp": 8}), params=params)
    state = saving.init(model.init, jax.random.key(0))
    with spmd.Checkpoints(str(tmp_path / "ck"), asynchronous=False) as checkpoints:
        checkpoints.save(1, spmd.ModelLayout(saving).to_model(state), {"model": "gpt-tiny"})
    mesh = spmd.make_mesh({"stage": 2, "fsdp": 4}, explicit=True)
    pp = fsdp + strategies.pipeline(stages=2, microbatches=2)
    step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), pp, mesh, params=params, staged=model.staged)
    layout = spmd.ModelLayout(step)
    assert not layout.is_identity  # the stages are stacked: the conversion runs
    with spmd.Checkpoints(str(tmp_path / "ck")) as checkpoints:
        _, restored, _ = checkpoints.restore(layout.abstract())
    resumed = layout.from_model(restored)
    assert _types(restored) == _types(resumed) == {AxisType.Explicit}
    assert_trees_close(step.params_of(resumed), saving.params_of(state), rtol=0, atol=0)
    resumed, loss = step(resumed, data.batch(0, 0, BATCH, model.config.seq_len, model.config.vocab))
    assert np.isfinite(float(loss)) and _types(resumed) == {AxisType.Explicit}


def test_a_mesh_mixing_explicit_and_auto_axes_is_refused():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit, AxisType.Auto))
    params = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    with pytest.raises(ValueError, match=r"mesh axes of types data: Explicit, fsdp: Auto; a plan needs every axis"):
        spmd.TrainStep(lambda p, b: 0.0, optax.sgd(0.1), strategies.fsdp(), mesh, params=params)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_constrain_lays_out_in_either_mode_inside_and_outside_jit(explicit):
    mesh = spmd.make_mesh({"data": 4, "tensor": 2}, explicit=explicit)
    plan = strategies.data_parallel() + strategies.tensor_parallel()
    x = jax.device_put(jnp.arange(128.0).reshape(8, 16), NamedSharding(mesh, P("data")))

    def double(x):
        with spmd.activate(plan, mesh):
            return spmd.constrain(2 * x, ("batch", "mlp"))

    for y in (jax.jit(double)(x), double(x)):
        assert y.sharding.spec == P("data", "tensor") and y.sharding.mesh.axis_types == mesh.axis_types
        np.testing.assert_array_equal(np.asarray(y), 2 * np.arange(128.0).reshape(8, 16))


def test_the_command_line_uses_explicit_axes_unless_told_otherwise(capsys):
    args = ["run", "--layers", "1", "--batch-size", "16", "--steps", "2", "--json", "--strategy", "dp+fsdp+tp"]
    args += ["--mesh", "data=2,fsdp=2,tensor=2"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    code, auto, err = run_cli(capsys, *args, "--axis-types", "auto")
    assert code == 0, err
    explicit, auto = json.loads(out), json.loads(auto)
    assert (explicit["axis_types"], auto["axis_types"]) == ("explicit", "auto")
    assert explicit["losses"] == auto["losses"]  # one compiled program: the same numbers


# Every other strategy and execution mode through the command line, Explicit against Auto axes.
SLOW = {
    "zero1": ["--mesh", "data=8"],
    "zero2+tp": ["--mesh", "data=4,tensor=2"],
    "zero3": ["--mesh", "data=8"],
    "hsdp": ["--mesh", "data=2,fsdp=4"],
    "dp+sp": ["--mesh", "data=2,tensor=4"],
    "tp2d": ["--mesh", "tensor=2,tensor2=4"],
    "fsdp-block": ["--mesh", "fsdp=8", "--block", "16"],
    "osdp": ["--mesh", "data=8", "--memory-per-device", "2MiB"],
    "dp+ep": ["--mesh", "data=2,expert=4", "--model", "moe-tiny"],
    "dp+pp-1f1b": ["--mesh", "data=2,stage=4", "--layers", "4", "--microbatches", "4", "--schedule", "1f1b"],
    "pp-zb-h1": ["--mesh", "stage=8", "--layers", "8", "--microbatches", "8", "--schedule", "zb-h1"],
    "fsdp+tp+pp-interleaved": ["--mesh", "stage=2,fsdp=2,tensor=2", "--layers", "4", "--schedule", "interleaved"],
    "dp-uneven": ["--mesh", "data=8", "--device-speeds", "3,3,1,1,1,1,2,2"],
    "dp+pp-uneven": [
        "--mesh",
        "stage=2,data=4",
        "--layers",
        "4",
        "--microbatches",
        "4",
        "--device-speeds",
        "3,3,3,3,1,1,1,1",
    ],
    "sdp-forward": ["--mesh", "data=8"],
    "sdp-backward": ["--mesh", "data=8", "--masking", "backward"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW)
def test_every_mode_trains_on_explicit_axes_as_on_auto_axes(capsys, case):
    strategy = case.split("-")[0]
    args = ["run", "--strategy", strategy, "--batch-size", "16", "--steps", "2", "--json", *SLOW[case]]
    if "--layers" not in args:
        args += ["--layers", "2"]
    runs = {}
    for kind in ("auto", "explicit"):
        code, out, err = run_cli(capsys, *args, "--axis-types", kind)
        assert code == 0, err
        runs[kind] = json.loads(out)
        assert runs[kind]["axis_types"] == kind
    np.testing.assert_allclose(runs["explicit"]["losses"], runs["auto"]["losses"], rtol=1e-6)
    assert runs["explicit"]["per_device_bytes"] == runs["auto"]["per_device_bytes"]
