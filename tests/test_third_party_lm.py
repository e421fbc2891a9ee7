"""A user's own language model, reached as --model tests.test_third_party_lm:factory."""

import jax.numpy as jnp
from flax import linen as nn


class TinyLM(nn.Module):
    vocab: int = 256

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, 32, name="wte")(tokens)
        x = x + nn.Dense(32, name="fc2")(nn.relu(nn.Dense(128, name="fc1")(x)))
        return nn.Dense(self.vocab, name="head")(x)


def factory(**overrides):
    return TinyLM(vocab=overrides.get("vocab", 256))


def test_factory_builds_a_module():
    logits = TinyLM().apply(
        TinyLM().init(__import__("jax").random.key(0), jnp.zeros((1, 4), jnp.int32)),
        jnp.zeros((1, 4), jnp.int32),
    )
    assert logits.shape == (1, 4, 256)
