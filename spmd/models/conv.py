"""A causal convolutional language model (a temporal CNN): token embeddings, stacked residual convolution blocks,
the final norm and head.

Each block is a pre-LayerNorm residual: a causal convolution of width :data:`WIDTH` from ``embed`` to ``mlp``
hidden channels (named ``"channels"``), GELU, and a width-1 convolution back to ``embed``. The hidden channels are
the block's neurons: subnetwork plans cut them into groups as they cut a GPT's MLP units. The blocks are stacked
with ``nn.scan`` like the GPT's. Parameter paths and logical names::

    params/embed/embedding           (vocab, embed)
    params/layers/ln/{scale,bias}    (layers, embed)
    params/layers/conv_in/kernel     (layers, width, embed, channels)
    params/layers/conv_out/kernel    (layers, width, channels, embed)
    params/ln_f/{scale,bias}         (embed,)
    params/lm_head/kernel            (embed, vocab)

>>> import jax
>>> from spmd.models.config import LMConfig
>>> model = ConvLM(LMConfig(layers=2))
>>> tokens = jax.numpy.zeros((2, 32), jax.numpy.int32)
>>> params = jax.eval_shape(model.init, jax.random.key(0), tokens)
>>> box = params["params"]["layers"]["conv_in"]["kernel"]
>>> box.names, box.value.shape
(('layers', 'width', 'embed', 'channels'), (2, 3, 64, 256))
>>> jax.eval_shape(model.apply, params, tokens).shape
(2, 32, 256)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from spmd import axes as A
from spmd._context import constrain
from spmd.models.config import LMConfig
from spmd.models.gpt import DENSE_INIT, LOGITS, RESIDUAL, _layer_norm, _lm_head, _token_embed, scanned

__all__ = ["ConvLM", "WIDTH"]

WIDTH = 3  # each position sees itself and the two before it, per block
CHANNELS = (A.BATCH, A.SEQ, A.CHANNELS)


def _conv(c: LMConfig, features: int, width: int, names: tuple[str, str, str], name: str) -> nn.Conv:
    return nn.Conv(
        features,
        kernel_size=(width,),
        padding=((width - 1, 0),),  # causal: no position sees a later one
        use_bias=False,
        dtype=c.dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.with_logical_partitioning(DENSE_INIT, names),
        name=name,
    )


class ConvBlock(nn.Module):
    """One residual block; returns ``(x, None)`` so ``nn.scan`` can carry ``x``."""

    config: LMConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
        c = self.config
        h = _conv(c, c.mlp, WIDTH, (A.WIDTH, A.EMBED, A.CHANNELS), "conv_in")(_layer_norm(c, "ln")(x))
        h = constrain(nn.gelu(h), CHANNELS)
        h = _conv(c, c.d_model, 1, (A.WIDTH, A.CHANNELS, A.EMBED), "conv_out")(h)
        return constrain(x + h, RESIDUAL), None


class ConvLM(nn.Module):
    """int32 tokens ``[batch, seq]`` -> logits ``[batch, seq, vocab]``."""

    config: LMConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        x = constrain(_token_embed(c)(tokens), RESIDUAL)
        x, _ = scanned(ConvBlock, c)(c, name="layers")(x)
        x = _layer_norm(c, "ln_f")(x)
        return constrain(_lm_head(c)(x), LOGITS)
