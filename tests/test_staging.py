"""Pipelines for models written without spmd in mind: a linen LM (Embed, ``nn.scan`` over a block, LayerNorm and
Dense head) and an nnx LM (``nnx.vmap``-created blocks run by ``nnx.scan``), cut by ``staged_from_parts``. The
cut computes the model's own loss, and pipelined training over ``stage=2,data=4`` equals plain optax training on
one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import spmd
import strategies
from spmd import data, models
from spmd.pipeline import staged_from_parts, staged_loss
from tests.conftest import assert_trees_close

VOCAB, D, LAYERS, SEQ, BATCH, STEPS = 64, 16, 4, 8, 16, 2


def lm_loss(logits, batch):
    tokens = batch["tokens"]
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def causal_mix(q, k, v):
    """One-head causal attention, the "attention-lite" of the blocks below."""
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(jnp.where(mask, scores, -1e9)), v)


# ------------------------------------------------------------------------ a linen LM, as an outside library writes it
class Block(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln1")(x)
        q, k, v = (nn.Dense(self.d, use_bias=False, name=n)(h) for n in ("q", "k", "v"))
        x = x + nn.Dense(self.d, name="o")(causal_mix(q, k, v))
        h = nn.gelu(nn.Dense(4 * self.d, name="up")(nn.LayerNorm(name="ln2")(x)))
        return x + nn.Dense(self.d, name="down")(h), None  # (carry, output), as nn.scan wants


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, name="wte")(tokens)
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
        x, _ = stack(D, name="blocks")(x)
        return nn.Dense(VOCAB, name="lm_head")(nn.LayerNorm(name="ln_f")(x))


# ------------------------------------------------------------------------------------------------- and an nnx one
class NnxBlock(nnx.Module):
    def __init__(self, d, *, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.q, self.k, self.v = (nnx.Linear(d, d, use_bias=False, rngs=rngs) for _ in range(3))
        self.o = nnx.Linear(d, d, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        h = self.ln1(x)
        x = x + self.o(causal_mix(self.q(h), self.k(h), self.v(h)))
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class NnxLM(nnx.Module):
    def __init__(self, *, rngs):
        self.wte = nnx.Embed(VOCAB, D, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return NnxBlock(D, rngs=rngs)

        self.blocks = blocks(rngs)
        self.ln_f, self.lm_head = nnx.LayerNorm(D, rngs=rngs), nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.lm_head(self.ln_f(run(self.wte(tokens), self.blocks)))


KEYS = dict(embed_key="params/wte", layers_key="params/blocks", head_key=["params/ln_f", "params/lm_head"])


def linen_case():
    """(init, loss, staged): the model's own init and loss, and its cut."""
    model = LinenLM()
    staged = staged_from_parts(
        embed=nn.Embed(VOCAB, D), layer=Block(D), head=[nn.LayerNorm(), nn.Dense(VOCAB)], loss=lm_loss, **KEYS
    )
    init = lambda rng: model.init(rng, jnp.zeros((1, SEQ), jnp.int32))  # noqa: E731
    return init, lambda params, batch: lm_loss(model.apply(params, batch["tokens"]), batch), staged


def nnx_case():
    # spmd holds an nnx model's parameters as {"params": {attribute: ...}}; from_module converts.
    model = models.from_module(lambda rngs: NnxLM(rngs=rngs), name="nnx-lm", config=models.LMConfig(VOCAB, SEQ))
    parts = nnx.eval_shape(lambda: NnxLM(rngs=nnx.Rngs(0)))  # shapes only: the cut keeps no arrays
    staged = staged_from_parts(
        embed=parts.wte, layer=parts.blocks, head=[parts.ln_f, parts.lm_head], loss=lm_loss, **KEYS
    )
    return model.init, lambda params, batch: lm_loss(model.apply(params, batch["tokens"]), batch), staged


CASES = {"linen": linen_case, "nnx": nnx_case}


def batch(i):
    return data.batch(0, i, BATCH, SEQ, VOCAB)


@pytest.mark.parametrize("kind", CASES)
def test_the_cut_computes_the_models_own_loss(kind):
    init, loss, staged = CASES[kind]()
    params = models.unbox(init(jax.random.key(0)))
    assert jax.tree.leaves(params["params"]["blocks"])[0].shape[0] == LAYERS  # stacked, leading dim = layer
    for i in range(2):
        expected, got = jax.jit(loss)(params, batch(i)), jax.jit(staged_loss(staged))(params, batch(i))
        assert float(got) == float(expected)


def one_device_training(init, loss, optimizer):
    """Plain optax on one device: the truth the pipelined run is held to."""
    params = models.unbox(init(jax.random.key(0)))
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for i in range(STEPS):
        params, opt_state, value = step(params, opt_state, batch(i))
        losses.append(float(value))
    return np.array(losses), params


@pytest.mark.parametrize("kind", CASES)
def test_the_pipelined_model_trains_like_one_device(kind):
    init, loss, staged = CASES[kind]()
    optimizer = optax.sgd(0.1, momentum=0.9)
    ref_losses, ref_params = one_device_training(init, loss, optimizer)

    mesh = spmd.make_mesh({"stage": 2, "data": -1})
    plan = strategies.pipeline("1f1b", stages=2, microbatches=4) + strategies.data_parallel()
    step = spmd.TrainStep(loss, optimizer, plan, mesh, params=jax.eval_shape(init, jax.random.key(0)), staged=staged)
    state = step.init(init, jax.random.key(0))
    losses = []
    for i in range(STEPS):
        state, value = step(state, batch(i))
        losses.append(float(value))

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(step.params_of(state), ref_params, rtol=1e-5, atol=1e-5)
    # Each stage device holds only its own layers: the stacked blocks are split over `stage`.
    assert state.params["params"]["blocks"]["up"]["kernel"].sharding.spec[0] == "stage"


def test_mistakes_in_the_cut_are_named():
    with pytest.raises(ValueError, match=r"2 head parts need as many head_key paths.*head_key=\['params/ln_f'"):
        staged_from_parts(
            embed=nn.Embed(VOCAB, D),
            layer=Block(D),
            head=[nn.LayerNorm(), nn.Dense(VOCAB)],
            loss=lm_loss,
            embed_key="params/wte",
            head_key="params/lm_head",
        )
    with pytest.raises(TypeError, match="layer must be a flax linen module, an nnx module or a function"):
        staged_from_parts(
            embed=nn.Embed(VOCAB, D),
            layer=3,
            head=nn.Dense(VOCAB),
            loss=lm_loss,
            embed_key="params/wte",
            head_key="params/lm_head",
        )
    with pytest.raises(ValueError, match="the nnx layer Dropout holds state other than nnx.Param"):
        staged_from_parts(
            embed=nn.Embed(VOCAB, D),
            layer=nnx.Dropout(0.1, rngs=nnx.Rngs(0)),
            head=nn.Dense(VOCAB),
            loss=lm_loss,
            embed_key="params/wte",
            head_key="params/lm_head",
        )
    init, _, _ = linen_case()
    staged = staged_from_parts(
        embed=nn.Embed(VOCAB, D),
        layer=Block(D),
        head=nn.Dense(VOCAB),
        loss=lm_loss,
        embed_key="params/embedding",
        head_key="params/lm_head",
        layers_key="params/blocks",
    )
    with pytest.raises(KeyError, match=r"embed_key 'params/embedding': no key 'embedding' under params .*'wte'"):
        staged_loss(staged)(models.unbox(init(jax.random.key(0))), batch(0))
