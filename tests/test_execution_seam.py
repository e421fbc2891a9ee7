"""The execution seam: a new execution mode is one spec and one executor, with no change to the training step,
the report, checkpoints or the plan. Two toy modes show it: one scales the loss, one stores its parameters
doubled (so the step, ``params_of`` and checkpoint conversions all go through ``to_stored``/``to_model``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
import strategies
from spmd.execution import ExecutionSpec, Executor, Task
from tests.conftest import assert_trees_close

BATCH = 16


@dataclasses.dataclass(frozen=True)
class ScaledLoss(ExecutionSpec):
    """Differentiates ``factor`` times the loss."""

    factor: float
    source = "scaled loss"

    def describe(self) -> str:
        return f"loss scaled by {self.factor:g}"

    def executor(self, task: Task) -> Executor:
        def value_and_grad(params, batch):
            return jax.value_and_grad(lambda p: self.factor * task.loss(p, batch))(params)

        return Executor(value_and_grad)


@dataclasses.dataclass(frozen=True)
class Doubled(ExecutionSpec):
    """Stores every parameter doubled; the model sees it halved."""

    axis: str = "data"

    def axes(self) -> frozenset[str]:
        return frozenset((self.axis,))

    def executor(self, task: Task) -> Executor:
        halve = lambda tree: jax.tree.map(lambda x: x / 2, tree)  # noqa: E731

        def double(tree):  # takes abstract trees too: the step lays out what it returns
            return jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else x * 2, tree)

        def value_and_grad(stored, batch):
            return jax.value_and_grad(lambda s: task.loss(halve(s), batch))(stored)

        return Executor(value_and_grad, to_stored=double, to_model=halve)


def _loss(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)


def _init(rng):
    a, b = jax.random.split(rng)
    return {"w1": jax.random.normal(a, (8, 32)) / 3, "w2": jax.random.normal(b, (32, 4)) / 6}


def _batch(i):
    rng = np.random.default_rng(i)
    return {"x": rng.normal(size=(BATCH, 8)).astype(np.float32), "y": rng.normal(size=(BATCH, 4)).astype(np.float32)}


def _train(plan, optimizer, steps=3):
    mesh = spmd.make_mesh({"data": -1})
    step = spmd.TrainStep(_loss, optimizer, plan, mesh, params=jax.eval_shape(_init, jax.random.key(0)))
    state = step.init(_init, jax.random.key(0))
    losses = []
    for i in range(steps):
        state, loss = step(state, _batch(i))
        losses.append(float(loss))
    return losses, step, state


def test_a_new_mode_is_one_executor():
    # SGD is linear in the gradient: a loss scaled by 2 at learning rate 0.05 moves as the loss at 0.1.
    plain = _train(strategies.data_parallel(), optax.sgd(0.1))
    plan = strategies.data_parallel() + spmd.Plan(execution=ScaledLoss(2.0))
    scaled = _train(plan, optax.sgd(0.05))
    np.testing.assert_allclose(scaled[0], 2 * np.asarray(plain[0]), rtol=1e-6)
    assert_trees_close(scaled[1].params_of(scaled[2]), plain[1].params_of(plain[2]))
    assert plan.describe() == "batch over data; parameters replicated; loss scaled by 2"
    report = spmd.report(scaled[1], _batch(0))
    assert report.execution is None and report.to_dict()["execution"] is None
    assert {c.kind for c in report.collectives} == ({"all-reduce"} if jax.device_count() > 1 else set())


def test_a_mode_with_its_own_stored_layout():
    # Gradients with respect to the doubled parameters are half the model's; SGD then moves the model's
    # parameters by a quarter: the same run as learning rate 0.025 without the mode.
    plain = _train(strategies.data_parallel(), optax.sgd(0.025))
    doubled = _train(strategies.data_parallel() + spmd.Plan(execution=Doubled()), optax.sgd(0.1))
    np.testing.assert_allclose(doubled[0], plain[0], rtol=1e-6)
    step, state = doubled[1], doubled[2]
    assert_trees_close(step.params_of(state), plain[1].params_of(plain[2]))
    assert_trees_close(state.params, jax.tree.map(lambda x: 2 * x, step.params_of(state)))
    # Checkpoints hold the model's layout: the executor's conversions, both ways.
    layout = spmd.ModelLayout(step)
    assert not layout.is_identity and spmd.ModelLayout(plain[1]).is_identity
    model = layout.to_model(state)
    assert_trees_close(model.params, step.params_of(state))
    assert_trees_close(layout.from_model(model), state, rtol=0, atol=0)


def test_the_plan_holds_one_execution_mode():
    a = spmd.Plan(execution=ScaledLoss(2.0))
    assert (a + strategies.data_parallel()).execution == ScaledLoss(2.0)
    assert (a + a).execution == ScaledLoss(2.0)  # the same mode twice is one mode
    with pytest.raises(spmd.PlanError, match=r"two scaled loss parts in one plan: loss scaled by 2 and loss scaled"):
        a + spmd.Plan(execution=ScaledLoss(3.0))
    with pytest.raises(spmd.PlanError, match=r"scaled loss and pipeline: .* a plan runs one execution mode"):
        a + strategies.pipeline("1f1b", stages=2, microbatches=2)
    # The mode's mesh axes are checked like every part's.
    with pytest.raises(spmd.PlanError, match=r"execution uses mesh axis 'rows', but the mesh has only data="):
        spmd.Plan(execution=Doubled(axis="rows")).check_mesh({"data": 8})


def test_a_spec_without_an_executor_says_so():
    @dataclasses.dataclass(frozen=True)
    class Unfinished(ExecutionSpec):
        pass

    mesh = spmd.make_mesh({"data": -1})
    with pytest.raises(NotImplementedError, match=r"Unfinished.executor\(task\) must return"):
        spmd.TrainStep(_loss, optax.sgd(0.1), spmd.Plan(execution=Unfinished()), mesh, params=_init(jax.random.key(0)))


@pytest.mark.slow
def test_gradients_are_stored_like_the_arrays_they_train():
    """ZeRO-2 lays gradients out on their own, and with block-aligned FSDP a gradient's padded shape can differ
    from its parameter's: the step pads gradients (and the optimizer state) like the parameters they train."""
    from spmd import data, models

    model = models.get("gpt-tiny", layers=2)
    params = jax.eval_shape(model.init, jax.random.key(0))
    mesh_axes = {"data": 2, "fsdp": 2, "tensor": 2}
    plan = strategies.from_names("dp+zero2+fsdp", mesh_axes, block=32)
    step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, spmd.make_mesh(mesh_axes), params=params)
    rows = zip(step.layout.params.leaves, step.layout.grads.leaves, strict=True)
    assert any(p.stored_shape != g.stored_shape for p, g in rows)  # the case this test is about
    assert step.layout.trained is step.layout.params
    one = spmd.TrainStep(
        models.loss_fn(model),
        optax.adam(1e-3),
        spmd.Plan(),
        spmd.make_mesh({"data": 1}, devices=jax.devices()[:1]),
        params=params,
    )
    out = []
    for s in (step, one):
        state = s.init(model.init, jax.random.key(0))
        state, loss = s(state, data.batch(0, 0, 16, 32, 256))
        out.append((float(loss), s.params_of(state)))
    assert abs(out[0][0] - out[1][0]) < 1e-5
    assert_trees_close(out[0][1], out[1][1])
