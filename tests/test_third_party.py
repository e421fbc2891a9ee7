"""A model whose code the user does not own: no annotations at all, sharded by fsdp and by path rules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import spmd
import strategies
from tests.conftest import assert_trees_close


class ThirdPartyBlock(nn.Module):
    """Written the way an outside library would: plain nn.Dense layers, no partitioning metadata."""

    features: int = 64
    hidden: int = 256

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.hidden, name="up_proj")(x)
        h = nn.Dense(self.features, name="down_proj")(nn.gelu(h))
        return nn.LayerNorm(name="norm")(x + h)


MODEL = ThirdPartyBlock()
TP_RULES = [
    (r"up_proj/kernel", (None, "tensor")),
    (r"up_proj/bias", ("tensor",)),
    (r"down_proj/kernel", ("tensor", None)),
]


def init(rng):
    return MODEL.init(rng, jnp.ones((1, 64)))["params"]


def loss(params, batch):
    return jnp.mean((MODEL.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)


def test_fsdp_alone_shards_an_unannotated_model():
    abstract = jax.eval_shape(init, jax.random.key(0))
    specs = strategies.fsdp(axis="fsdp", min_bytes=1024).specs(abstract, {"fsdp": 8})
    assert specs["up_proj"]["kernel"] == P(None, "fsdp")  # (64, 256): the larger dimension
    assert specs["down_proj"]["kernel"] == P("fsdp", None)  # (256, 64)
    assert specs["up_proj"]["bias"] == P("fsdp")  # 1 KiB: at least min_bytes, so split
    assert specs["down_proj"]["bias"] == P(None)  # 256 bytes: kept whole
    assert specs["norm"]["scale"] == P(None)  # 256 bytes: kept whole


def test_fsdp_plus_path_rules_split_kernels_over_both_axes_and_train_like_one_device():
    plan = strategies.data_parallel() + strategies.fsdp(min_bytes=2048) + spmd.Plan.from_rules(TP_RULES)
    mesh = spmd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    params = jax.eval_shape(init, jax.random.key(0))
    step = spmd.TrainStep(loss, optax.adam(1e-2), plan, mesh, params=params)
    state = step.init(init, jax.random.key(0))
    assert state.params["up_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert state.params["down_proj"]["kernel"].sharding.spec == P("tensor", "fsdp")
    assert state.opt_state[0].mu["up_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")

    one = spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    ref_step = spmd.TrainStep(loss, optax.adam(1e-2), spmd.Plan(), one, params=params)
    ref = ref_step.init(init, jax.random.key(0))
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = {
            "x": rng.normal(size=(16, 64)).astype(np.float32),
            "y": rng.normal(size=(16, 64)).astype(np.float32),
        }
        state, a = step(state, batch)
        ref, b = ref_step(ref, batch)
        np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    assert_trees_close(state.params, ref.params)
