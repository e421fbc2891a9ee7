"""Gradient accumulation: K microbatches per step equal one device on the whole batch, and the plain step reduces
its gradients once per step, read from the compiled program."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import spmd
import strategies
from spmd import costmodel, data, models
from spmd._hlo import collectives
from tests.conftest import assert_trees_close, run_cli, train_steps

STEPS, BATCH = 2, 32


def _model(layers=1):
    return models.get("gpt-tiny", layers=layers)


def _one():
    return spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def reference():
    """One device, the whole batch, no accumulation."""
    losses, state, step = train_steps(_model(), spmd.Plan(), _one(), steps=STEPS, batch_size=BATCH)
    return losses, step.params_of(state)


def _assert_equal(run, reference):
    losses, state, step = run
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    assert_trees_close(step.params_of(state), reference[1])


def _compiled_step(plan, mesh):
    """A step of ``plan`` compiled for the tests' batch, never run."""
    params = jax.eval_shape(_model().init, jax.random.key(0))
    return spmd.TrainStep(models.loss_fn(_model()), optax.sgd(0.1, momentum=0.9), plan, mesh, params=params)


def _reductions(step, mesh):
    """Per compiled step: {kind: (ops run, bytes moved)} over every mesh axis."""
    b = data.batch(0, 0, BATCH, 32, 256)
    out = {}
    for c in collectives(step.compile(b).as_text(), mesh):
        ops, size = out.get(c.kind, (0, 0))
        out[c.kind] = (ops + c.count, size + c.bytes)
    return out


def _assert_once(step, base, mesh):
    """The same collectives, moving the same bytes per step, as the step without accumulation: every gradient
    reduced once, not once per microbatch (in as many or fewer ops: the compiler may combine them otherwise)."""
    without, with_k = _reductions(base, mesh), _reductions(step, mesh)
    assert set(with_k) == set(without)
    for kind, (ops, size) in with_k.items():
        assert size == without[kind][1], kind
        assert ops <= without[kind][0], kind
    return with_k


def test_dp_reduces_gradients_once_per_step_and_equals_one_device(reference):
    mesh = spmd.make_mesh({"data": 8})
    base = _compiled_step(strategies.data_parallel(), mesh)
    run = train_steps(_model(), strategies.data_parallel().with_accumulation(4), mesh, steps=STEPS, batch_size=BATCH)
    _assert_equal(run, reference)
    assert set(_assert_once(run[2], base, mesh)) == {"all-reduce"}
    temp = lambda step: step.compile(data.batch(0, 0, BATCH, 32, 256)).memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(run[2]) < temp(base)


def test_zero2_reduce_scatters_once_and_equals_one_device(reference):
    mesh = spmd.make_mesh({"data": 8})
    run = train_steps(_model(), strategies.zero2().with_accumulation(2), mesh, steps=STEPS, batch_size=BATCH)
    _assert_equal(run, reference)
    base = _compiled_step(strategies.zero2(), mesh)
    assert set(_assert_once(run[2], base, mesh)) == {"all-reduce", "reduce-scatter", "all-gather"}


def test_dp_fsdp_equals_one_device(reference):
    mesh = spmd.make_mesh({"data": 4, "fsdp": 2})
    plan = strategies.from_names("dp+fsdp").with_accumulation(2)
    run = train_steps(_model(), plan, mesh, steps=STEPS, batch_size=BATCH)
    _assert_equal(run, reference)


@pytest.mark.slow
def test_pipeline_accumulates_whole_schedules():
    mesh_axes = {"stage": 2, "data": 4}
    options = strategies.PipelineOptions("1f1b", 2, 1, None)
    plan = strategies.from_names("pp+dp", mesh_axes, pipeline_options=options).with_accumulation(2)
    ref = train_steps(_model(4), spmd.Plan(), _one(), steps=STEPS, batch_size=16)
    run = train_steps(_model(4), plan, spmd.make_mesh(mesh_axes), steps=STEPS, batch_size=16)
    _assert_equal(run, (ref[0], ref[2].params_of(ref[1])))


@pytest.mark.slow
def test_uneven_shares_of_one_microbatch_equal_one_device(reference):
    plan = strategies.hetero.uneven_data_parallel((4, 4, 1, 1, 1, 1, 2, 2)).with_accumulation(2)
    _assert_equal(train_steps(_model(), plan, spmd.make_mesh({"data": 8}), steps=STEPS, batch_size=BATCH), reference)


@pytest.mark.slow
@pytest.mark.parametrize("masking", ["forward", "backward"])
def test_subnetworks_accumulate_to_their_whole_batch_update(masking):
    model, mesh = _model(4), spmd.make_mesh({"data": 8})
    params = jax.eval_shape(model.init, jax.random.key(0))

    def run(plan):
        step = spmd.TrainStep(
            models.loss_fn(model), optax.sgd(0.1, momentum=0.9), plan, mesh, params=params,
            narrow=lambda kept: models.loss_fn(models.narrowed(model, kept)),
        )  # fmt: skip
        state, losses = step.init(model.init, jax.random.key(0)), []
        for i in range(STEPS):
            state, loss = step(state, data.batch(0, i, BATCH, model.config.seq_len, model.config.vocab))
            losses.append(float(loss))
        return np.array(losses), step.params_of(state)

    plan = strategies.subnetwork_dp(masking=masking)
    got, want = run(plan.with_accumulation(2)), run(plan)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert_trees_close(got[1], want[1])


def test_a_drawing_loss_folds_the_microbatch_into_its_key():
    def loss(p, b, *, key):
        keep = jax.random.bernoulli(key, 0.5, b["x"].shape)
        return jnp.mean((jnp.where(keep, b["x"], 0.0) @ p["w"]) ** 2)

    params = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
    init = lambda rng: {"w": jax.random.normal(rng, (4, 2))}  # noqa: E731
    batch = {"x": jnp.arange(64.0).reshape(16, 4) / 64}

    def run(plan, mesh):
        step = spmd.TrainStep(loss, optax.sgd(0.1), plan, mesh, params=params, seed=3)
        return step(step.init(init, jax.random.key(0)), batch)

    sharded = run(strategies.data_parallel().with_accumulation(2), spmd.make_mesh({"data": 8}))
    alone = run(spmd.Plan().with_accumulation(2), spmd.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    unfolded = run(spmd.Plan(), spmd.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    np.testing.assert_allclose(float(sharded[1]), float(alone[1]), rtol=1e-6)
    assert_trees_close(sharded[0].params, alone[0].params)
    assert float(unfolded[1]) != float(alone[1])  # the microbatch index really is folded in


def test_plan_setting_and_its_mistakes():
    plan = strategies.data_parallel().with_accumulation(4)
    assert plan.accumulate == 4 and "gradients accumulated over 4 microbatches" in plan.describe()
    assert (plan + strategies.fsdp()).accumulate == 4
    assert (plan + spmd.Plan(accumulate=4)).accumulate == 4
    with pytest.raises(spmd.PlanError, match="over 4 microbatches, the other over 2"):
        plan + spmd.Plan(accumulate=2)
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(spmd.PlanError, match=r"positive integer, got"):
            spmd.Plan().with_accumulation(bad)
    step = spmd.TrainStep(
        models.loss_fn(_model(1)), optax.sgd(0.1), plan, spmd.make_mesh({"data": 8}),
        params=jax.eval_shape(_model(1).init, jax.random.key(0)),
    )  # fmt: skip
    with pytest.raises(spmd.PlanError, match=r"batch of 16 cannot be split into 4 microbatches .* multiple of 32"):
        step.lower(data.batch(0, 0, 16, 32, 256))


def test_cost_model_keeps_one_microbatch_and_gathers_per_microbatch():
    model = _model()
    params = jax.eval_shape(model.init, jax.random.key(0))
    plan, sizes = strategies.from_names("dp+fsdp"), {"data": 4, "fsdp": 2}
    workload = costmodel.Workload(batch=BATCH, seq_len=model.config.seq_len)

    def estimate(k):
        e = costmodel.estimate(
            plan.with_accumulation(k) if k > 1 else plan, params, sizes, workload,
            optimizer=optax.adam(1e-3), hardware=costmodel.HARDWARE["cpu"],
        )  # fmt: skip
        return e, {(t.kind, t.axes): t.traffic_bytes for t in e.traffic}

    (one, moved1), (four, moved4) = estimate(1), estimate(4)
    assert four.activation_bytes == pytest.approx(one.activation_bytes / 4, rel=0.01)
    assert one.accumulator_bytes == 0 and four.accumulator_bytes == one.per_device_bytes["params"]  # float32 model
    assert four.flops == one.flops
    assert moved4[("all-reduce", ("data",))] == moved1[("all-reduce", ("data",))]
    for kind in ("all-gather", "reduce-scatter"):
        assert moved4[(kind, ("fsdp",))] == pytest.approx(4 * moved1[(kind, ("fsdp",))])


@pytest.mark.slow
def test_cli_run_accumulated_is_checked_against_one_device(capsys):
    code, out, _ = run_cli(
        capsys, "run", "--model", "gpt-tiny", "--layers", "2", "--mesh", "data=8", "--strategy", "dp",
        "--accumulate", "2", "--steps", "2", "--check", "--json", "--batch-size", "16",
    )  # fmt: skip
    result = json.loads(out)
    assert code == 0 and result["max_abs_diff"] <= 1e-4
    assert "gradients accumulated over 2 microbatches" in result["plan"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "--accumulate must be a positive integer, got 0"),
        ("-1", "--accumulate must be a positive integer, got -1"),
        ("two", "argument --accumulate: invalid int value: 'two'"),
        ("3", "a batch of 32 cannot be split into 3 microbatches"),
    ],
)
def test_cli_accumulate_mistakes(capsys, value, message):
    code, _, err = run_cli(capsys, "plan", "--mesh", "data=8", "--layers", "1", f"--accumulate={value}")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


class _Constrained(nn.Module):
    """A model constraining its hidden layer by flax's logical names, or by a bare PartitionSpec over ``data``."""

    bare: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16)(x)
        if self.bare:
            h = jax.lax.with_sharding_constraint(h, jax.sharding.PartitionSpec("data", None))
        else:
            h = nn.with_logical_constraint(h, ("batch", "mlp"))
        return nn.Dense(1)(nn.relu(h))[:, 0]


@pytest.mark.parametrize("bare", [False, True], ids=["logical", "bare-spec"])
def test_a_model_constraining_its_own_layout_accumulates_equal_to_one_device(bare):
    model, mesh = _Constrained(bare), spmd.make_mesh({"data": 8})
    init = lambda rng: model.init(rng, jnp.ones((8, 4)))  # noqa: E731
    with jax.set_mesh(mesh):
        params = jax.eval_shape(init, jax.random.key(0))
    loss = lambda p, b: jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)  # noqa: E731
    batch = {"x": jax.random.normal(jax.random.key(1), (32, 4)), "y": jnp.arange(32.0) / 32}

    def run(plan):
        step = spmd.TrainStep(loss, optax.sgd(0.1), plan, mesh, params=params)
        state, value = step(step.init(init, jax.random.key(0)), batch)
        return float(value), state.params, collectives(step.compile(batch).as_text(), mesh)

    whole = run(strategies.data_parallel())
    if bare:  # the program cannot run manual over data: reduced per microbatch, and said so
        with pytest.warns(spmd.PlanWarning, match="reduced once per microbatch"):
            accumulated = run(strategies.data_parallel().with_accumulation(2))
    else:
        accumulated = run(strategies.data_parallel().with_accumulation(2))
        assert sum(c.bytes for c in accumulated[2]) == sum(c.bytes for c in whole[2])
    np.testing.assert_allclose(accumulated[0], whole[0], rtol=1e-6)
    assert_trees_close(accumulated[1], whole[1])
