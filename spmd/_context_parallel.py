"""Context parallelism: the sequence split over a mesh axis, attention computed with every device's keys.

A plan part (:class:`ContextParallel`) maps the activations' ``seq`` dimension to the ``context`` axis, so every
position-wise computation (embeddings, norms, MLPs, projections) works on its own slice of the sequence, and
:func:`attention` computes causal self-attention across the slices inside a ``jax.shard_map`` manual over the
axes the activation is laid out on (the batch's, the context axis, the heads'), each device on its own part:

- ``allgather``: each device gathers the whole sequence's keys and values (Levanter, MaxText's default);
- ``ring``: key/value blocks travel around the ring in ``c − 1`` steps, each step sending the next block before
  computing on the current one, accumulated by online softmax (Liu et al., ring attention);
- ``alltoall``: an all-to-all trades the sequence split for a split of the heads, every device attends over the
  whole sequence for its heads, and a second all-to-all trades back (DeepSpeed Ulysses).

Causal attention costs a query as many keys as precede it, so a device holding the end of the sequence works ``c``
times harder than one holding its start. With ``load_balance`` the sequence is laid out head-tail: cut into ``2c``
half-chunks, device ``j`` holds half-chunks ``j`` and ``2c − 1 − j`` (torchtitan, MaxText's ``load_balance``), so
every device attends to ``2c + 1`` half-chunk blocks. A model moves its sequence into that order once with
:func:`balance_sequence` (the built-in GPTs balance their tokens and read positions from
:func:`sequence_positions`) and back once with :func:`restore_sequence` before anything that reads neighbours
(the loss's next-token shift); between the two, attention knows the order from the plan.

Blocks are half-chunks: a query half attends to a key half fully (the keys all precede it), under the causal mask
(the same half), or not at all. Which applies where is a per-device table (:func:`block_kinds`), chosen in the
program by ``lax.switch``, so the compiled program skips the masked blocks and its attention work per device is
the table's count.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from spmd import axes as A
from spmd._rules import PlanError
from spmd._sequence_order import current_order, note_order

__all__ = [
    "METHODS",
    "ContextParallel",
    "attention",
    "balance_sequence",
    "block_kinds",
    "restore_sequence",
    "sequence_positions",
]

METHODS = ("allgather", "ring", "alltoall")
SKIP, MASKED, FULL = 0, 1, 2  # a block's kind: no work, causal mask within the block, every key visible
BLOCK_SCOPE = "spmd_context_block"  # the switch over a block's kinds, named for the compiled program's counts


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The plan part of context parallelism: ``seq`` over ``axis``, attention by ``method``, head-tail order
    with ``load_balance``. It lays out no parameter (they are replicated over ``axis``, and their gradients
    all-reduced there, unless another part splits them).

    >>> part = ContextParallel("context", "ring")
    >>> part.logical_rules(), part.describe()
    ((('seq', ('context',)),), 'context parallel over context (ring, load-balanced)')
    """

    axis: str = "context"
    method: str = "allgather"
    load_balance: bool = True
    source = "context_parallel"
    roles = ("params",)
    after_rules = False
    reports_idle = True  # it splits activations, not arrays of the training state

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise PlanError(f"context_parallel: unknown method {self.method!r}; choose one of {', '.join(METHODS)}")

    def propose(self, leaf: Any, taken: Any, sizes: Mapping[str, int] | None) -> None:
        return None

    def axes(self) -> frozenset[str]:
        return frozenset({self.axis})

    def logical_rules(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return ((A.SEQ, (self.axis,)),)

    def unused(self, hits: set[int]) -> list[str]:
        return []

    def advice(self, hits: set[Hashable]) -> list[str]:
        return []

    def blocks_per_device(self, ways: int) -> list[int]:
        """How many of its ``4·ways`` half-chunk blocks each device computes (the others are masked out):
        equal with ``load_balance``, rising with the device's place in the sequence without (``alltoall``
        attends densely: all of them).

        >>> ContextParallel().blocks_per_device(4), ContextParallel(load_balance=False).blocks_per_device(4)
        ([9, 9, 9, 9], [3, 7, 11, 15])
        """
        if self.method == "alltoall":
            return [4 * ways] * ways
        kinds = block_kinds(ways, self.load_balance, ring=self.method == "ring")
        return [int(n) for n in (kinds != SKIP).sum(axis=(1, 2, 3))]

    def pieces(self, ways: int) -> tuple[int, str]:
        """What the sequence must split into over ``ways`` devices, and why: two half-chunks a device for
        load balancing or for the blockwise attention (allgather, ring); one chunk for in-order Ulysses.

        >>> ContextParallel().pieces(4), ContextParallel("context", "alltoall", False).pieces(4)
        ((8, ' (2 half-chunks a device, for load balancing)'), (4, ''))
        """
        if self.load_balance:
            return 2 * ways, " (2 half-chunks a device, for load balancing)"
        if self.method != "alltoall":
            return 2 * ways, f" (2 half-chunks a device, the blocks of {self.method} attention)"
        return ways, ""

    def check_length(self, length: int, ways: int, what: str) -> None:
        """Raises unless a sequence of ``length`` splits into :meth:`pieces`."""
        pieces, why = self.pieces(ways)
        if length % pieces:
            raise PlanError(
                f"{what}: sequence length {length} is not divisible by {pieces}: the {self.axis} axis's {ways} "
                f"devices{why}; make the sequence length a multiple of {pieces} (--seq-len)"
            )

    def check_batch(self, batch: Any, sizes: Mapping[str, int]) -> None:
        """Raises unless every batch array's sequence (dimension 1) splits over the axis (see :meth:`pieces`)."""
        for x in jax.tree.leaves(batch):
            shape = tuple(getattr(x, "shape", np.shape(x)))
            if len(shape) > 1:
                self.check_length(shape[1], sizes.get(self.axis, 1), f"context_parallel: a batch of shape {shape}")

    def describe(self) -> str:
        balanced = ", load-balanced" if self.load_balance else ""
        return f"context parallel over {self.axis} ({self.method}{balanced})"


def halves(device: int, ways: int, balanced: bool) -> tuple[int, int]:
    """The two half-chunks (of ``2·ways``) that ``device`` holds: consecutive, or head and tail when balanced.

    >>> halves(0, 4, True), halves(3, 4, True), halves(3, 4, False)
    ((0, 7), (3, 4), (6, 7))
    """
    return (device, 2 * ways - 1 - device) if balanced else (2 * device, 2 * device + 1)


def block_kinds(ways: int, balanced: bool, *, ring: bool) -> np.ndarray:
    """``kinds[device, step, query half, key half]``: what a device computes at each step, where at step ``t`` it
    holds the keys of device ``t`` (all-gather) or ``device − t`` (the ring): :data:`FULL` where the key half
    precedes the query half, :data:`MASKED` on the same half, :data:`SKIP` after it.

    >>> k = block_kinds(2, True, ring=False)
    >>> (k > 0).sum(axis=(1, 2, 3)).tolist()  # blocks computed per device: balanced
    [5, 5]
    >>> (block_kinds(2, False, ring=False) > 0).sum(axis=(1, 2, 3)).tolist()
    [3, 7]
    """
    kinds = np.zeros((ways, ways, 2, 2), np.int32)
    for device in range(ways):
        for step in range(ways):
            source = (device - step) % ways if ring else step
            for a, qh in enumerate(halves(device, ways, balanced)):
                for b, kh in enumerate(halves(source, ways, balanced)):
                    kinds[device, step, a, b] = FULL if kh < qh else MASKED if kh == qh else SKIP
    return kinds


def _busiest(part: ContextParallel, ways: int) -> np.ndarray:
    kinds = block_kinds(ways, part.load_balance, ring=part.method == "ring")
    return kinds[int(np.argmax((kinds != SKIP).sum(axis=(1, 2, 3))))]


def branch_weights(part: ContextParallel, ways: int) -> dict[str, tuple[float, ...]]:
    """How often each branch of the block switch runs on the busiest device, per run of the switch: what the
    compiled program's matmul FLOPs weigh its branches by (:func:`spmd._hlo.matmul_flops`).

    >>> branch_weights(ContextParallel(), 2)[BLOCK_SCOPE]  # 5 of 8 blocks: 2 masked, 3 full
    (0.375, 0.25, 0.375)
    """
    if part.method == "alltoall" or ways == 1:
        return {}
    busiest = _busiest(part, ways)
    return {BLOCK_SCOPE: tuple(float(np.mean(busiest == kind)) for kind in (SKIP, MASKED, FULL))}


def context_weights(plan: Any, mesh: Any) -> dict[str, tuple[float, ...]]:
    """:func:`branch_weights` for ``plan``'s context parallelism on ``mesh`` (none without it).

    >>> context_weights(None, None)
    {}
    """
    part = getattr(plan, "context", None)
    return {} if part is None else branch_weights(part, dict(mesh.shape).get(part.axis, 1))


def attention_share(part: ContextParallel, ways: int) -> float:
    """The share of its queries' ``seq × seq`` attention products that the busiest device computes: the
    blocks it does not skip (all of them for ``alltoall``, which attends densely over the whole sequence).

    >>> attention_share(ContextParallel(), 4), attention_share(ContextParallel(load_balance=False), 4)
    (0.5625, 0.9375)
    """
    if part.method == "alltoall" or ways == 1:
        return 1.0
    return float(np.mean(_busiest(part, ways) != SKIP))


def context_part(parts: tuple[Any, ...], execution: Any, batch_axes: tuple[str, ...] = ()) -> ContextParallel | None:
    """A plan's context-parallel part, or None; a plan has one at most, no other part splitting the sequence,
    and its axis does not split the batch.

    Of the execution modes only a pipeline takes it, and not by ring: each device runs its own action of a tick
    in a per-device branch (a pipeline's F, B, W; an uneven share's or a subnetwork's part), where a collective
    completes only if every device it names reaches it. All-gathers, all-to-alls and reductions name the
    context axis's devices of one stage, which run the same action together; a collective-permute names every
    stage's pairs in one instruction, so the ring's would wait for stages running another action.

    >>> context_part((ContextParallel(),), None).describe()
    'context parallel over context (allgather, load-balanced)'
    """
    found = [p for p in parts if isinstance(p, ContextParallel)]
    if len(set(found)) > 1:
        raise PlanError(f"two context-parallel parts in one plan: {found[0].describe()} and {found[1].describe()}")
    others = [p for p in parts if not isinstance(p, ContextParallel) and A.SEQ in dict(p.logical_rules())]
    if found and others:
        # Megatron's sequence parallelism splits the sequence between the tensor-parallel matmuls over its own
        # axis; under cp the sequence is the context axis's, and the attention's exchanges assume it alone.
        raise PlanError(
            f"{found[0].describe()} and {others[0].describe()} both split the sequence; use tp rather than sp "
            f"with cp (the context axis splits the sequence everywhere, the residual stream too)"
        )
    if found and found[0].axis in batch_axes:
        raise PlanError(
            f"{found[0].describe()}: the batch is split over {found[0].axis!r} too (batch axes "
            f"{list(batch_axes)}), and an axis splits the batch or the sequence, not both; split the batch "
            f"over another axis (fsdp over its own axis, e.g. --mesh fsdp=2,context=4)"
        )
    if found and execution is not None and not execution.takes_context:
        raise PlanError(
            f"{found[0].describe()} does not compose with {execution.describe()}: its exchanges would run inside "
            f"per-device branches; split the sequence without the execution mode, or remove cp"
        )
    if found and execution is not None and found[0].method == "ring":
        raise PlanError(
            f"{found[0].describe()} does not compose with {execution.describe()}: the ring's collective-permutes "
            f"would run inside the stages' per-device branches, each waiting for stages that run another action; "
            f"use --cp-method allgather or alltoall with a pipeline"
        )
    return found[0] if found else None


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


# ---------------------------------------------------------------------------------------------- sequence order
def exchanges(ways: int) -> list[list[tuple[int, int]]]:
    """The two exchanges that put a sequence in head-tail order: half-chunk ``m`` moves from device ``m // 2``
    (consecutive order) to ``min(m, 2c − 1 − m)``; each device holds one even and one odd half-chunk in both
    orders, so one exchange moves the even ones and one the odd. Pairs that stay on their device are left out.

    >>> exchanges(2)  # the even half-chunks 0 and 2 stay where they are
    [[], [(0, 1), (1, 0)]]
    """
    moves = [[(m // 2, min(m, 2 * ways - 1 - m)) for m in range(parity, 2 * ways, 2)] for parity in (0, 1)]
    return [[(a, b) for a, b in pairs if a != b] for pairs in moves]


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


def _blocks(q: jax.Array, kv_steps: Any, kinds: jax.Array, *, ring: bool, axis: str) -> jax.Array:
    """Attention of the local query halves over the key/value blocks of every step (see :func:`block_kinds`)."""
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

    if ring:
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
    table = block_kinds(ways, part.load_balance, ring=part.method == "ring")

    def blockwise(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        kinds = jnp.asarray(table)[jax.lax.axis_index(axis)]
        if part.method == "ring":
            return _blocks(q, (k, v), kinds, ring=True, axis=axis)
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
