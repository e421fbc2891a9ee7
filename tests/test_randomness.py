"""A loss that draws random numbers (a linen model with dropout) takes ``key`` and ``step``: the key of step ``s``
is ``fold_in(seed, s)``, the same on one device and sharded (JAX's threefry is partitionable), other at every
step, and a part of the batch that an executor runs on its own (an uneven share's microbatch) folds in its index.
"""

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
import strategies
from spmd import data, models
from tests.conftest import assert_trees_close

# Partitionable threefry lets each device draw only its own shard's bits and still match one device.
assert jax.config.jax_threefry_partitionable


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, *, deterministic):
        h = nn.gelu(nn.Dense(64, name="fc1")(x))
        h = nn.Dropout(0.5)(h, deterministic=deterministic)
        return nn.Dense(8, name="fc2")(h)


MODEL = DropoutMLP()


def init(rng):
    return MODEL.init(rng, jnp.zeros((1, 16)), deterministic=True)


def loss_fn(params, batch, *, key, step):
    pred = MODEL.apply(params, batch["x"], deterministic=False, rngs={"dropout": key})
    return jnp.mean((pred - batch["y"]) ** 2)


BATCH = {
    "x": np.random.default_rng(0).normal(size=(32, 16)).astype(np.float32),
    "y": np.random.default_rng(1).normal(size=(32, 8)).astype(np.float32),
}
PARAMS = jax.eval_shape(init, jax.random.key(0))


def train(plan, mesh, *, seed=0, steps=3, lr=0.1, loss=loss_fn):
    step = spmd.TrainStep(loss, optax.sgd(lr, momentum=0.9), plan, mesh, params=PARAMS, seed=seed)
    state = step.init(init, jax.random.key(0))
    losses = []
    for _ in range(steps):
        state, value = step(state, BATCH)
        losses.append(float(value))
    return losses, jax.device_get(state.params)


def one_device():
    return spmd.make_mesh({"data": 1}, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def reference():
    return train(spmd.Plan(), one_device())


@pytest.mark.parametrize(
    "plan, axes, explicit",
    [
        (strategies.data_parallel(), {"data": 8}, False),
        (strategies.fsdp(min_bytes=0), {"fsdp": 8}, False),
        (strategies.fsdp(min_bytes=0) + strategies.data_parallel(), {"data": 2, "fsdp": 4}, True),
    ],
    ids=["dp", "fsdp", "dp+fsdp-explicit"],
)
def test_dropout_trains_equal_to_one_device(reference, plan, axes, explicit):
    losses, params = train(plan, spmd.make_mesh(axes, explicit=explicit))
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    assert_trees_close(params, reference[1])


@pytest.mark.slow
def test_dropout_under_tensor_parallelism_equals_one_device(reference):
    plan = strategies.tensor_parallel() + strategies.data_parallel()
    losses, params = train(plan, spmd.make_mesh({"data": 4, "tensor": 2}))
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    assert_trees_close(params, reference[1])


def test_each_step_draws_its_own_masks_from_fold_in_of_the_seed():
    # With a learning rate of 0 the parameters stay put: the losses differ only by their dropout masks.
    losses, params = train(strategies.data_parallel(), spmd.make_mesh({"data": 8}), seed=7, lr=0.0)
    assert len(set(losses)) == 3, losses
    for s, value in enumerate(losses):
        key = jax.random.fold_in(jax.random.key(7), s)
        np.testing.assert_allclose(value, float(loss_fn(params, BATCH, key=key, step=s)), rtol=1e-5)


def test_the_same_seed_gives_the_same_run_and_another_seed_another(reference):
    again = train(spmd.Plan(), one_device())
    assert again[0] == reference[0]
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again[1]), jax.tree.leaves(reference[1]), strict=True)
    )
    assert train(spmd.Plan(), one_device(), seed=1)[0] != reference[0]


@pytest.mark.slow
def test_an_uneven_share_folds_in_the_index_of_its_microbatch():
    plan = strategies.hetero.uneven_data_parallel((8, 4, 4, 4, 4, 4, 2, 2), microbatch=2)
    (loss,), _ = train(plan, spmd.make_mesh({"data": 8}), seed=3, steps=1, lr=0.0)
    params = jax.device_get(jax.jit(init)(jax.random.key(0)))
    key = jax.random.fold_in(jax.random.key(3), 0)  # step 0
    parts = [
        loss_fn(
            params, {name: x[2 * k : 2 * k + 2] for name, x in BATCH.items()}, key=jax.random.fold_in(key, k), step=0
        )
        for k in range(16)
    ]
    np.testing.assert_allclose(loss, float(np.mean(parts)), rtol=1e-5)
    whole = float(loss_fn(params, BATCH, key=key, step=0))  # one key for the whole batch draws other masks
    assert abs(loss - whole) > 1e-3


def test_a_loss_taking_only_the_step_needs_no_seed():
    seen = lambda p, b, *, step: jnp.mean(MODEL.apply(p, b["x"], deterministic=True)) * 0 + step  # noqa: E731
    step = spmd.TrainStep(seen, optax.sgd(0.0), spmd.Plan(), one_device(), params=PARAMS)
    state = step.init(init, jax.random.key(0))
    values = []
    for _ in range(2):
        state, value = step(state, BATCH)
        values.append(float(value))
    assert values == [0.0, 1.0]


def test_randomness_mistakes_are_explained():
    mesh = one_device()
    plain = lambda p, b: jnp.mean(MODEL.apply(p, b["x"], deterministic=True))  # noqa: E731
    with pytest.raises(TypeError, match="seed= is given but the loss takes no key"):
        spmd.TrainStep(plain, optax.sgd(0.1), spmd.Plan(), mesh, params=PARAMS, seed=0)
    with pytest.raises(TypeError, match="the loss requires key= but the step has no seed; build it with seed="):
        spmd.TrainStep(loss_fn, optax.sgd(0.1), spmd.Plan(), mesh, params=PARAMS)
    with pytest.raises(TypeError, match="seed must be an int or a jax.random.key"):
        spmd.TrainStep(loss_fn, optax.sgd(0.1), spmd.Plan(), mesh, params=PARAMS, seed=0.5)


def test_a_loss_forwarding_its_keyword_arguments_is_called_as_before():
    # **kwargs may be forwarded to model.apply: only a loss that names key or step is given them.
    seen = []

    def forwarding(p, b, **kw):
        seen.append(sorted(kw))
        return jnp.mean(MODEL.apply(p, b["x"], deterministic=True, **kw))

    step = spmd.TrainStep(forwarding, optax.sgd(0.1), spmd.Plan(), one_device(), params=PARAMS)
    state, loss = step(step.init(init, jax.random.key(0)), BATCH)
    assert seen and all(names == [] for names in seen) and np.isfinite(float(loss))


def test_forward_masking_refuses_a_drawing_loss_its_narrowed_losses_cannot_take():
    model = models.get("gpt-tiny", layers=2)
    params = jax.eval_shape(model.init, jax.random.key(0))
    drawing = lambda p, b, *, key, step: models.loss_fn(model)(p, b)  # noqa: E731
    narrow = lambda kept: models.loss_fn(models.narrowed(model, kept))  # noqa: E731 -- takes no key
    plan = strategies.subnetwork_dp(coverage=0.5, masking="forward")
    with pytest.raises(TypeError, match=r"does not call loss_fn with them \(its executor is not keyed"):
        spmd.TrainStep(drawing, optax.sgd(0.1), plan, spmd.make_mesh({"data": 8}), params=params, narrow=narrow, seed=0)


def test_a_pipeline_refuses_a_loss_that_draws():
    model = models.get("gpt-tiny", layers=2)
    params = jax.eval_shape(model.init, jax.random.key(0))
    drawing = lambda p, b, *, key, step: models.loss_fn(model)(p, b)  # noqa: E731
    plan = strategies.pipeline("gpipe", stages=2, microbatches=2)
    mesh = spmd.make_mesh({"stage": 2}, devices=jax.devices()[:2])
    with pytest.raises(TypeError, match=r"pipeline gpipe .* does not call loss_fn with them \(its executor is not"):
        spmd.TrainStep(drawing, optax.sgd(0.1), plan, mesh, params=params, staged=model.staged, seed=0)


@pytest.mark.slow
def test_a_run_restored_onto_another_plan_draws_what_the_straight_run_draws(tmp_path, reference):
    # The seed is the step's, not the state's: a checkpoint holds the step count, and that is all a key needs.
    saving = spmd.TrainStep(
        loss_fn, optax.sgd(0.1, momentum=0.9), strategies.data_parallel(), spmd.make_mesh({"data": 8}),
        params=PARAMS, seed=0,
    )  # fmt: skip
    state = saving.init(init, jax.random.key(0))
    for _ in range(2):
        state, _ = saving(state, BATCH)
    with spmd.Checkpoints(str(tmp_path), asynchronous=False) as saver:
        saver.save(2, spmd.ModelLayout(saving).to_model(state), {"model": "dropout-mlp"})
    resumed = spmd.TrainStep(
        loss_fn, optax.sgd(0.1, momentum=0.9), strategies.fsdp(min_bytes=0), spmd.make_mesh({"fsdp": 8}),
        params=PARAMS, seed=0,
    )  # fmt: skip
    layout = spmd.ModelLayout(resumed)
    with spmd.Checkpoints(str(tmp_path), asynchronous=False) as reader:
        at, restored, _ = reader.restore(layout.abstract())
    state, loss = resumed(layout.from_model(restored), BATCH)
    assert at == 2 and int(state.step) == 3
    np.testing.assert_allclose(float(loss), reference[0][2], rtol=1e-5)
    assert_trees_close(jax.device_get(state.params), reference[1])


@pytest.mark.slow  # two gpt-tiny subnetwork steps compiled: 15 s on idle cores, 35 s on busy ones
def test_each_subnetwork_worker_draws_with_the_key_folded_with_its_index():
    # A loss whose drawn part has no gradient: the step's loss is the plain one plus the workers' mean draw.
    model = models.get("gpt-tiny", layers=2)
    base = models.loss_fn(model)
    noisy = lambda p, b, *, key, step: base(p, b) + 0.01 * jax.random.uniform(key)  # noqa: E731
    plan = strategies.subnetwork_dp(coverage=0.5, masking="backward")
    params, mesh = jax.eval_shape(model.init, jax.random.key(0)), spmd.make_mesh({"data": 8})
    batch = data.batch(0, 0, 16, model.config.seq_len, model.config.vocab)
    losses = []
    for loss, seed in ((base, None), (noisy, 5)):
        step = spmd.TrainStep(loss, optax.sgd(0.1), plan, mesh, params=params, seed=seed)
        losses.append(float(step(step.init(model.init, jax.random.key(0)), batch)[1]))
    key = jax.random.fold_in(jax.random.key(5), 0)
    draws = [float(jax.random.uniform(jax.random.fold_in(key, w))) for w in range(8)]
    np.testing.assert_allclose(losses[1] - losses[0], 0.01 * np.mean(draws), rtol=1e-3)
    assert abs(np.mean(draws) - float(jax.random.uniform(key))) > 1e-3  # one key for all would read otherwise


def test_each_device_draws_only_the_bits_of_its_own_rows():
    # Partitionable threefry in the compiled program: the dropout mask is [32, 64] bits, each of the 8 devices
    # holds 4 rows, and the largest array of random bits a device makes is its [4, 64] share (with the flag off
    # each device would make all 32 · 64 and keep a slice).
    mesh = spmd.make_mesh({"data": 8})
    step = spmd.TrainStep(loss_fn, optax.sgd(0.1), strategies.data_parallel(), mesh, params=PARAMS, seed=0)
    text = step.compile(BATCH).as_text()
    bits = [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"u32\[([\d,]*)\]", text)]
    assert max(bits) == 4 * 64, sorted(set(bits))
