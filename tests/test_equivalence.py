"""Every strategy and composition, on several shapes of 8 devices, linen and nnx: the sharded training step
equals the single-device step (losses and parameters after 3 optimizer steps)."""

import jax
import numpy as np
import optax
import pytest

import spmd
import strategies
from spmd import costmodel, data, models
from tests.conftest import assert_trees_close, train_steps

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


# nnx shares the layout code and the constraints with linen: the default run checks it on these compositions.
NNX_DEFAULT = ("dp+fsdp+tp",)


def _tier(kind, name, shape):
    """The default run keeps the first shape of every composition (nnx: of NNX_DEFAULT's); the rest run with
    -m slow, so every composition is still checked on at least two shapes."""
    first = (SHAPES | EXTRA_SHAPES)[name].index(shape) == 0
    fast = first and (kind == "linen" or name in NNX_DEFAULT)
    return () if fast else (pytest.mark.slow,)


PARAMS = [
    pytest.param(*case, marks=_tier(*case), id=f"{case[0]}-{case[1]}-{'x'.join(map(str, case[2]))}") for case in CASES
]
# Mesh axes each strategy splits the parameters over, and those it splits only gradients/optimizer state over.
PARAM_AXES = {"fsdp": {"fsdp"}, "tp": {"tensor"}, "sp": {"tensor"}, "zero3": {"data"}, "hsdp": {"fsdp"}}
STATE_ONLY_AXES = {"zero1": {"data"}, "zero2": {"data"}}


def _model(kind):
    return models.get("gpt-tiny" if kind == "linen" else "gpt-tiny-nnx", layers=2)


def _train(model, plan, mesh):
    # The CLI's Adam runs are checked in test_cli (see train_steps for why SGD with momentum here).
    return train_steps(model, plan, mesh, steps=STEPS, batch_size=BATCH)[:2]


@pytest.fixture(scope="module")
def reference():
    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _train(_model(kind), spmd.Plan(), one)
        return cache[kind]

    return get


@pytest.mark.parametrize("kind,name,shape", PARAMS)
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


def _osdp(mesh_axes, base=None):
    # A budget between the fully sharded and the replicated footprints, so OSDP shards some arrays, not all.
    model = _model("linen")
    params = jax.eval_shape(model.init, jax.random.key(0))
    workload = costmodel.Workload(BATCH, model.config.seq_len)
    return strategies.osdp(
        params,
        mesh_axes,
        workload,
        costmodel.HARDWARE["h100"],
        memory_per_device=int(1.9 * (1 << 20)),
        optimizer=optax.sgd(0.1, momentum=0.9),
        base=base,
    )


# Strategies built by functions with options (block alignment, 2-D roles, a memory budget), each on two meshes.
BUILT = {
    "tp2d-tensor2xtensor2_4": ({"tensor": 2, "tensor2": 4}, lambda m: strategies.tensor_parallel_2d()),
    "dp+tp2d-swapped-2x2x2": (
        {"data": 2, "tensor": 2, "tensor2": 2},
        lambda m: strategies.data_parallel() + strategies.tensor_parallel_2d(axes=("tensor2", "tensor")),
    ),
    "fsdp-block16-fsdp8": ({"fsdp": 8}, lambda m: strategies.fsdp(block=16)),
    "hsdp-block16-2x4": ({"data": 2, "fsdp": 4}, lambda m: strategies.hsdp().with_block(16)),
    "osdp-data8": ({"data": 8}, lambda m: _osdp(m)),
    "osdp+tp-4x2": ({"data": 4, "tensor": 2}, lambda m: _osdp(m, strategies.tensor_parallel())),
}


# Both meshes of each built strategy run in the slow tier; the default tier runs the first of each.
SLOW_BUILT = ("hsdp-block16-2x4", "osdp+tp-4x2", "dp+tp2d-swapped-2x2x2")


@pytest.mark.parametrize("case", [pytest.param(c, marks=(pytest.mark.slow,) if c in SLOW_BUILT else ()) for c in BUILT])
def test_built_strategies_equal_single_device(reference, case):
    mesh_axes, build = BUILT[case]
    plan = build(mesh_axes)
    model = _model("linen")
    params = jax.eval_shape(model.init, jax.random.key(0))
    mesh = spmd.make_mesh(mesh_axes)
    step = spmd.TrainStep(models.loss_fn(model), optax.sgd(0.1, momentum=0.9), plan, mesh, params=params)
    state = step.init(model.init, jax.random.key(0))
    losses = []
    for i in range(STEPS):
        state, loss = step(state, data.batch(0, i, BATCH, model.config.seq_len, model.config.vocab))
        losses.append(float(loss))
    ref_losses, ref_state = reference("linen")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(step.params_of(state), ref_state.params, rtol=1e-5, atol=1e-6)
    rows = step.layout.params.leaves
    if "block" in case:
        # Every split dimension holds whole 16-row blocks on each device, padded where it had to be.
        for row, array in zip(rows, jax.tree.leaves(state.params), strict=True):
            for dim, entry in enumerate(row.spec):
                if entry is not None:
                    assert array.addressable_shards[0].data.shape[dim] % 16 == 0, row.path
        # 16-row blocks over 8 devices need dimensions of 128: d_model 64 is padded; over 4, 64 divides.
        assert any(row.padded_shape for row in rows) == (mesh_axes["fsdp"] == 8)
    if "osdp" in case:
        shardable = sum(1 for row in rows if row.bytes >= 4096)
        assert 0 < sum(1 for row in rows if "data" in str(row.spec)) < shardable
    if "tp2d" in case:
        (embed_axis,) = {row.spec[1] for row in rows if row.path.endswith("mlp/wi/kernel")}
        assert embed_axis == ("tensor" if "swapped" not in case else "tensor2")
