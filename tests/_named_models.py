"""Small linen language models that name their parameters' dimensions as other codebases do (MaxText, penzai,
or a user's own words), for checking that the cost model reads roles from layouts, not from spmd's names."""

import jax
from flax import linen as nn

from spmd import constrain, models
from spmd.models.config import LMConfig
from spmd.models.gpt import DENSE_INIT, EMBED_INIT, Projection, causal_attention

# Each family's names for: the residual stream, the MLP's hidden units, query heads, the output projection's
# heads, one head's width, the vocabulary and stacked layers.
# heads, one head's width, the vocabulary; and the activations' batch, length, heads and hidden units.
MAXTEXT = {
    "embed": "embed", "mlp": "mlp", "q_heads": "q_heads", "heads": "heads", "kv": "kv", "vocab": "vocab",
    "act_batch": "activation_batch", "act_length": "activation_length", "act_heads": "activation_heads",
    "act_mlp": "activation_mlp",
}  # fmt: skip
PENZAI = {
    "embed": "embedding", "mlp": "neurons", "q_heads": "heads", "heads": "heads", "kv": "projection",
    "vocab": "vocabulary", "act_batch": "batch", "act_length": "seq", "act_heads": "heads", "act_mlp": "neurons",
}  # fmt: skip
# MaxText's base.yml logical_axis_rules, on a mesh of fsdp × tensor.
MAXTEXT_RULES = [
    ("activation_batch", "fsdp"), ("activation_heads", "tensor"), ("activation_mlp", "tensor"),
    ("embed", "fsdp"), ("mlp", "tensor"), ("q_heads", "tensor"), ("heads", "tensor"), ("vocab", "tensor"),
]  # fmt: skip
# penzai's activations call their batch "batch", which a plan maps to its batch axes already.
PENZAI_RULES = [("embedding", "fsdp"), ("neurons", "tensor"), ("heads", "tensor"), ("vocabulary", "tensor")]


def _dense(features, names, name):
    return nn.Dense(features, use_bias=False, kernel_init=nn.with_logical_partitioning(DENSE_INIT, names), name=name)


def _embed(c, names):
    init = nn.with_logical_partitioning(EMBED_INIT, (names["vocab"], names["embed"]))
    return nn.Embed(c.vocab, c.d_model, embedding_init=init, name="embed")


class _Block(nn.Module):
    config: LMConfig
    names: dict

    @nn.compact
    def __call__(self, x):
        c, n = self.config, self.names
        residual = (n["act_batch"], n["act_length"], None)
        x = constrain(x, residual)
        y = nn.RMSNorm(scale_init=nn.with_logical_partitioning(nn.initializers.ones, (n["embed"],)))(x)
        heads = (n["act_batch"], n["act_length"], n["act_heads"], None)
        q, k, v = (
            constrain(Projection((c.heads, c.head_dim), (n["embed"], n["q_heads"], n["kv"]), name=name)(y), heads)
            for name in ("query", "key", "value")
        )
        x = x + Projection((c.d_model,), (n["heads"], n["kv"], n["embed"]), name="out")(causal_attention(q, k, v))
        x = constrain(x, residual)
        h = nn.gelu(_dense(c.mlp, (n["embed"], n["mlp"]), "wi")(x))
        h = constrain(h, (n["act_batch"], n["act_length"], n["act_mlp"]))
        return x + _dense(c.d_model, (n["mlp"], n["embed"]), "wo")(h), None


class NamedLM(nn.Module):
    """Embedding, ``config.layers`` stacked attention + MLP blocks (a leading ``layers`` dimension), head."""

    config: LMConfig
    names: dict

    @nn.compact
    def __call__(self, tokens):
        c, n = self.config, self.names
        x = constrain(_embed(c, n)(tokens), (n["act_batch"], n["act_length"], None))
        block = nn.remat(_Block, prevent_cse=False) if c.remat else _Block
        stack = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=c.layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = stack(c, n, name="layers")(x)
        return _dense(c.vocab, (n["embed"], n["vocab"]), "lm_head")(x)


class NamedMlp(nn.Module):
    """The built-in ``mlp`` model with its own names for the residual width and the hidden units."""

    config: LMConfig
    width: str = "width"
    hidden: str = "hid"

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        x = constrain(_embed(c, {"vocab": "vocab", "embed": self.width})(tokens), ("batch", "seq", self.width))
        h = constrain(nn.gelu(_dense(c.mlp, (self.width, self.hidden), "wi")(x)), ("batch", "seq", self.hidden))
        x = constrain(x + _dense(c.d_model, (self.hidden, self.width), "wo")(h), ("batch", "seq", self.width))
        return _dense(c.vocab, (self.width, "vocab"), "lm_head")(x)


def named_lm(names, **config):
    c = LMConfig(**config)
    return models._from_linen(NamedLM(c, names), "named-lm", c)


def named_mlp(**config):
    c = LMConfig(**config)
    return models._from_linen(NamedMlp(c), "named-mlp", c)


def abstract(model):
    return jax.eval_shape(model.init, jax.random.key(0))


__all__ = ["MAXTEXT", "PENZAI", "MAXTEXT_RULES", "PENZAI_RULES", "named_lm", "named_mlp", "abstract"]
