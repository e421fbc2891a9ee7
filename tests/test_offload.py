"""Optimizer state offloaded to host memory: the plan says it, the compiled program places the state in host
memory (its shardings, the HLO's entry layout, the report's host bytes), and training equals one device."""

import json

import jax
import numpy as np
import optax
import pytest

import spmd
import strategies
from spmd import costmodel, data, models
from spmd._offload import entry_layout
from spmd._report import memory_of
from tests.conftest import assert_trees_close, run_cli, train_steps

STEPS, BATCH = 2, 16


def _model():
    return models.get("gpt-tiny", layers=2)


def _batch(model, i=0):
    return data.batch(0, i, BATCH, model.config.seq_len, model.config.vocab)


@pytest.fixture(scope="module")
def trained():
    """Training under a strategy with the optimizer state offloaded, once per module: losses, state, step."""
    cache = {}

    def get(name):
        if name not in cache:
            plan = strategies.from_names(name) + strategies.offload("optimizer")
            cache[name] = train_steps(_model(), plan, spmd.make_mesh({"data": 8}), steps=STEPS, batch_size=BATCH)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def reference():
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    losses, state, step = train_steps(_model(), spmd.Plan(), one, steps=STEPS, batch_size=BATCH)
    return losses, step.params_of(state)


def test_plan_says_what_it_offloads():
    plan = strategies.zero3() + strategies.offload("optimizer")
    assert plan.offload == ("optimizer",)
    assert plan.describe().endswith("; optimizer state offloaded to host")
    assert (plan + strategies.offload("optimizer")).offload == ("optimizer",)  # a union
    assert strategies.offload() == spmd.Plan(offload=("optimizer",))  # the default part
    assert strategies.zero3().offload == () and "offload" not in strategies.zero3().describe()
    with pytest.raises(spmd.PlanError, match=r"activations are offloaded by the layers' remat policy"):
        strategies.offload("activations")
    # Checked where the plan is made, so describe, + and the cost model never see a name the step refuses.
    with pytest.raises(spmd.PlanError, match=r"Plan\(offload=\): cannot offload 'params'; offloadable: optimizer"):
        spmd.Plan(offload=("params",))
    assert spmd.Plan(offload="optimizer").offload == ("optimizer",)  # one name, not its letters


@pytest.mark.parametrize("name", ["dp", "zero3"])
def test_offloaded_state_is_on_host_and_training_equals_one_device(name, trained, reference):
    model, mesh = _model(), spmd.make_mesh({"data": 8})
    losses, state, step = trained(name)

    # The state's shardings and arrays: the optimizer state in pinned_host, the parameters on the device.
    kinds = lambda tree: {x.memory_kind for x in jax.tree.leaves(tree)}  # noqa: E731
    assert kinds(step.shardings.opt_state) == {"pinned_host"} and kinds(step.shardings.params) == {"device"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(step.abstract_state().opt_state)} == {"pinned_host"}

    # The compiled program: every optimizer-state argument and output in host memory space, nothing else.
    compiled = step.compile(_batch(model))
    params, results = entry_layout(compiled.as_text())
    moments = len(jax.tree.leaves(state.opt_state))
    assert sum("S(5)" in p for p in params) == moments and sum("S(5)" in r for r in results) == moments
    memory, opt = memory_of(compiled), step.layout.opt_state.bytes_per_device
    assert memory["host_argument_bytes"] == memory["host_output_bytes"] == opt > 0
    batch_bytes = BATCH * model.config.seq_len * 4 // mesh.size
    assert memory["argument_bytes"] == step.layout.params.bytes_per_device + 4 + batch_bytes  # the device's

    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(step.params_of(state), ref_params)


def test_report_and_cost_model_count_the_optimizer_state_on_host():
    model, mesh = _model(), spmd.make_mesh({"data": 8})
    params = jax.eval_shape(model.init, jax.random.key(0))
    plain, offloaded = strategies.zero3(), strategies.zero3() + strategies.offload("optimizer")
    step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), offloaded, mesh, params=params)
    report = spmd.report(step, _batch(model))
    opt = step.layout.opt_state.bytes_per_device
    assert report.per_device_bytes["optimizer"] == 0 and report.per_device_bytes["host_optimizer"] == opt
    assert report.compiled_memory["host_argument_bytes"] == report.analytic_memory["host_argument_bytes"] == opt
    assert report.compiled_memory["argument_bytes"] == report.analytic_memory["argument_bytes"]
    assert report.analytic_memory["host_transfer_bytes"] == 2 * opt
    assert "host: arguments (offloaded state)" in str(report)

    workload, hw = costmodel.Workload(batch=BATCH, seq_len=model.config.seq_len), costmodel.HARDWARE["h100"]
    kw = {"optimizer": optax.adam(1e-3), "hardware": hw}
    a = costmodel.estimate(plain, params, dict(mesh.shape), workload, **kw)
    b = costmodel.estimate(offloaded, params, dict(mesh.shape), workload, **kw)
    assert b.host_bytes == a.per_device_bytes["optimizer"] == opt
    assert b.per_device_bytes["total"] == a.per_device_bytes["total"] - opt
    assert b.traffic == a.traffic  # the collectives are the same; the transfer is its own kind
    act = a.activation_bytes  # the state comes in for the update, after the backward pass frees the activations
    assert b.memory_bytes == a.memory_bytes - opt - act + max(act, opt)
    assert [(t.kind, t.axes, t.bytes) for t in b.host_traffic] == [("host-transfer", (), 2 * opt)]
    assert b.time.comm_s == pytest.approx(a.time.comm_s + 2 * opt / hw.host_bandwidth + 2 * hw.ici_latency)


def test_checkpoints_move_between_offloaded_and_device_state(tmp_path, trained):
    model, mesh = _model(), spmd.make_mesh({"data": 8})
    _, state, step = trained("zero3")
    saved = spmd.ModelLayout(step).to_model(state)
    with spmd.Checkpoints(str(tmp_path), asynchronous=False) as ck:
        ck.save(STEPS, saved, {"model": "gpt-tiny"})
    params = jax.eval_shape(model.init, jax.random.key(0))
    for plan, kind in ((strategies.data_parallel(), "device"), (step.plan, "pinned_host")):
        other = spmd.TrainStep(models.loss_fn(model), optax.sgd(0.1, momentum=0.9), plan, mesh, params=params)
        layout = spmd.ModelLayout(other)
        with spmd.Checkpoints(str(tmp_path), asynchronous=False) as ck:
            restored = layout.from_model(ck.restore(layout.abstract())[1])
        assert {x.sharding.memory_kind for x in jax.tree.leaves(restored.opt_state)} == {kind}
        assert_trees_close(restored.opt_state, state.opt_state, rtol=0, atol=0)
        assert_trees_close(other.params_of(restored), step.params_of(state), rtol=0, atol=0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "--offload", "params"], "--offload 'params': cannot offload 'params'; choose from"),
        (["plan", "--offload", "activations", "--remat", "full"], "--remat full asks for another policy: drop one"),
        (["run", "--offload", "optimizer,grads"], "cannot offload 'grads'; choose from optimizer"),
        (["suggest", "--offload", "optimizer", "--memory-per-device", "1GiB"], "--offload does not apply to suggest"),
    ],
)
def test_bad_offload_flags_exit_2_with_one_line(capsys, args, message):
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_the_plan_command_shows_the_offloaded_state_on_host(capsys):
    code, out, _ = run_cli(capsys, "plan", "--offload", "optimizer", "--strategy", "zero3", "--layers", "1", "--json")
    report = json.loads(out)
    assert code == 0 and report["plan"].endswith("optimizer state offloaded to host")
    host = report["compiled_memory"]["host_argument_bytes"]
    assert host == report["analytic_memory"]["host_argument_bytes"] == report["per_device_bytes"]["host_optimizer"]


def test_offloading_activations_keeps_the_layers_matmul_outputs_on_the_host(capsys):
    # --offload activations is the remat policy that keeps what dots keeps, on the host: the same matmuls run.
    # This backend lowers the moves to nothing (see the README), so the plan and the estimate say it.
    args = ("plan", "--strategy", "zero3", "--layers", "1", "--json")
    code, out, err = run_cli(capsys, *args, "--offload", "optimizer,activations")
    assert code == 0, err
    report = json.loads(out)
    assert "offloaded to host: query_proj, key_proj, value_proj, attn_out, out_proj, mlp_hidden, mlp_out" in report[
        "plan"
    ] and report["plan"].endswith("optimizer state offloaded to host")
    code, out, _ = run_cli(capsys, *args)
    dots = json.loads(out)
    assert report["compiled_flops_per_device"] == dots["compiled_flops_per_device"]  # nothing more recomputed
