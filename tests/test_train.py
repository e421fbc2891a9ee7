"""Sharded initialisation, the train step's layout and donation, and activation constraints in model code."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import spmd
import strategies
from spmd import models


def test_sharded_init_never_builds_a_full_replica():
    model = models.get("mlp", vocab=4096)  # embedding and head: 1 MiB each
    mesh = spmd.make_mesh({"fsdp": 8})
    rng = jax.random.key(0)
    step = spmd.TrainStep(
        models.loss_fn(model), optax.adam(1e-3), strategies.fsdp(), mesh, params=jax.eval_shape(model.init, rng)
    )
    compiled = step.initializer(model.init).lower(rng).compile()
    mem = compiled.memory_analysis()
    full = 4096 * 64 * 4
    state_per_device = sum(r.bytes_per_device for r in step.layout.params.leaves + step.layout.opt_state.leaves)
    n_outputs = 1 + len(step.layout.params.leaves) + len(step.layout.opt_state.leaves)
    # The step counter, and the output tuple's table of one 8-byte pointer per array on the CPU backend.
    assert mem.output_size_in_bytes == state_per_device + 4 + 8 * n_outputs
    # Each device draws only its own shards' random numbers: its scratch space is a few shards (random bits and
    # their conversion), less than one full copy of the embedding alone.
    params_per_device = sum(r.bytes_per_device for r in step.layout.params.leaves)
    assert mem.temp_size_in_bytes <= 2.5 * params_per_device < full
    state = step.init(model.init, rng)
    emb = state.params["params"]["embed"]["embedding"]
    assert emb.sharding.spec == P("fsdp", None)
    assert {s.data.shape for s in emb.addressable_shards} == {(512, 64)}


def test_step_donates_the_state_and_keeps_the_layout():
    model = models.get("mlp")
    mesh = spmd.make_mesh({"data": 2, "tensor": 4})
    plan = strategies.data_parallel() + strategies.tensor_parallel()
    params = jax.eval_shape(model.init, jax.random.key(0))
    step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=params)
    state = step.init(model.init, jax.random.key(0))
    wi = state.params["params"]["wi"]["kernel"]
    batch = {"tokens": np.zeros((8, model.config.seq_len), np.int32)}
    new, _ = step(state, batch)
    assert wi.is_deleted()  # donated: updated in place
    assert new.params["params"]["wi"]["kernel"].sharding.spec == P(None, "tensor")
    assert new.opt_state[0].mu["params"]["wi"]["kernel"].sharding.spec == P(None, "tensor")
    assert int(new.step) == 1


def test_spmd_constrain_follows_the_active_plan_and_flax_sees_its_rules():
    seen_rules = []

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(16)(x)
            seen_rules.append(tuple(nn.get_logical_axis_rules()))
            return spmd.constrain(h, ("batch", "mlp"))

    mesh = spmd.make_mesh({"data": 4, "tensor": 2})
    plan = strategies.data_parallel() + strategies.tensor_parallel()
    block = Block()
    params = block.init(jax.random.key(0), jnp.ones((8, 4)))

    @jax.jit
    def f(params, x):
        with spmd.activate(plan, mesh):
            return block.apply(params, x)

    hlo = f.lower(params, jnp.ones((8, 4))).as_text()
    assert "sharding_constraint %" in hlo and '[{"data"}, {"tensor"}]' in hlo
    assert f(params, jnp.ones((8, 4))).sharding.spec == P("data", "tensor")


def test_shard_places_a_boxed_tree():
    mesh = spmd.make_mesh({"fsdp": 8})
    tree = {"w": nn.LogicallyPartitioned(np.ones((16, 4), np.float32), ("embed", "mlp"))}
    placed = spmd.shard(tree, spmd.Plan.from_logical_rules([("embed", "fsdp")]), mesh)
    assert placed["w"].sharding.spec == P("fsdp", None)
    np.testing.assert_array_equal(np.asarray(placed["w"]), np.ones((16, 4)))


def test_a_step_built_from_an_nnx_state_trains_and_holds_arrays():
    # init_fn returns an nnx.State of nnx.Param Variables (flax's docs): the step stores their arrays, and the
    # loss merges them back into the module, one update equal to plain SGD on one device.
    from flax import nnx

    def build(key):
        return nnx.Linear(4, 8, rngs=nnx.Rngs(params=key))

    graphdef = nnx.graphdef(build(jax.random.key(0)))
    init_fn = lambda key: nnx.state(build(key), nnx.Param)  # noqa: E731
    loss = lambda p, b: jnp.mean(nnx.merge(graphdef, p)(b["x"]) ** 2)  # noqa: E731
    mesh = spmd.make_mesh({"fsdp": 8})
    params = jax.eval_shape(init_fn, jax.random.key(1))
    step = spmd.TrainStep(loss, optax.sgd(0.1), strategies.fsdp(min_bytes=0), mesh, params=params)
    state = step.init(init_fn, jax.random.key(1))
    assert all(
        isinstance(x, jax.Array) for x in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    )
    batch = {"x": jnp.arange(32.0).reshape(8, 4) / 32}
    state, value = step(state, batch)
    start = jax.tree.map(np.asarray, nnx.state(build(jax.random.key(1)), nnx.Param))
    expected, grads = jax.value_and_grad(loss)(start, batch)
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-6)
    trained = jax.tree.map(lambda p, g: p - 0.1 * g, start, grads)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(trained), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
