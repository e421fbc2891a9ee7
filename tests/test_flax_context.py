"""The plan as flax's sharding context: under ``spmd.activate`` flax sees the mesh and the plan's rules, so nnx
models are created laid out, and a model's own constraints (flax's logical ones, bare PartitionSpecs) act in
spmd's step, in its initialiser and in ``models.from_module``."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import spmd
import strategies
from spmd import models
from spmd.models.config import LMConfig
from tests.conftest import assert_trees_close

FSDP_TP = strategies.fsdp() + strategies.tensor_parallel()


def _mesh(explicit=False):
    return spmd.make_mesh({"fsdp": 4, "tensor": 2}, explicit=explicit)


class NnxBlock(nnx.Module):
    """Written as flax's docs write a sharded nnx model: logical names on the kernels."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_an_nnx_model_created_under_a_plan_is_laid_out_by_its_rules(explicit):
    mesh = _mesh(explicit)
    with spmd.activate(FSDP_TP, mesh):
        model = NnxBlock(nnx.Rngs(0))
    up, down = model.up.kernel[...], model.down.kernel[...]
    # tensor_parallel maps ``mlp`` to tensor; ``embed`` has no rule in this plan and stays whole.
    assert (up.sharding.spec, down.sharding.spec) == (P(None, "tensor"), P("tensor", None))
    assert up.sharding.mesh.axis_types == ((AxisType.Explicit,) * 2 if explicit else (AxisType.Auto,) * 2)
    with nnx.use_eager_sharding(False):
        reference = NnxBlock(nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(up), np.asarray(reference.up.kernel[...]))


def _constraint_specs(fn, x):
    jaxpr = jax.make_jaxpr(fn)(x)
    return [e.params["sharding"].spec for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]


def test_flax_constraints_and_bare_partition_specs_act_under_the_plan():
    mesh, x = _mesh(), jnp.ones((8, 64))

    def constrained(names):
        def fn(x):
            with spmd.activate(FSDP_TP, mesh):
                return nn.with_logical_constraint(x, names)

        return fn

    assert _constraint_specs(constrained(("batch", "mlp")), x) == [P("fsdp", "tensor")]
    # MaxText's name for the batch dimension goes over the batch axes; a name no rule maps stays whole.
    assert _constraint_specs(constrained(("activation_batch", "activation_embed")), x) == [P("fsdp", None)]
    # MaxText's activation_<name> follows the model axes that split <name> (mlp: tensor).
    assert _constraint_specs(constrained(("activation_batch", "activation_mlp")), x) == [P("fsdp", "tensor")]
    assert _constraint_specs(constrained(("batch", "embed")), x) == [P("fsdp", None)]

    def bare(x):
        with spmd.activate(FSDP_TP, mesh):
            return jax.lax.with_sharding_constraint(x, P("fsdp", "tensor"))

    assert _constraint_specs(bare, x) == [P("fsdp", "tensor")]
    # Without the plan flax's constraint is a no-op, as it always was.
    assert _constraint_specs(lambda x: nn.with_logical_constraint(x, ("batch", "mlp")), x) == []


class Heads(nn.Module):
    """Attention-shaped projections with flax's DenseGeneral (its kernel init constrains a flat kernel by the
    rank-3 names: flax issue 3676), stacked with nn.scan."""

    @nn.compact
    def __call__(self, x, _):
        part = nn.with_logical_partitioning
        init = nn.initializers.lecun_normal()
        h = nn.DenseGeneral((4, 8), kernel_init=part(init, ("embed", "heads", "head_dim")), name="qkv")(x)
        h = nn.with_logical_constraint(h, ("batch", "heads", "head_dim"))
        out = nn.DenseGeneral(16, axis=(-2, -1), kernel_init=part(init, ("heads", "head_dim", "embed")), name="o")
        return x + out(jax.nn.gelu(h)), None


class OwnConstraints(nn.Module):
    """A model constraining its own activations: a logical constraint and a bare PartitionSpec on the batch."""

    @nn.compact
    def __call__(self, x):
        x = jax.lax.with_sharding_constraint(x, P("fsdp", None))
        stack = nn.scan(
            Heads,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=2,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return stack(name="layers")(x, None)[0]


def _train(plan, mesh, steps=2):
    model = OwnConstraints()
    init = lambda rng: model.init(rng, jnp.ones((8, 16)))["params"]  # noqa: E731
    loss = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)  # noqa: E731
    with spmd.activate(plan, mesh):
        params = jax.eval_shape(init, jax.random.key(0))
    step = spmd.TrainStep(loss, optax.sgd(0.1, momentum=0.9), plan, mesh, params=params)
    state = step.init(init, jax.random.key(0))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        batch = {"x": rng.normal(size=(8, 16)).astype(np.float32), "y": rng.normal(size=(8, 16)).astype(np.float32)}
        state, loss = step(state, batch)
        losses.append(float(loss))
    return np.array(losses), jax.device_get(state.params)


def test_a_model_with_its_own_constraints_and_dense_general_trains_like_one_device():
    one = spmd.make_mesh({"fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    losses, params = _train(FSDP_TP, _mesh())
    ref_losses, ref_params = _train(spmd.Plan(batch_axes=("fsdp",)), one)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params)


def test_from_module_traces_a_model_with_a_bare_partition_spec_under_the_plan():
    class Constrained(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(64, 16)(tokens)
            x = jax.lax.with_sharding_constraint(x, P("fsdp", None, None))
            return nn.Dense(64)(x)

    config = LMConfig(vocab=64, seq_len=8)
    with pytest.raises(ValueError, match="bare PartitionSpec.*spmd.activate"):
        models.from_module(Constrained(), name="constrained", config=config)
    with spmd.activate(strategies.fsdp(), spmd.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])):
        model = models.from_module(Constrained(), name="constrained", config=config)
    assert model.kind == "linen"


def test_rules_for_activations_only_are_not_reported_as_matching_nothing():
    rules = spmd.Plan.from_logical_rules(
        [("activation_batch", "fsdp"), ("activation_length", None), ("mlp", "tensor"), ("vocab", "tensor")]
    )
    params = {"w": nn.LogicallyPartitioned(jnp.zeros((16, 64)), ("embed", "mlp"))}
    with pytest.warns(spmd.PlanWarning) as said:
        (strategies.fsdp() + rules).resolve(params, {"fsdp": 4, "tensor": 2})
    text = " ".join(str(w.message) for w in said)
    assert "'vocab' matched nothing" in text
    assert "activation_" not in text


class Custom(nnx.Module):
    """An nnx model whose logical names are its own: no rule of the plan names them."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, ("width", "hid")), rngs=rngs)

    def __call__(self, x):
        return self.up(x)


def test_an_nnx_model_with_names_no_rule_maps_trains_under_fsdp():
    # init runs under the plan as flax's context: the model's own names are given rules (none: left whole),
    # where flax would otherwise take them for mesh axes.
    def init(rng):
        with nnx.use_eager_sharding(False):
            return nnx.state(Custom(nnx.Rngs(rng)), nnx.Param)

    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Custom(nnx.Rngs(0))))
    loss = lambda p, b: jnp.mean(nnx.merge(graphdef, p)(b) ** 2)  # noqa: E731
    mesh = spmd.make_mesh({"fsdp": 8})
    step = spmd.TrainStep(
        loss, optax.sgd(0.1), strategies.fsdp(min_bytes=0), mesh, params=jax.eval_shape(init, jax.random.key(0))
    )
    state = step.init(init, jax.random.key(0))
    state, value = step(state, jnp.ones((8, 16)))
    assert np.isfinite(float(value))
    assert state.params["up"]["kernel"].sharding.spec == P(None, "fsdp")


def test_the_command_line_plans_an_nnx_model_under_its_mesh(capsys):
    from tests.conftest import run_cli

    args = ["plan", "--model", "gpt-tiny-nnx", "--mesh", "fsdp=4,tensor=2", "--strategy", "fsdp+tp", "--json"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    specs = [tuple(row["spec"]) for row in json.loads(out)["params"]]
    assert any("tensor" in spec for spec in specs) and any("fsdp" in spec for spec in specs)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_create_lays_out_every_part_of_the_plan_fsdp_included(explicit):
    mesh, tx = _mesh(explicit), optax.adam(1e-3)
    plan = strategies.fsdp(min_bytes=0) + strategies.tensor_parallel()

    def build():
        model = NnxBlock(nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    with spmd.activate(plan, mesh):  # the plan and mesh by default
        model, optimizer = spmd.create(build)
    kernel, moment = model.up.kernel[...], optimizer.opt_state[0].mu["up"]["kernel"][...]
    # tensor_parallel's logical rule splits mlp; fsdp, which names no logical axis, splits the other dimension.
    assert kernel.sharding.spec == moment.sharding.spec == P("fsdp", "tensor")
    assert kernel.sharding.mesh.axis_types == mesh.axis_types
    with nnx.use_eager_sharding(False):
        whole, _ = build()
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(whole.up.kernel[...]))
    np.testing.assert_array_equal(np.asarray(model.down.bias[...]), np.asarray(whole.down.bias[...]))


def test_create_says_what_it_needs():
    with pytest.raises(ValueError, match=r"give plan= and mesh=, or call it under spmd.activate"):
        spmd.create(lambda: NnxBlock(nnx.Rngs(0)))
    blocks = strategies.fsdp(min_bytes=0, block=12)
    with pytest.raises(spmd.PlanError, match=r"spmd.create: the plan pads .* train it with spmd.TrainStep"):
        spmd.create(lambda: NnxBlock(nnx.Rngs(0)), blocks, spmd.make_mesh({"fsdp": 8}))


def test_the_report_lists_rules_for_activations_as_such():
    # MaxText-style: rules for the activation names the model constrains by, which no parameter has.
    rules = spmd.Plan.from_logical_rules([("activation_batch", "fsdp"), ("activation_length", None), ("mlp", "tensor")])
    plan = strategies.fsdp(min_bytes=0) + rules
    model = OwnConstraints()
    init = lambda rng: model.init(rng, jnp.ones((1, 16)))["params"]  # noqa: E731
    with spmd.activate(plan, _mesh()):
        params = jax.eval_shape(init, jax.random.key(0))
    loss = lambda p, b: jnp.mean(model.apply({"params": p}, b) ** 2)  # noqa: E731
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", spmd.PlanWarning)
        step = spmd.TrainStep(loss, optax.sgd(0.1), plan, _mesh(), params=params)
    assert not any("activation_" in str(w.message) for w in seen)
    r = spmd.report(step, jnp.ones((8, 16)))
    assert r.activation_rules == ["activation_batch", "activation_length"]
    assert r.to_dict()["activation_rules"] == ["activation_batch", "activation_length"]
    assert "note: 2 logical rules name activations only, not parameters: activation_batch, activation_length" in str(r)


def test_create_keeps_a_module_s_own_random_keys():
    # nnx.Dropout keeps an nnx.Rngs stream: typed PRNG keys are state too, replicated.
    class Noisy(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(16, 64, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    model = spmd.create(
        lambda: Noisy(nnx.Rngs(0, dropout=1)), strategies.fsdp(min_bytes=0), spmd.make_mesh({"fsdp": 8})
    )
    assert model.lin.kernel[...].sharding.spec == P(None, "fsdp")
    with nnx.use_eager_sharding(False):
        whole = Noisy(nnx.Rngs(0, dropout=1))
    # The same masks (the same zeros), the sharded matmul's rounding aside.
    np.testing.assert_allclose(np.asarray(model(jnp.ones((8, 16)))), np.asarray(whole(jnp.ones((8, 16)))), atol=1e-5)
