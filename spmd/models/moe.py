"""A GPT whose feed-forward half is a mixture of experts (GShard/Switch style), in flax linen.

Attention, layer norms, embeddings and head are gpt.py's; each block's MLP is replaced by ``experts`` GELU MLPs
stacked on a leading ``"expert"`` dimension, and a router sends every token to its ``top_k`` experts.

Routing has static shapes: every sequence is one *group* (so routing never depends on how the batch is split
over devices), and every expert takes at most ``capacity = ceil(capacity_factor * top_k * seq / experts)``
tokens of a group. Dispatch and combine are einsums with one-hot tensors ``[group, seq, expert, capacity]``;
first choices claim capacity before second choices, and a token an expert has no room for skips that expert
(the residual carries it). Gates are the router's softmax probabilities of the chosen experts, renormalised
over them when ``top_k > 1`` (GShard; top-1 keeps the probability, as Switch does, so the router still learns).

Under an expert-parallel plan (``"expert"`` mapped to a mesh axis, batch split over the same axis), the tokens
are dispatched where they are (``[expert, group, capacity, embed]``, groups split like the batch), resharded
expert-major (experts over their axis, groups over the batch axes left free: ``data`` under ``dp+ep``), and the
experts' outputs resharded group-major again before the combine: XLA moves them with two all-to-alls per layer
(four with the backward pass, six with ``remat``). Routing (an argmax per choice) stays local to each device.

No load-balancing auxiliary loss: spmd's loss is the next-token cross-entropy of the logits, and the model's
output stays just the logits. Parameter paths (``nn.scan`` prepends ``"layers"``)::

    params/layers/moe/router     (layers, embed, None)              replicated by design: every token needs it
    params/layers/moe/wi         (layers, expert, embed, mlp)
    params/layers/moe/wo         (layers, expert, mlp, embed)
    ... and gpt.py's embed, pos_embed, ln1, attn, ln2, ln_f, lm_head

>>> import jax
>>> from spmd.models.config import LMConfig
>>> model = MoeGPT(LMConfig(layers=2))
>>> tokens = jax.numpy.zeros((2, 32), jax.numpy.int32)
>>> params = jax.eval_shape(model.init, jax.random.key(0), tokens)
>>> box = params["params"]["layers"]["moe"]["wi"]
>>> box.names, box.value.shape
(('layers', 'expert', 'embed', 'mlp'), (2, 8, 64, 256))
>>> jax.eval_shape(model.apply, params, tokens).shape
(2, 32, 256)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from spmd import axes as A
from spmd._context import active, constrain
from spmd.models.config import LMConfig
from spmd.models.gpt import (
    DENSE_INIT,
    EMBED_INIT,
    LOGITS,
    RESIDUAL,
    CausalSelfAttention,
    _layer_norm,
    _named,
    scanned,
)

__all__ = ["MoeGPT", "MoeMlp", "capacity", "route"]

# Activations seen from the experts: expert-major, then the groups, the capacity slots, the features.
EXPERT_TOKENS = (A.EXPERT, None, None, A.EMBED)
EXPERT_HIDDEN = (A.EXPERT, None, None, A.MLP)
# The experts' outputs, back to group-major (groups over the batch axes) before they are combined.
GROUP_TOKENS = (None, A.BATCH, None, A.EMBED)
# lecun_normal on the stacked kernels [expert, in, out]: fans from each expert's own matrix.
EXPERT_INIT = nn.initializers.lecun_normal(batch_axis=(0,))


def capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert and group: ``ceil(capacity_factor * top_k * tokens / experts)``, at least 1.

    >>> capacity(32, 8, 2, 1.25)
    10
    """
    return max(1, math.ceil(capacity_factor * top_k * tokens / experts))


def route(logits: jax.Array, top_k: int, slots: int) -> tuple[jax.Array, jax.Array]:
    """Top-k routing with a fixed capacity: router logits ``[group, seq, expert]`` -> ``(dispatch, combine)``,
    both ``[group, seq, expert, slots]``: dispatch is one where a token takes a slot, combine its gate there.

    All first choices of a group claim slots (in sequence order) before any second choice; a choice that finds
    its expert full is dropped.

    >>> logits = jnp.array([[[2.0, 0.0], [3.0, 0.0], [0.0, 1.0]]])  # 3 tokens, 2 experts, top-1, 1 slot each
    >>> dispatch, combine = route(logits, top_k=1, slots=1)
    >>> dispatch[0, :, :, 0].astype(int).tolist()  # token 1 finds expert 0 full
    [[1, 0], [0, 0], [0, 1]]
    """
    groups, seq, experts = logits.shape
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    # k rounds of argmax rather than lax.top_k: XLA's partitioner splits an argmax along the batch, but gathers
    # lax.top_k's whole operand onto every device (the router's probabilities for the global batch).
    remaining, picks = probs, []
    for _ in range(top_k):
        pick = jax.nn.one_hot(jnp.argmax(remaining, axis=-1), experts, dtype=jnp.float32)
        picks.append(pick)
        remaining = jnp.where(pick > 0, -1.0, remaining)  # probabilities are >= 0: never picked again
    choice = jnp.stack(picks, axis=2)  # [group, seq, k, expert]
    gates = jnp.sum(choice * probs[:, :, None, :], axis=-1)  # [group, seq, k]
    if top_k > 1:  # GShard: renormalised over the chosen experts; Switch (top-1) keeps the probability
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    # Choice-major order (all first choices, then all second choices), then a running count per expert.
    ordered = jnp.swapaxes(choice, 1, 2).reshape(groups, top_k * seq, experts)
    position = jnp.sum((jnp.cumsum(ordered, axis=1) - 1.0) * ordered, axis=-1)
    position = jnp.swapaxes(position.reshape(groups, top_k, seq), 1, 2).astype(jnp.int32)  # [group, seq, k]
    slot = jax.nn.one_hot(position, slots, dtype=jnp.float32)  # all zeros past the capacity: dropped
    dispatch = jnp.einsum("gske,gskc->gsec", choice, slot)
    combine = jnp.einsum("gsk,gske,gskc->gsec", gates, choice, slot)
    return dispatch, combine


def _constrain_expert_major(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """:func:`spmd.constrain` for ``[expert, group, ...]`` activations, the groups also split over the plan's batch
    axes that the expert dimension does not use.

    Under ``dp+ep`` (batch over data × expert, experts over expert) the groups stay split over ``data`` instead of
    being gathered onto every data replica; under plain ``ep`` (batch and experts on one axis) they are whole.
    """
    current = active()
    if current is None:
        return x
    plan, mesh = current
    spec = list(plan.activation_spec(tuple(names), x.shape, mesh))
    used = {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
    free = tuple(a for a in plan.batch_axes if a not in used)
    if free and x.shape[1] % math.prod(mesh.shape[a] for a in free) == 0:
        spec[1] = free[0] if len(free) == 1 else free
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


class MoeMlp(nn.Module):
    """``experts`` GELU MLPs (``wi`` -> GELU -> ``wo``, no biases) behind a top-``top_k`` router with a fixed
    capacity per expert and group; ``[batch, seq, embed]`` -> ``[batch, seq, embed]``, one group per sequence."""

    config: LMConfig
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"MoeMlp: top_k ({self.top_k}) must be between 1 and experts ({self.experts})")
        _, seq, _ = x.shape
        slots = capacity(seq, self.experts, self.top_k, self.capacity_factor)
        # The router's expert dimension is deliberately unnamed: a plan must not split it (every token needs
        # every expert's logit), and the kernel is tiny.
        router = self.param("router", _named(DENSE_INIT, (A.EMBED, None)), (c.d_model, self.experts), jnp.float32)
        wi = self.param(
            "wi", _named(EXPERT_INIT, (A.EXPERT, A.EMBED, A.MLP)), (self.experts, c.d_model, c.mlp), jnp.float32
        )
        wo = self.param(
            "wo", _named(EXPERT_INIT, (A.EXPERT, A.MLP, A.EMBED)), (self.experts, c.mlp, c.d_model), jnp.float32
        )

        x = constrain(x, RESIDUAL)
        logits = jnp.einsum("gsm,me->gse", x, router.astype(x.dtype), preferred_element_type=jnp.float32)
        dispatch, combine = route(logits, self.top_k, slots)
        # Group-major tokens -> expert-major slots: with groups split over an axis and experts over the same
        # axis, the partitioner moves them with an all-to-all.
        tokens = jnp.einsum("gsec,gsm->egcm", dispatch.astype(x.dtype), x)
        # Dispatched where the tokens are (group-major), then resharded: without the first constraint XLA may
        # gather the whole batch onto every device instead (it does under ep+tp).
        tokens = _constrain_expert_major(constrain(tokens, GROUP_TOKENS), EXPERT_TOKENS)
        h = jnp.einsum("egcm,emh->egch", tokens, wi.astype(x.dtype))
        h = _constrain_expert_major(nn.gelu(checkpoint_name(h, "mlp_hidden")), EXPERT_HIDDEN)
        out = jnp.einsum("egch,ehm->egcm", h, wo.astype(x.dtype))
        out = _constrain_expert_major(out, EXPERT_TOKENS)
        # Back to group-major (the second all-to-all), then each token sums its experts' outputs.
        out = constrain(out, GROUP_TOKENS)
        return checkpoint_name(jnp.einsum("gsec,egcm->gsm", combine.astype(x.dtype), out), "mlp_out")


class MoeBlock(nn.Module):
    """gpt.py's pre-LayerNorm block with the MLP replaced by :class:`MoeMlp`; returns ``(x, None)`` for scan."""

    config: LMConfig
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
        c = self.config
        x = checkpoint_name(x, "layer_input")  # the remat policies' names, as gpt.py's Block tags them
        x = constrain(x + CausalSelfAttention(c, name="attn")(_layer_norm(c, "ln1")(x)), RESIDUAL)
        moe = MoeMlp(c, self.experts, self.top_k, self.capacity_factor, name="moe")
        x = constrain(x + moe(_layer_norm(c, "ln2")(x)), RESIDUAL)
        return x, None


class MoeGPT(nn.Module):
    """int32 tokens ``[batch, seq]`` (``seq <= config.seq_len``) -> logits ``[batch, seq, vocab]``; gpt.py's GPT
    with mixture-of-experts MLPs."""

    config: LMConfig
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        seq = tokens.shape[-1]
        if seq > c.seq_len:
            raise ValueError(f"MoeGPT: sequence length {seq} exceeds config.seq_len {c.seq_len}")
        x = nn.Embed(
            c.vocab,
            c.d_model,
            dtype=c.dtype,
            param_dtype=jnp.float32,
            embedding_init=_named(EMBED_INIT, (A.VOCAB, A.EMBED)),
            name="embed",
        )(tokens)
        positions = nn.Embed(
            c.seq_len,
            c.d_model,
            dtype=c.dtype,
            param_dtype=jnp.float32,
            embedding_init=_named(EMBED_INIT, (A.POSITION, A.EMBED)),
            name="pos_embed",
        )(jnp.arange(seq))
        x = constrain(x + positions[None], RESIDUAL)

        x, _ = scanned(MoeBlock, c)(c, self.experts, self.top_k, self.capacity_factor, name="layers")(x)

        x = _layer_norm(c, "ln_f")(x)
        logits = c.remat.linen(nn.Dense)(
            c.vocab,
            use_bias=False,
            dtype=c.dtype,
            param_dtype=jnp.float32,
            kernel_init=_named(DENSE_INIT, (A.EMBED, A.VOCAB)),
            name="lm_head",
        )(x)
        return constrain(logits, LOGITS)
