"""Context parallelism in a trace (the plan part, its block tables and its checks are
:mod:`spmd._context_parallel`): the sequence moved into head-tail order and back (:func:`balance_sequence`,
:func:`restore_sequence`, :func:`sequence_positions`), and causal attention across the context axis
(:func:`attention`) inside a ``jax.shard_map``, by all-gather, ring or all-to-all, blockwise with an online softmax.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from spmd import axes as A
from spmd._context_parallel import BLOCK_SCOPE, ContextParallel, block_kinds, exchanges, halves
from spmd._rules import PlanError
from spmd._sequence_order import current_order, note_order

__all__ = ["attention", "balance_sequence", "causal_attention", "restore_sequence", "sequence_positions"]


# ------------------------------------------------------------------------------------------------ the active plan
def _active() -> tuple[ContextParallel, Any, int] | None:
    """The active plan's context-parallel part, the mesh to run on and the axis size; None if the plan has none
    or the axis is one device."""
    from spmd._context import active

    current = active()
    if current is None:
        return None
    plan, mesh = current
    parts = [p for p in plan.parts if isinstance(p, ContextParallel)]
    if not parts or mesh.shape.get(parts[0].axis, 1) == 1:
        return None
    context = jax.sharding.get_abstract_mesh()
    return parts[0], mesh if context.empty else context, mesh.shape[parts[0].axis]


def _manual(names: tuple[str | None, ...], shape: tuple[int, ...]) -> tuple[Any, P]:
    """The mesh and the spec to run a ``shard_map`` over an activation named ``names``: manual over every axis
    the plan lays it out on (the batch's and the heads' axes too, so each device computes only its own rows and
    heads), except axes already manual in the context (an enclosing ``shard_map``'s)."""
    from spmd._context import active

    plan, mesh = active()
    context = jax.sharding.get_abstract_mesh()
    manual = set() if context.empty else set(context.manual_axes)
    local = {a: 1 if a in manual else n for a, n in mesh.shape.items()}
    spec = plan.activation_spec(names, shape, local)
    # An enclosing shard_map's axes (the batch's under gradient accumulation) are already this device's part.
    kept = lambda e: tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a not in manual) or None  # noqa: E731
    spec = P(*[kept(entry) for entry in spec])
    return (mesh if context.empty else context), spec


def _in_branches() -> bool:
    """Whether the active plan runs its model inside per-device branches (an execution mode: a pipeline)."""
    from spmd._context import active

    return active()[0].execution is not None


def _axes_of(spec: P) -> set[str]:
    return {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}


def _balanced() -> tuple[ContextParallel, Any, int] | None:
    current = _active()
    return current if current is not None and current[0].load_balance else None


# -------------------------------------------------------------------------------------- sequence order
def _moved(x: jax.Array, dim: int, restore: bool) -> jax.Array:
    """``x``'s sequence (``dim``, split over the context axis) moved between consecutive and head-tail order."""
    part, _, ways = _balanced()
    part.check_length(x.shape[dim], ways, "spmd.balance_sequence")
    note_order(restored=restore)
    if _in_branches():
        return _moved_by_gather(x, dim, restore, part.axis, ways)
    pairs = exchanges(ways)
    if restore:
        pairs = [[(b, a) for a, b in exchange] for exchange in pairs]

    def body(local: jax.Array) -> jax.Array:
        # Head-tail device j holds j then 2c-1-j, so on odd devices the odd half-chunk comes first.
        odd = jax.lax.axis_index(part.axis) % 2 == 1
        swapped = lambda y: jnp.where(odd, jnp.roll(y, y.shape[dim] // 2, dim), y)  # noqa: E731
        even_half, odd_half = jnp.split(swapped(local) if restore else local, 2, axis=dim)
        # A device whose half-chunk stays keeps it; ppermute gives zeros to a device nothing is sent to.
        me = jax.lax.axis_index(part.axis)
        kept = lambda half, moves: jnp.where(_sends(me, moves), jax.lax.ppermute(half, part.axis, moves), half)  # noqa: E731
        moved = jnp.concatenate([kept(even_half, pairs[0]), kept(odd_half, pairs[1])], dim)
        return moved if restore else swapped(moved)

    names = tuple(A.BATCH if d == 0 and dim > 0 else A.SEQ if d == dim else None for d in range(x.ndim))
    mesh, spec = _manual(names, x.shape)
    run = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=_axes_of(spec), check_vma=False)
    return run(x)


def _moved_by_gather(x: jax.Array, dim: int, restore: bool, axis: str, ways: int) -> jax.Array:
    """:func:`_moved` by one all-gather over ``axis`` and a local take, for a sequence moved inside per-device
    branches (see :func:`context_part`): the gather names one stage's devices, the two exchanges' permutes every
    stage's. It moves (c − 1)/c of the sequence where the exchanges move at most half of it."""
    laid_out = order(x.shape[dim], ways, True)  # laid-out position i holds original position laid_out[i]
    table = (np.argsort(laid_out) if restore else laid_out).reshape(ways, -1)

    def body(local: jax.Array) -> jax.Array:
        whole = jax.lax.all_gather(local, axis, axis=dim, tiled=True)
        return jnp.take(whole, jnp.asarray(table)[jax.lax.axis_index(axis)], axis=dim)

    names = tuple(A.BATCH if d == 0 and dim > 0 else A.SEQ if d == dim else None for d in range(x.ndim))
    mesh, spec = _manual(names, x.shape)
    run = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=_axes_of(spec), check_vma=False)
    return run(x)


def _sends(me: jax.Array, moves: list[tuple[int, int]]) -> jax.Array:
    """Whether device ``me`` receives anything in ``moves`` (a device nothing moves to keeps its own half)."""
    receivers = [b for _, b in moves]
    return jnp.isin(me, jnp.asarray(receivers, jnp.int32)) if receivers else jnp.bool_(False)


def balance_sequence(x: jax.Array, *, dim: int = 1) -> jax.Array:
    """``x`` with its sequence dimension ``dim`` in the active plan's load-balanced (head-tail) order; ``x``
    itself without a load-balanced context-parallel plan. Call it once on the tokens (or the residual stream)
    before the first attention, and :func:`restore_sequence` before the loss.

    >>> import jax.numpy as jnp
    >>> balance_sequence(jnp.arange(4)[None]).tolist()  # no plan active: unchanged
    [[0, 1, 2, 3]]
    """
    return x if _balanced() is None else _moved(x, dim, restore=False)


def restore_sequence(x: jax.Array, *, dim: int = 1) -> jax.Array:
    """``x`` (in the order :func:`balance_sequence` made) with its sequence back in order.

    >>> import jax.numpy as jnp
    >>> restore_sequence(jnp.arange(4)[None]).tolist()
    [[0, 1, 2, 3]]
    """
    return x if _balanced() is None else _moved(x, dim, restore=True)


def order(length: int, ways: int, balanced: bool) -> np.ndarray:
    """The original positions of a sequence of ``length`` in its laid-out order over ``ways`` devices.

    >>> order(8, 2, True).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if not balanced or ways == 1:
        return np.arange(length)
    h = length // (2 * ways)
    return np.concatenate([np.arange(m * h, (m + 1) * h) for d in range(ways) for m in halves(d, ways, True)])


def sequence_positions(length: int) -> jax.Array:
    """The positions ``0..length-1`` in the order the active plan lays the sequence out (see
    :func:`balance_sequence`): what a model's position embedding reads.

    >>> sequence_positions(4).tolist()
    [0, 1, 2, 3]
    """
    current = _balanced()
    if current is None:
        return jnp.arange(length)
    current[0].check_length(length, current[2], "spmd.sequence_positions")
    return jnp.asarray(order(length, current[2], True))


# ---------------------------------------------------------------------------------------------------- attention
def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    return s / math.sqrt(q.shape[-1])


def _masked(scores: jax.Array, visible: jax.Array) -> jax.Array:
    # finfo.min rather than -inf: a row with nothing visible would turn into NaNs.
    return jnp.where(visible, scores, jnp.finfo(jnp.float32).min)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Causal softmax attention over ``[batch, seq, heads, head_dim]``, scores and softmax in float32; a query
    sees the keys at positions up to its own (``positions``: the sequence's, default ``0..seq-1``).

    >>> x = jnp.ones((1, 3, 2, 4))
    >>> causal_attention(x, x, x).shape
    (1, 3, 2, 4)
    """
    positions = jnp.arange(q.shape[1]) if positions is None else positions
    visible = positions[:, None] >= positions[None, :]
    probs = jax.nn.softmax(_masked(_scores(q, k), visible), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _block(state: tuple, q: jax.Array, k: jax.Array, v: jax.Array, kind: jax.Array) -> tuple:
    """One key block folded into a query block's online softmax ``(max, sum, out)``."""

    def fold(masked: bool) -> tuple:
        m, total, out = state
        s = _scores(q, k)
        if masked:
            s = _masked(s, jnp.tril(jnp.ones(s.shape[-2:], bool)))
        new_m = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - new_m[..., None])
        scale = jnp.exp(m - new_m)
        new_out = out * jnp.moveaxis(scale, 1, 2)[..., None]
        new_out = new_out + jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return new_m, total * scale + p.sum(-1), new_out

    with jax.named_scope(BLOCK_SCOPE):
        return jax.lax.switch(kind, [lambda: state, lambda: fold(True), lambda: fold(False)])


def _blocks(q: jax.Array, kv_steps: Any, kinds: jax.Array, *, ring: bool | str, axis: str) -> jax.Array:
    """Attention of the local query halves over the key/value blocks of every step (see :func:`block_kinds`):
    gathered (``kv_steps`` the blocks of every step), by the ring (``ring``, ``kv_steps`` this device's block), or
    by the ring between neighbour pairs (``ring="paired"``)."""
    b, s, h, d = q.shape
    qs = jnp.split(q, 2, axis=1)
    start = (jnp.full((b, h, s // 2), jnp.finfo(jnp.float32).min), jnp.zeros((b, h, s // 2)))
    states = tuple((*start, jnp.zeros((b, s // 2, h, d), jnp.float32)) for _ in qs)

    def step(states: tuple, k: jax.Array, v: jax.Array, kind: jax.Array) -> tuple:
        ks, vs = jnp.split(k, 2, axis=1), jnp.split(v, 2, axis=1)
        return tuple(
            functools.reduce(lambda st, j: _block(st, qs[i], ks[j], vs[j], kind[i, j]), (0, 1), states[i])
            for i in (0, 1)
        )

    if ring == "paired":
        states = _paired_ring(step, states, kv_steps, kinds, axis)
    elif ring:
        ways = kinds.shape[0]
        k, v = kv_steps
        perm = [(i, (i + 1) % ways) for i in range(ways)]

        def turn(carry: tuple, kind: jax.Array) -> tuple:
            states, k, v = carry
            # Send the block on before computing with it, so the exchange can overlap the computation.
            nk, nv = jax.lax.ppermute(k, axis, perm), jax.lax.ppermute(v, axis, perm)
            return (step(states, k, v, kind), nk, nv), None

        (states, k, v), _ = jax.lax.scan(turn, (states, k, v), kinds[:-1])
        states = step(states, k, v, kinds[-1])
    else:
        states, _ = jax.lax.scan(lambda st, x: (step(st, *x), None), states, (*kv_steps, kinds))
    outs = [out / jnp.moveaxis(total, 1, 2)[..., None] for _, total, out in states]
    return jnp.concatenate(outs, axis=1).astype(q.dtype)


def _pass_on(left: tuple, right: tuple, axis: str, ways: int, *, last: bool = False) -> tuple:
    """One step of the ring between neighbour pairs: every device's leftward blocks (``left``, the keys and
    values of device + t) go to its left neighbour and its rightward ones (``right``, of device − t) to its right,
    by two all-gathers over pairs, (0 1)(2 3)... then (1 2)(3 4)...(c−1 0): in each a device offers its partner
    the stream travelling the partner's way. ``last``: the first round only, which hands every device the
    opposite device's blocks (an even axis's last step). Returns the new ``(left, right)``, or the last blocks."""
    me = jax.lax.axis_index(axis)
    even = me % 2 == 0

    def trade(offers_right: jax.Array, groups: list[list[int]]) -> tuple:
        slot = np.zeros(ways, np.int32)  # where the partner's offer lands in the pair's gather
        for a, b in groups:
            slot[a], slot[b] = 1, 0
        offer = jax.tree.map(lambda a, b: jnp.where(offers_right, a, b), right, left)
        partner = jnp.asarray(slot)[me]
        return jax.tree.map(lambda x: jax.lax.all_gather(x, axis, axis_index_groups=groups)[partner], offer)

    first = trade(even, [[i, i + 1] for i in range(0, ways, 2)])
    if last:
        return first
    second = trade(~even, [[i, (i + 1) % ways] for i in range(1, ways, 2)])
    pick = lambda a, b: jax.tree.map(lambda x, y: jnp.where(even, x, y), a, b)  # noqa: E731
    return pick(first, second), pick(second, first)


def _paired_ring(step: Any, states: tuple, kv: tuple, kinds: jax.Array, axis: str) -> tuple:
    """``states`` with every step's blocks folded in, in the order of ``sources(paired=True)``: each exchange is
    issued before the blocks already held are computed, so it can overlap them."""
    ways = kinds.shape[0]
    both, opposite = (ways - 1) // 2, ways % 2 == 0  # steps that receive from both sides; an even axis's last
    if both == 0:  # two devices: the other's blocks only
        other = _pass_on(kv, kv, axis, ways, last=True)
        return step(step(states, *kv, kinds[0]), *other, kinds[1])
    pairs = kinds[1 : 1 + 2 * both].reshape(both, 2, *kinds.shape[1:])
    held = _pass_on(kv, kv, axis, ways)
    states = step(states, *kv, kinds[0])

    def turn(carry: tuple, pair: jax.Array) -> tuple:
        states, (left, right) = carry
        passed = _pass_on(left, right, axis, ways)
        return (step(step(states, *left, pair[0]), *right, pair[1]), passed), None

    (states, (left, right)), _ = jax.lax.scan(turn, (states, held), pairs[:-1])
    last = _pass_on(left, right, axis, ways, last=True) if opposite else None
    states = step(step(states, *left, pairs[-1][0]), *right, pairs[-1][1])
    return step(states, *last, kinds[-1]) if opposite else states


def _sharded(part: ContextParallel, ways: int, length: int) -> Any:
    """The per-device body of :func:`attention` for ``part``'s method."""
    axis = part.axis
    if part.method == "alltoall":
        positions = jnp.asarray(order(length, ways, part.load_balance))

        def ulysses(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            heads = lambda x: jax.lax.all_to_all(x, axis, 2, 1, tiled=True)  # noqa: E731
            out = causal_attention(heads(q), heads(k), heads(v), positions)
            return jax.lax.all_to_all(out, axis, 1, 2, tiled=True)

        return ulysses
    ring = part.method == "ring"
    # Inside a pipeline's branches a collective-permute would wait for the other stages (see context_part).
    paired = ring and _in_branches()
    table = block_kinds(ways, part.load_balance, ring=ring, paired=paired)

    def blockwise(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        kinds = jnp.asarray(table)[jax.lax.axis_index(axis)]
        if ring:
            return _blocks(q, (k, v), kinds, ring="paired" if paired else True, axis=axis)
        gathered = jax.lax.all_gather(k, axis), jax.lax.all_gather(v, axis)
        return _blocks(q, gathered, kinds, ring=False, axis=axis)

    return blockwise


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal self-attention over ``[batch, seq, heads, head_dim]`` (scores and softmax in float32), across the
    context axis when the active plan is context parallel (see the module's text); plain attention otherwise.
    A model of your own calls it in place of its attention, and with a load-balanced plan puts its sequence in
    order around it (:func:`balance_sequence`, :func:`restore_sequence`, :func:`sequence_positions`).

    >>> import spmd
    >>> x = jnp.ones((1, 4, 2, 8))
    >>> spmd.attention(x, x, x).shape
    (1, 4, 2, 8)
    """
    current = _active()
    if current is None:
        return causal_attention(q, k, v)
    part, _, ways = current
    length = q.shape[1]
    part.check_length(length, ways, "spmd.attention")
    if part.load_balance:
        tracked = current_order()
        if tracked is not None and tracked.balanced == 0:
            raise PlanError(
                "spmd.attention: the plan's context parallelism is load-balanced, but the model did not put its "
                "sequence in head-tail order: call spmd.balance_sequence on the tokens before the first attention "
                "(positions from spmd.sequence_positions) and spmd.restore_sequence before the loss, or use "
                "context_parallel(load_balance=False)"
            )
    mesh, spec = _manual((A.BATCH, A.SEQ, A.HEADS, A.HEAD_DIM), q.shape)
    heads = q.shape[2] // math.prod(mesh.shape[a] for a in _axes_of(P(spec[2])))
    if part.method == "ring" and ways % 2 and _in_branches():
        raise PlanError(
            f"spmd.attention: method ring inside a pipeline passes blocks between pairs of neighbours on "
            f"{part.axis}, which needs an even number of devices there ({ways}); use an even context axis, or "
            f"method allgather or alltoall"
        )
    if part.method == "alltoall" and heads % ways:
        raise PlanError(
            f"spmd.attention: method alltoall splits the heads over {part.axis} ({ways} ways), but a device holds "
            f"{heads} heads; use a context axis that divides them, or method allgather or ring"
        )
    run = jax.shard_map(
        _sharded(part, ways, length), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, axis_names=_axes_of(spec),
        check_vma=False,
    )  # fmt: skip
    return run(q, k, v)
