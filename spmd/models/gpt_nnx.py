"""The same GPT as :mod:`spmd.models.gpt`, in flax nnx: same parameter paths, shapes and logical names.

Logical names go through ``nnx.with_partitioning`` into each Variable's ``out_sharding`` metadata. The
blocks are created with ``nnx.vmap`` (``transform_metadata`` prepends ``"layers"`` to their names, and
every stacked parameter gets a leading axis of size ``layers``) and run with ``nnx.scan``.

flax 0.12 shards annotated Variables eagerly when they are created and raises without a mesh, so build the
model (``nnx.eval_shape`` included) under ``nnx.use_eager_sharding(False)``; spmd places parameters itself.

>>> import jax
>>> from flax import nnx
>>> from spmd.models.config import LMConfig
>>> with nnx.use_eager_sharding(False):
...     model = nnx.eval_shape(lambda: GPT(LMConfig(layers=2), rngs=nnx.Rngs(0)))
>>> kernel = model.layers.attn.query.kernel
>>> kernel.shape, kernel.get_metadata()["out_sharding"]
((2, 64, 4, 16), ('layers', 'embed', 'heads', 'head_dim'))
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from spmd import axes as A
from spmd._context import constrain
from spmd._context_attention import balance_sequence, restore_sequence, sequence_positions
from spmd._pipeline import StagedModel
from spmd._remat import Remat
from spmd.models.config import LMConfig
from spmd.models.gpt import DENSE_INIT, EMBED_INIT, HEADS, HIDDEN, LOGITS, RESIDUAL, causal_attention
from spmd.models.nnx_module import nnx_module

__all__ = ["GPT", "staged"]


def _named(init: Callable, names: Sequence[str]) -> Callable:
    return nnx.with_partitioning(init, tuple(names))


def _layer_norm(config: LMConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        config.d_model,
        epsilon=1e-6,
        dtype=config.dtype,
        param_dtype=jnp.float32,
        scale_init=_named(nnx.initializers.ones, (A.EMBED,)),
        bias_init=_named(nnx.initializers.zeros, (A.EMBED,)),
        rngs=rngs,
    )


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with ``query``/``key``/``value``/``out`` projections, no biases."""

    def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
        c = config

        def project() -> nnx.LinearGeneral:
            return nnx.LinearGeneral(
                c.d_model,
                (c.heads, c.head_dim),
                use_bias=False,
                dtype=c.dtype,
                param_dtype=jnp.float32,
                kernel_init=_named(DENSE_INIT, (A.EMBED, A.HEADS, A.HEAD_DIM)),
                rngs=rngs,
            )

        self.query, self.key, self.value = project(), project(), project()
        self.out = nnx.LinearGeneral(
            (c.heads, c.head_dim),
            c.d_model,
            axis=(-2, -1),
            use_bias=False,
            dtype=c.dtype,
            param_dtype=jnp.float32,
            kernel_init=_named(DENSE_INIT, (A.HEADS, A.HEAD_DIM, A.EMBED)),
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        # The same activation names as the linen GPT's (spmd._remat.NAMES), for names and offload policies.
        q = checkpoint_name(constrain(self.query(x), HEADS), "query_proj")
        k = checkpoint_name(constrain(self.key(x), HEADS), "key_proj")
        v = checkpoint_name(constrain(self.value(x), HEADS), "value_proj")
        y = checkpoint_name(constrain(causal_attention(q, k, v), HEADS), "attn_out")
        return checkpoint_name(self.out(y), "out_proj")


class Mlp(nnx.Module):
    """The feed-forward half of a block: ``wi`` -> GELU -> ``wo``, no biases."""

    def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
        c = config
        self.wi = nnx.Linear(
            c.d_model,
            c.mlp,
            use_bias=False,
            dtype=c.dtype,
            param_dtype=jnp.float32,
            kernel_init=_named(DENSE_INIT, (A.EMBED, A.MLP)),
            rngs=rngs,
        )
        self.wo = nnx.Linear(
            c.mlp,
            c.d_model,
            use_bias=False,
            dtype=c.dtype,
            param_dtype=jnp.float32,
            kernel_init=_named(DENSE_INIT, (A.MLP, A.EMBED)),
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(nnx.gelu(checkpoint_name(self.wi(x), "mlp_hidden")), HIDDEN)
        return checkpoint_name(self.wo(h), "mlp_out")


class Block(nnx.Module):
    """One pre-LayerNorm transformer block."""

    def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
        self.ln1 = _layer_norm(config, rngs)
        self.attn = CausalSelfAttention(config, rngs=rngs)
        self.ln2 = _layer_norm(config, rngs)
        self.mlp = Mlp(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = checkpoint_name(x, "layer_input")
        x = constrain(x + self.attn(self.ln1(x)), RESIDUAL)
        return constrain(x + self.mlp(self.ln2(x)), RESIDUAL)


def _run_block(x: jax.Array, block: Block) -> jax.Array:
    return block(x)


# The same metadata transform as at creation, so inside the scan body the per-layer Variables' names
# drop the leading "layers" together with the leading axis.
_LAYERS_AXIS = {nnx.PARTITION_NAME: A.LAYERS}


@functools.cache
def _scan_blocks(remat: Remat) -> Callable[[jax.Array, Block], jax.Array]:
    # Remat inside the scan body: each scanned step follows the policy in the backward pass (prevent_cse is
    # unnecessary inside scan, and off it lets XLA optimise the recomputation).
    body = nnx.remat(_run_block, policy=remat.policy(), prevent_cse=False) if remat else _run_block
    return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=_LAYERS_AXIS)


@functools.cache
def _head(remat: Remat) -> Callable[[nnx.Linear, jax.Array], jax.Array]:
    run = lambda head, x: head(x)  # noqa: E731
    return nnx.remat(run, policy=remat.policy()) if remat else run


class GPT(nnx.Module):
    """int32 tokens ``[batch, seq]`` (``seq <= config.seq_len``) -> logits ``[batch, seq, vocab]``."""

    def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = nnx.Embed(
            c.vocab,
            c.d_model,
            dtype=c.dtype,
            param_dtype=jnp.float32,
            embedding_init=_named(EMBED_INIT, (A.VOCAB, A.EMBED)),
            rngs=rngs,
        )
        self.pos_embed = nnx.Embed(
            c.seq_len,
            c.d_model,
            dtype=c.dtype,
            param_dtype=jnp.float32,
            embedding_init=_named(EMBED_INIT, (A.POSITION, A.EMBED)),
            rngs=rngs,
        )

        # One Block per layer, stacked along a new leading axis; split_rngs gives each its own key.
        @nnx.split_rngs(splits=c.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_LAYERS_AXIS)
        def make_layers(rngs: nnx.Rngs) -> Block:
            return Block(c, rngs=rngs)

        self.layers = make_layers(rngs)
        self.ln_f = _layer_norm(c, rngs)
        self.lm_head = nnx.Linear(
            c.d_model,
            c.vocab,
            use_bias=False,
            dtype=c.dtype,
            param_dtype=jnp.float32,
            kernel_init=_named(DENSE_INIT, (A.EMBED, A.VOCAB)),
            rngs=rngs,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        seq = tokens.shape[-1]
        if seq > c.seq_len:
            # The position table has seq_len rows; an out-of-range lookup would silently give NaNs.
            raise ValueError(f"GPT: sequence length {seq} exceeds config.seq_len {c.seq_len}")
        # Under a load-balanced context-parallel plan the blocks see the sequence in head-tail order.
        x = self.embed(balance_sequence(tokens)) + self.pos_embed(sequence_positions(seq))[None]
        x = _scan_blocks(c.remat)(constrain(x, RESIDUAL), self.layers)
        x = self.ln_f(restore_sequence(x))
        # Under a remat policy the head is rematerialised too (see the linen GPT).
        logits = _head(c.remat)(self.lm_head, x)
        return constrain(logits, LOGITS)


def staged(config: LMConfig, loss: Callable[[jax.Array, jax.Array], jax.Array]) -> StagedModel:
    """The GPT cut for pipelining, running its own nnx modules: the embeddings, one :class:`Block` (the stacked
    layers' per-layer slice) and the final norm, head and ``loss`` (``loss(logits, tokens)``), each module
    rebuilt from its part of the parameters."""
    c = config
    with nnx.use_eager_sharding(False):
        whole = nnx.eval_shape(lambda: GPT(c, rngs=nnx.Rngs(0)))
        one_block = nnx.eval_shape(lambda: Block(c, rngs=nnx.Rngs(0)))

    def part(module: nnx.Module) -> Callable[[dict], nnx.Module]:
        graphdef, abstract = nnx.split(module, nnx.Param)
        flat = list(nnx.to_flat_state(abstract))
        return lambda values: nnx_module(graphdef, flat, values)

    embed_, pos_embed_, block_, ln_f_, lm_head_ = map(
        part, (whole.embed, whole.pos_embed, one_block, whole.ln_f, whole.lm_head)
    )

    def embed(params: dict, batch: dict) -> jax.Array:
        p, tokens = params["params"], batch["tokens"]
        seq = tokens.shape[-1]
        if seq > c.seq_len:
            raise ValueError(f"GPT: sequence length {seq} exceeds config.seq_len {c.seq_len}")
        x = embed_(p["embed"])(balance_sequence(tokens)) + pos_embed_(p["pos_embed"])(sequence_positions(seq))[None]
        return constrain(x, RESIDUAL)

    def layer(layer_params: dict, x: jax.Array) -> jax.Array:
        return block_(layer_params)(x)

    def head_loss(params: dict, x: jax.Array, batch: dict) -> jax.Array:
        p = params["params"]
        logits = constrain(lm_head_(p["lm_head"])(ln_f_(p["ln_f"])(restore_sequence(x))), LOGITS)
        return loss(logits, batch["tokens"])

    return StagedModel(embed=embed, layer=layer, loss=head_loss, activation_names=RESIDUAL)
