"""Every strategy and composition, on several shapes of 8 devices, linen and nnx: the sharded training step
equals the single-device step (losses and parameters after 3 optimizer steps)."""

import jax
import numpy as np
import optax
import pytest

import spmd
import strategies
from spmd import data, models
from tests.conftest import assert_trees_close

STEPS, BATCH = 3, 16
# (data, fsdp, tensor) sizes: three shapes per composition, chosen so the composition's own axes are split.
SHAPES = {
    "dp": [(8, 1, 1), (4, 2, 1), (2, 2, 2)],
    "fsdp": [(1, 8, 1), (1, 4, 2), (2, 2, 2)],
    "tp": [(2, 1, 4), (4, 1, 2), (1, 2, 4)],
    "dp+fsdp": [(2, 4, 1), (4, 2, 1), (2, 2, 2)],
    "dp+tp": [(2, 1, 4), (4, 1, 2), (2, 2, 2)],
    "fsdp+tp": [(1, 2, 4), (1, 4, 2), (2, 2, 2)],
    "dp+fsdp+tp": [(2, 2, 2), (1, 2, 4), (4, 1, 2)],
}
# Later strategies on two shapes each, linen only (nnx shares the layout code and the constraints).
EXTRA_SHAPES = {
    "zero1": [(8, 1, 1), (4, 2, 1)],
    "zero2": [(8, 1, 1), (4, 1, 2)],
    "zero3": [(8, 1, 1), (4, 2, 1)],
    "hsdp": [(2, 4, 1), (4, 2, 1)],
    "zero2+tp": [(4, 1, 2), (2, 2, 2)],
    "sp": [(2, 1, 4), (4, 1, 2)],
    "dp+fsdp+sp": [(2, 2, 2), (4, 1, 2)],
}
CASES = [(kind, name, shape) for kind in ("linen", "nnx") for name, shapes in SHAPES.items() for shape in shapes]
CASES += [("linen", name, shape) for name, shapes in EXTRA_SHAPES.items() for shape in shapes]
# Mesh axes each strategy splits the parameters over, and those it splits only gradients/optimizer state over.
PARAM_AXES = {"fsdp": {"fsdp"}, "tp": {"tensor"}, "sp": {"tensor"}, "zero3": {"data"}, "hsdp": {"fsdp"}}
STATE_ONLY_AXES = {"zero1": {"data"}, "zero2": {"data"}}


def _model(kind):
    return models.get("gpt-tiny" if kind == "linen" else "gpt-tiny-nnx", layers=2)


def _train(model, plan, mesh):
    # SGD with momentum: parameter differences are then the gradient differences times the step size, so a
    # wrong reduction shows plainly (Adam would magnify reduction-order noise in near-zero gradients instead;
    # the CLI's Adam runs are checked in test_cli). Momentum gives an optimizer state to lay out as well.
    step = spmd.train_step(models.loss_fn(model), optax.sgd(0.1, momentum=0.9), plan, mesh)
    state = step.init(model.init, jax.random.key(0))
    losses = []
    for i in range(STEPS):
        state, loss = step(state, data.batch(0, i, BATCH, model.config.seq_len, model.config.vocab))
        losses.append(float(loss))
    return np.array(losses), state


@pytest.fixture(scope="module")
def reference():
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _train(_model(kind), spmd.Plan(), one)
        return cache[kind]

    return get


@pytest.mark.parametrize("kind,name,shape", CASES, ids=[f"{k}-{n}-{'x'.join(map(str, s))}" for k, n, s in CASES])
def test_sharded_step_equals_single_device(reference, kind, name, shape):
    mesh = spmd.make_mesh(dict(zip(("data", "fsdp", "tensor"), shape, strict=True)))
    plan = strategies.from_names(name)
    losses, state = _train(_model(kind), plan, mesh)
    ref_losses, ref_state = reference(kind)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(state.params, ref_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.opt_state, ref_state.opt_state, rtol=1e-5, atol=1e-5, relative_to_max=True)
    # The layout really is the plan's: a kernel is split over every axis the strategy names (size > 1), and
    # ZeRO-1/2 split the optimizer state while the parameter stays whole.
    parts = name.split("+")
    split = lambda a: {
        x for e in a.sharding.spec if e for x in ((e,) if isinstance(e, str) else e) if mesh.shape[x] > 1
    }
    kernel = state.params["params"]["layers"]["mlp"]["wi"]["kernel"]
    moment = state.opt_state[0].trace["params"]["layers"]["mlp"]["wi"]["kernel"]
    wanted = {a for p in parts for a in PARAM_AXES.get(p, ()) if mesh.shape[a] > 1}
    assert split(kernel) == wanted, (kernel.sharding.spec, wanted)
    wanted |= {a for p in parts for a in STATE_ONLY_AXES.get(p, ()) if mesh.shape[a] > 1}
    assert split(moment) == wanted, (moment.sharding.spec, wanted)
