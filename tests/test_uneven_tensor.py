"""Uneven tensor parallelism (HAP): heads and hidden units divided over the tensor axis by device speed, stored
padded; a slow device holds and computes fewer units (read from the compiled program) and the step equals one
device's; the planner's units and their refusals, the conversions, and the command line."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest

import spmd
import strategies
from spmd import costmodel, data, models
from spmd.devices import Profile
from spmd.execution import TensorShares, UnevenTensor
from strategies import hetero, tensor_shares
from tests.conftest import run_checked, run_cli, train_steps


def _tiny():
    model = models.get("gpt-tiny", layers=2)
    return model, jax.eval_shape(model.init, jax.random.key(0))


def test_slow_tensor_devices_hold_and_compute_fewer_units_and_the_step_equals_one_device():
    """Speeds 2:1 along tensor (each tensor pair mixes the kinds): heads 3 and 1, hidden units 184 and 72 (the
    slow device's share below a third: both also run the unsplit embeddings and head). The compiled program's
    FLOPs per tensor position (its own branch of every unit switch) are the cost model's for those units; two
    SGD steps equal one device's and the padding stays zero."""
    model, params = _tiny()
    sizes = {"data": 4, "tensor": 2}
    profile = Profile.from_speeds([2, 1] * 4)
    plan = strategies.data_parallel() + strategies.tensor_parallel()
    workload = costmodel.Workload(8, model.config.seq_len)
    plan = hetero.apply_profile(plan, sizes, profile, params=params, workload=workload, optimizer=optax.sgd(0.1))
    assert plan.execution == TensorShares("tensor", (("heads", (3, 1)), ("mlp", (184, 72))))
    losses, state, step = train_steps(model, plan, spmd.make_mesh(sizes), steps=2, batch_size=8)
    batch = data.batch(0, 0, 8, model.config.seq_len, model.config.vocab)
    report = spmd.report(step, batch)
    assert report.execution.figures["units"] == {"heads": [3, 1], "mlp": [184, 72]}
    even, at = tensor_shares.tensor_position_flops(plan, params, sizes, workload)
    np.testing.assert_allclose(report.compiled_flops_by_position, at, rtol=1e-6)
    assert report.compiled_flops == report.compiled_flops_by_position[0] == report.flops_per_device
    assert at[1] < 0.6 * at[0] and at[1] < even < at[0]
    # Stored padded: 2 × 184 units, the slow position's last 112 zeros after training.
    wi = np.asarray(state.params["params"]["layers"]["mlp"]["wi"]["kernel"])
    assert wi.shape == (2, 64, 368) and not wi[..., 184 + 72 :].any() and wi[..., 184 + 71].any()
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    ref_losses, ref_state, ref = train_steps(model, spmd.Plan(), one, steps=2, batch_size=8)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(step.params_of(state)), jax.tree.leaves(ref.params_of(ref_state)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # the default tier checks data=4 × tensor=2 through the API
def test_uneven_tensor_shares_on_four_tensor_devices_equal_one_device():
    model, _ = _tiny()
    units = (("heads", (1, 1, 1, 1)), ("mlp", (100, 80, 40, 36)))
    plan = dataclasses.replace(strategies.tensor_parallel(), execution=TensorShares("tensor", units))
    plan = strategies.data_parallel() + plan
    losses, state, step = train_steps(model, plan, spmd.make_mesh({"data": 2, "tensor": 4}), steps=2, batch_size=8)
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    ref_losses, ref_state, ref = train_steps(model, spmd.Plan(), one, steps=2, batch_size=8)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(step.params_of(state)), jax.tree.leaves(ref.params_of(ref_state)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("mesh", "strategy", "speeds", "mlp"),
    [
        # Six fast devices and two slow: one tensor group is all fast, the other mixes the kinds 2, 2, 1, 1.
        ("data=2,tensor=4", "dp+tp", "2,2,2,2,2,2,1,1", [89, 89, 39, 39]),
        pytest.param("fsdp=2,tensor=4", "fsdp+tp", "2,2,2,2,2,2,1,1", [89, 89, 39, 39], marks=pytest.mark.slow),
    ],
)
def test_cli_run_uneven_tensor_shares_checked(capsys, mesh, strategy, speeds, mlp):
    j = run_checked(capsys, mesh, strategy, speeds, 8)
    assert j["tensor_units"]["mlp"] == mlp and j["max_abs_diff"] <= 1e-4


def test_cli_plan_prices_uneven_tensor_shares_and_refuses_a_device_without_units(capsys):
    code, out, err = run_cli(
        capsys, "plan", "--model", "gpt-tiny", "--mesh", "data=2,tensor=4", "--strategy", "dp+tp",
        "--device-speeds", "2,2,2,2,2,2,1,1", "--batch-size", "8", "--json",
    )  # fmt: skip
    assert code == 0, err
    j = json.loads(out)
    assert j["tensor_shares"]["units"]["mlp"] == [89, 89, 39, 39] and j["tensor_shares"]["padded_units"]["mlp"] == 356
    by_position = j["compiled_flops_by_position"]
    assert by_position[2] == by_position[3] < by_position[0] == by_position[1] == j["compiled_flops_per_device"]
    assert 1 < j["simulated_speedup"] <= j["ideal_speedup"] == 1.5
    code, _, err = run_cli(
        capsys, "plan", "--model", "gpt-tiny", "--mesh", "data=2,tensor=4", "--strategy", "dp+tp",
        "--device-speeds", "9,9,9,9,9,9,9,1", "--batch-size", "8",
    )  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "tensor position 3 (devices 3, 7) gets none of the model's 4 heads units" in err


def test_conversions_validation_and_refusals():
    """The padded layout and back is the identity; shares that do not fit the model, a weight without the padded
    units, context parallelism (exchanges inside per-device branches) and zero counts are refused."""
    model, params = _tiny()
    spec = TensorShares("tensor", (("heads", (3, 1)), ("mlp", (171, 85))))
    engine = UnevenTensor(spec, params)
    real = model.init(jax.random.key(0))
    stored = engine.to_stored(jax.tree.map(lambda x: x, real))
    plain = lambda tree: jax.tree.leaves(tree)  # noqa: E731
    for a, b in zip(plain(engine.to_model(plain_values(stored))), plain(plain_values(real)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(spmd.PlanError, match="divides 4 mlp units .* and the model has 256"):
        UnevenTensor(TensorShares("tensor", (("mlp", (3, 1)),)), params)
    with pytest.raises(ValueError, match="one positive count per position"):
        TensorShares("tensor", (("heads", (4, 0)),))
    with pytest.raises(ValueError, match="units is empty"):
        TensorShares("tensor", ())
    x = jax.numpy.ones((2, 64))
    with spmd.activate(
        dataclasses.replace(strategies.tensor_parallel(), execution=spec), spmd.make_mesh({"tensor": 2, "data": -1})
    ):
        with pytest.raises(spmd.PlanError, match="has 256 mlp units along dimension 1, and the plan stores 2 × 171"):
            spmd.unit_sum(lambda x, w: x @ w, x, (jax.numpy.ones((64, 256)),), (1,), "mlp")
    # A loss that never calls spmd.unit_sum would compute every padded unit on every device: refused.
    plan = dataclasses.replace(strategies.tensor_parallel(), execution=spec)
    task = spmd.execution.Task(
        models.loss_fn(model), plan, spmd.make_mesh({"tensor": 2, "data": -1}), params,
        narrow=lambda sizes: lambda p, b: jax.numpy.sum(p["params"]["layers"]["mlp"]["wi"]["kernel"]),
    )  # fmt: skip
    executor = spmd.execution.tensor_shares_executor(spec, task)
    with pytest.warns(spmd.PlanWarning, match=r"ran no block over \['heads', 'mlp'\] through spmd.unit_sum"):
        executor.value_and_grad(executor.to_stored(plain_values(real)), None)
    # The executor's refusals: no narrow, no axis, another number of positions, units not split over the axis.
    mesh = spmd.make_mesh({"tensor": 2, "data": -1})
    for changes, message in (
        ({"narrow": None}, r"pass TrainStep\(\.\.\., narrow="),
        ({"mesh": spmd.make_mesh({"data": -1})}, "the mesh has no such axis"),
        ({"mesh": spmd.make_mesh({"tensor": 4, "data": -1})}, "2 positions of 'tensor', and the mesh has 4"),
        ({"plan": dataclasses.replace(strategies.data_parallel(), execution=spec)}, "not over 'tensor' alone"),
    ):
        bad = task._replace(**{"mesh": mesh, **changes})
        with pytest.raises(spmd.PlanError, match=message):
            spmd.execution.tensor_shares_executor(spec, bad)
    with pytest.raises(ValueError, match="names a dimension twice"):
        TensorShares("tensor", (("mlp", (1, 1)), ("mlp", (1, 1))))
    with pytest.raises(ValueError, match="already runs uneven shares"):
        hetero.apply_profile(
            strategies.tensor_parallel() + hetero.uneven_data_parallel((4, 4, 4, 4)), {"data": 4, "tensor": 2},
            Profile.from_speeds([2, 1] * 4), params=params, workload=costmodel.Workload(16, 32),
            optimizer=optax.sgd(0.1),
        )  # fmt: skip
    plan = strategies.data_parallel() + strategies.context_parallel() + strategies.tensor_parallel()
    with pytest.raises(spmd.PlanError, match="does not compose with uneven tensor shares .* inside per-device"):
        assert dataclasses.replace(plan, execution=spec).context is None


def plain_values(tree):
    """Boxed parameters as plain arrays."""
    return jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, tree, is_leaf=lambda x: hasattr(x, "names"))


def test_the_planner_prices_uneven_tensor_shares_where_a_tensor_axis_mixes_speeds():
    """``suggest.rank`` with a profile gives a tensor-only mesh whose positions differ in speed uneven heads and
    units, and its modelled step on those devices beats the even split's, which the slow devices pace."""
    from strategies import suggest

    _, params = _tiny()
    ranked, _ = suggest.rank(
        params, costmodel.Workload(256, 32), costmodel.HARDWARE["cpu"], devices=4, memory_per_device=1 << 34,
        optimizer=optax.adam(1e-3), max_tensor=4, profile=Profile.from_speeds([2, 2, 1, 1]),
    )  # fmt: skip
    tp = [s for s in ranked if s.mesh == {"tensor": 4} and s.strategy == "tp"]
    uneven = next(s for s in tp if isinstance(s.plan.execution, TensorShares))
    even = next(s for s in tp if "--even" in s.flags)
    assert uneven.plan.execution.of("mlp")[0] > uneven.plan.execution.of("mlp")[3]
    assert uneven.profiled_s < 0.85 * even.profiled_s


def test_a_plain_jax_block_is_counted_per_position_under_grad():
    """``unit_sum`` as the outermost scope of a plain-JAX loss: JAX names its switch ``jvp(...)`` and
    ``transpose(jvp(...))``, and the compiled counts still weigh each position's own branch."""
    from spmd._hlo import matmul_flops

    spec = TensorShares("tensor", (("mlp", (3, 2)),))
    mesh = spmd.make_mesh({"tensor": 2, "data": -1})
    plan = dataclasses.replace(strategies.tensor_parallel(), execution=spec)
    block = lambda x, wi, wo: jax.nn.gelu(x @ wi) @ wo  # noqa: E731

    def loss(x, wi, wo):
        return jax.numpy.sum(spmd.unit_sum(block, x, (wi, wo), (1, 0), "mlp") ** 2)

    x, wi, wo = jax.numpy.ones((8, 16)), jax.numpy.ones((16, 6)), jax.numpy.ones((6, 16))
    with spmd.activate(plan, mesh):
        text = jax.jit(jax.grad(loss, argnums=(1, 2))).lower(x, wi, wo).compile().as_text()
    counts = [matmul_flops(text, branch_weights={"spmd_tensor_units": w}) for w in ((1, 0), (0, 1))]
    # Two 8 × 16 × units matmuls forward; backward, both weights' gradients and the hidden one's: 3 units and 2.
    assert counts == [5 * 2 * 8 * 16 * 3, 5 * 2 * 8 * 16 * 2]
