"""A per-token MLP language model: each position's logits depend only on its own token.

That is exactly enough for Markov-chain data (:mod:`spmd.data`), whose next token depends only on the
current one, so this tiny model can reach the chain's entropy rate; it is the quickest model to train in
tests and demos. Parameter paths and logical names::

    params/embed/embedding     (vocab, embed)
    params/wi/kernel           (embed, mlp)
    params/wo/kernel           (mlp, embed)
    params/lm_head/kernel      (embed, vocab)

>>> import jax
>>> from spmd.models.config import LMConfig
>>> model = MlpLM(LMConfig())
>>> tokens = jax.numpy.zeros((2, 8), jax.numpy.int32)
>>> params = jax.eval_shape(model.init, jax.random.key(0), tokens)
>>> params["params"]["wi"]["kernel"].names
('embed', 'mlp')
>>> jax.eval_shape(model.apply, params, tokens).shape
(2, 8, 256)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from spmd import axes as A
from spmd._context import constrain
from spmd.models.config import LMConfig
from spmd.models.gpt import DENSE_INIT, EMBED_INIT, HIDDEN, LOGITS, RESIDUAL

__all__ = ["MlpLM"]


class MlpLM(nn.Module):
    """int32 tokens ``[batch, seq]`` -> logits ``[batch, seq, vocab]``: embed, residual GELU MLP, lm_head."""

    config: LMConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config

        def dense(features: int, names: tuple[str, str], name: str) -> nn.Dense:
            return nn.Dense(
                features,
                use_bias=False,
                dtype=c.dtype,
                param_dtype=jnp.float32,
                kernel_init=nn.with_logical_partitioning(DENSE_INIT, names),
                name=name,
            )

        x = nn.Embed(
            c.vocab,
            c.d_model,
            dtype=c.dtype,
            param_dtype=jnp.float32,
            embedding_init=nn.with_logical_partitioning(EMBED_INIT, (A.VOCAB, A.EMBED)),
            name="embed",
        )(tokens)
        x = constrain(x, RESIDUAL)
        h = constrain(nn.gelu(dense(c.mlp, (A.EMBED, A.MLP), "wi")(x)), HIDDEN)
        # Residual around the MLP: the embedding alone already gives a bigram model, so training starts from
        # a useful function instead of having to push everything through a randomly initialised MLP.
        x = constrain(x + dense(c.d_model, (A.MLP, A.EMBED), "wo")(h), RESIDUAL)
        return constrain(dense(c.vocab, (A.EMBED, A.VOCAB), "lm_head")(x), LOGITS)
