"""A GPT in flax linen: pre-LayerNorm blocks, causal self-attention, GELU MLP, learned positions.

Every parameter carries logical axis names (``nn.with_logical_partitioning``) so a plan can map them to
mesh axes; the blocks are stacked with ``nn.scan`` (compile time independent of depth), which prepends
``"layers"`` to the names of every stacked parameter. Parameter paths::

    params/embed/embedding             (vocab, embed)
    params/pos_embed/embedding         (position, embed)
    params/layers/ln1/{scale,bias}     (layers, embed)
    params/layers/attn/query/kernel    (layers, embed, heads, head_dim)     likewise key, value
    params/layers/attn/out/kernel      (layers, heads, head_dim, embed)
    params/layers/ln2/{scale,bias}     (layers, embed)
    params/layers/mlp/wi/kernel        (layers, embed, mlp)
    params/layers/mlp/wo/kernel        (layers, mlp, embed)
    params/ln_f/{scale,bias}           (embed,)
    params/lm_head/kernel              (embed, vocab)

``config.remat`` (a :class:`spmd.Remat`) applies to each scanned block and to the head. A block tags its
activations for ``names`` and ``offload`` policies (``jax.ad_checkpoint.checkpoint_name``, see
:data:`spmd._remat.NAMES`): ``layer_input``, ``query_proj``/``key_proj``/``value_proj``, ``attn_out`` (attention's
output before ``out``), ``out_proj``, ``mlp_hidden`` (``wi``'s output) and ``mlp_out``.

>>> import jax
>>> from spmd.models.config import LMConfig
>>> model = GPT(LMConfig(layers=2))
>>> tokens = jax.numpy.zeros((2, 32), jax.numpy.int32)
>>> params = jax.eval_shape(model.init, jax.random.key(0), tokens)
>>> box = params["params"]["layers"]["attn"]["query"]["kernel"]
>>> box.names, box.value.shape
(('layers', 'embed', 'heads', 'head_dim'), (2, 64, 4, 16))
>>> jax.eval_shape(model.apply, params, tokens).shape
(2, 32, 256)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from spmd import axes as A
from spmd._context import constrain
from spmd._context_attention import attention, balance_sequence, restore_sequence, sequence_positions
from spmd._pipeline import StagedModel
from spmd._tensor_shares import unit_sum
from spmd.models.config import LMConfig

__all__ = ["GPT", "causal_attention", "scanned", "staged", "EMBED_INIT", "DENSE_INIT"]

# Logical names of activations at block boundaries (see spmd._context.constrain).
RESIDUAL = (A.BATCH, A.SEQ, A.EMBED)
HEADS = (A.BATCH, A.SEQ, A.HEADS, A.HEAD_DIM)
HIDDEN = (A.BATCH, A.SEQ, A.MLP)
LOGITS = (A.BATCH, A.SEQ, A.VOCAB)

# GPT-2's small embedding init keeps the residual stream O(1) at the start; Dense kernels use flax's default
# lecun_normal, which the pre-LayerNorm blocks make safe at any depth we build.
EMBED_INIT = nn.initializers.normal(stddev=0.02)
DENSE_INIT = nn.initializers.lecun_normal()


def _named(init: Callable, names: Sequence[str]) -> Callable:
    return nn.with_logical_partitioning(init, tuple(names))


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention over ``[batch, seq, heads, head_dim]`` inputs; scores and softmax in float32.
    Under a context-parallel plan it runs across the context axis (:func:`spmd.attention`).

    >>> x = jnp.ones((1, 3, 2, 4))
    >>> causal_attention(x, x, x).shape
    (1, 3, 2, 4)
    """
    return attention(q, k, v)


def _layer_norm(config: LMConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=1e-6,
        dtype=config.dtype,
        param_dtype=jnp.float32,
        scale_init=_named(nn.initializers.ones, (A.EMBED,)),
        bias_init=_named(nn.initializers.zeros, (A.EMBED,)),
        name=name,
    )


def _kernel_init(inputs: int) -> Callable:
    """``DENSE_INIT`` on the kernel flattened to ``(its leading inputs dimensions, the rest)``: the values of
    ``nn.DenseGeneral`` (``nn.Dense``'s for one input dimension), but boxed for the whole kernel. DenseGeneral
    unboxes its flattened kernel inside its initialiser, which under a context mesh (inside ``shard_map``, as in
    a pipeline stage) applies the annotation's rank-3 constraint to a rank-2 value."""

    def init(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        flat = (math.prod(shape[:inputs]), math.prod(shape[inputs:]))
        return DENSE_INIT(rng, flat, dtype).reshape(shape)

    return init


class Kernel(nn.Module):
    """A bias-free kernel whose leading ``inputs`` dimensions contract with an input's trailing ones (initialised
    by :func:`_kernel_init`): the parameter alone, for blocks that compute with their kernels through
    :func:`spmd.unit_sum`."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    inputs: int = 1

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", _named(_kernel_init(self.inputs), self.names), self.shape, jnp.float32)


def _contract(x: jax.Array, kernel: jax.Array, inputs: int, dtype: Any) -> jax.Array:
    """``x``'s trailing ``inputs`` dimensions contracted with ``kernel``'s leading ones, in ``dtype``."""
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    return jax.lax.dot_general(x, kernel, ((tuple(range(x.ndim - inputs, x.ndim)), tuple(range(inputs))), ((), ())))


class Projection(nn.Module):
    """A bias-free projection contracting the trailing ``len(names) - len(features)`` dimensions into
    ``features``: ``nn.DenseGeneral``'s parameter and values (see :func:`_kernel_init`), for models that compute
    their projections one by one."""

    features: tuple[int, ...]
    names: tuple[str, ...]
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        inputs = len(self.names) - len(self.features)
        shape = (*x.shape[x.ndim - inputs :], *self.features)
        kernel = self.param("kernel", _named(_kernel_init(inputs), self.names), shape, jnp.float32)
        return _contract(x, kernel, inputs, self.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with ``query``/``key``/``value``/``out`` projections, no biases; a sum
    over its heads (:func:`spmd.unit_sum`), so uneven tensor shares give a device its own heads."""

    config: LMConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        inner = (A.EMBED, A.HEADS, A.HEAD_DIM)
        kernels = [Kernel((c.d_model, c.heads, c.head_dim), inner, name=n)() for n in ("query", "key", "value")]
        out = Kernel((c.heads, c.head_dim, c.d_model), (A.HEADS, A.HEAD_DIM, A.EMBED), inputs=2, name="out")()

        def attend(x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array, wo: jax.Array) -> jax.Array:
            q, k, v = (
                checkpoint_name(constrain(_contract(x, w, 1, c.dtype), HEADS), f"{n}_proj")
                for w, n in ((wq, "query"), (wk, "key"), (wv, "value"))
            )
            y = checkpoint_name(constrain(causal_attention(q, k, v), HEADS), "attn_out")
            return checkpoint_name(_contract(y, wo, 2, c.dtype), "out_proj")

        return unit_sum(attend, x, (*kernels, out), (1, 1, 1, 0), A.HEADS)


class Mlp(nn.Module):
    """The feed-forward half of a block: ``wi`` -> GELU -> ``wo``, no biases; a sum over its hidden units
    (:func:`spmd.unit_sum`), so uneven tensor shares give a device its own units."""

    config: LMConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        wi = Kernel((c.d_model, c.mlp), (A.EMBED, A.MLP), name="wi")()
        wo = Kernel((c.mlp, c.d_model), (A.MLP, A.EMBED), name="wo")()

        def feed_forward(x: jax.Array, wi: jax.Array, wo: jax.Array) -> jax.Array:
            h = constrain(nn.gelu(checkpoint_name(_contract(x, wi, 1, c.dtype), "mlp_hidden")), HIDDEN)
            return checkpoint_name(_contract(h, wo, 1, c.dtype), "mlp_out")

        return unit_sum(feed_forward, x, (wi, wo), (1, 0), A.MLP)


class Block(nn.Module):
    """One pre-LayerNorm transformer block; returns ``(x, None)`` so ``nn.scan`` can carry ``x``."""

    config: LMConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
        c = self.config
        x = checkpoint_name(x, "layer_input")
        x = constrain(x + CausalSelfAttention(c, name="attn")(_layer_norm(c, "ln1")(x)), RESIDUAL)
        x = constrain(x + Mlp(c, name="mlp")(_layer_norm(c, "ln2")(x)), RESIDUAL)
        return x, None


def _token_embed(c: LMConfig, name: str = "embed") -> nn.Embed:
    return nn.Embed(
        c.vocab,
        c.d_model,
        dtype=c.dtype,
        param_dtype=jnp.float32,
        embedding_init=_named(EMBED_INIT, (A.VOCAB, A.EMBED)),
        name=name,
    )


def _position_embed(c: LMConfig, name: str = "pos_embed") -> nn.Embed:
    return nn.Embed(
        c.seq_len,
        c.d_model,
        dtype=c.dtype,
        param_dtype=jnp.float32,
        embedding_init=_named(EMBED_INIT, (A.POSITION, A.EMBED)),
        name=name,
    )


def _lm_head(c: LMConfig, name: str = "lm_head") -> nn.Module:
    # Under a remat policy the head is rematerialised too, so FSDP re-gathers its kernel in the backward pass
    # instead of keeping the full vocab × embed matrix alive across the whole step.
    return c.remat.linen(nn.Dense)(
        c.vocab,
        use_bias=False,
        dtype=c.dtype,
        param_dtype=jnp.float32,
        kernel_init=_named(DENSE_INIT, (A.EMBED, A.VOCAB)),
        name=name,
    )


def scanned(block: type[nn.Module], c: LMConfig) -> Callable[..., nn.Module]:
    """``block`` (returning ``(x, None)``) stacked ``c.layers`` times with ``nn.scan``: its parameters get a
    leading ``"layers"`` dimension, and compile time does not grow with depth. Each scanned step follows the
    remat policy ``c.remat`` (remat before scan; ``prevent_cse`` is unnecessary inside a scan, and off it lets
    XLA optimise the recomputation)."""
    block = c.remat.linen(block, prevent_cse=False)
    return nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=c.layers,
        metadata_params={nn.PARTITION_NAME: A.LAYERS},
    )


def _check_length(c: LMConfig, seq: int) -> None:
    if seq > c.seq_len:
        # The position table has seq_len rows; an out-of-range lookup would silently give NaNs.
        raise ValueError(f"GPT: sequence length {seq} exceeds config.seq_len {c.seq_len}")


class GPT(nn.Module):
    """int32 tokens ``[batch, seq]`` (``seq <= config.seq_len``) -> logits ``[batch, seq, vocab]``."""

    config: LMConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        seq = tokens.shape[-1]
        _check_length(c, seq)
        # Under a load-balanced context-parallel plan the blocks see the sequence in head-tail order.
        x = _token_embed(c)(balance_sequence(tokens))
        positions = _position_embed(c)(sequence_positions(seq))
        x = constrain(x + positions[None], RESIDUAL)

        x, _ = scanned(Block, c)(c, name="layers")(x)

        x = _layer_norm(c, "ln_f")(restore_sequence(x))
        return constrain(_lm_head(c)(x), LOGITS)


def staged(c: LMConfig, loss: Callable[[jax.Array, jax.Array], jax.Array]) -> StagedModel:
    """The GPT cut for pipelining: embeddings, one :class:`Block`, and the final norm, head and ``loss``
    (``loss(logits, tokens)``), each applied to its own part of the GPT's (unboxed) parameters."""

    def embed(params: Any, batch: Any) -> jax.Array:
        p, tokens = params["params"], batch["tokens"]
        _check_length(c, tokens.shape[-1])
        x = _token_embed(c).apply({"params": p["embed"]}, balance_sequence(tokens))
        positions = _position_embed(c).apply({"params": p["pos_embed"]}, sequence_positions(tokens.shape[-1]))
        return constrain(x + positions[None], RESIDUAL)

    def layer(layer_params: Any, x: jax.Array) -> jax.Array:
        return Block(c).apply({"params": layer_params}, x)[0]

    def head_loss(params: Any, x: jax.Array, batch: Any) -> jax.Array:
        p = params["params"]
        x = _layer_norm(c, "ln_f").apply({"params": p["ln_f"]}, restore_sequence(x))
        logits = constrain(_lm_head(c).apply({"params": p["lm_head"]}, x), LOGITS)
        return loss(logits, batch["tokens"])

    return StagedModel(embed=embed, layer=layer, loss=head_loss, activation_names=RESIDUAL)
