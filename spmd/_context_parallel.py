"""Context parallelism: the sequence split over a mesh axis, attention computed with every device's keys.

A plan part (:class:`ContextParallel`) maps the activations' ``seq`` dimension to the ``context`` axis, so every
position-wise computation (embeddings, norms, MLPs, projections) works on its own slice of the sequence, and
:func:`spmd.attention` computes causal self-attention across the slices inside a ``jax.shard_map`` manual over the
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
:func:`spmd.balance_sequence` (the built-in GPTs balance their tokens and read positions from
:func:`spmd.sequence_positions`) and back once with :func:`spmd.restore_sequence` before anything that reads
neighbours (the loss's next-token shift); between the two, attention knows the order from the plan.

Blocks are half-chunks: a query half attends to a key half fully (the keys all precede it), under the causal mask
(the same half), or not at all. Which applies where is a per-device table (:func:`block_kinds`), chosen in the
program by ``lax.switch``, so the compiled program skips the masked blocks and its attention work per device is
the table's count.

This module is the plan's side (the part, its tables and checks, read by the cost model without tracing
anything); :mod:`spmd._context_attention` computes in a trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

import jax
import numpy as np

from spmd import axes as A
from spmd._rules import ROLES, PlanError, Proposal, ShardLargest

__all__ = ["METHODS", "ContextParallel", "attention_share", "block_kinds", "context_part", "exchanges"]

METHODS = ("allgather", "ring", "alltoall")
SKIP, MASKED, FULL = 0, 1, 2  # a block's kind: no work, causal mask within the block, every key visible
BLOCK_SCOPE = "spmd_context_block"  # the switch over a block's kinds, named for the compiled program's counts


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The plan part of context parallelism: ``seq`` over ``axis``, attention by ``method``, head-tail order
    with ``load_balance``. The parameters are replicated over ``axis`` (their gradients all-reduced there)
    unless another part splits them, or, with ``shard_params``, split over it FSDP-style: each array of at
    least ``min_bytes`` on its largest free dimension the axis divides, else joining another part's split
    (:class:`spmd.rules.ShardLargest` with ``joins``), gathered before use and its gradient reduce-scattered.

    >>> part = ContextParallel("context", "ring")
    >>> part.logical_rules(), part.describe()
    ((('seq', ('context',)),), 'context parallel over context (ring, load-balanced)')
    >>> ContextParallel(shard_params=True).describe()
    'context parallel over context (allgather, load-balanced, parameters split)'
    """

    axis: str = "context"
    method: str = "allgather"
    load_balance: bool = True
    shard_params: bool = False
    min_bytes: int = 4096
    source = "context_parallel"
    reports_idle = True  # it splits activations, not arrays of the training state

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise PlanError(f"context_parallel: unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.min_bytes < 0:
            raise PlanError(f"context_parallel: min_bytes must be >= 0, got {self.min_bytes}")

    @property
    def roles(self) -> tuple[str, ...]:
        return ROLES if self.shard_params else ("params",)

    @property
    def after_rules(self) -> bool:
        """Splitting parameters, it chooses among the dimensions the rules left, as FSDP does."""
        return self.shard_params

    def propose(self, leaf: Any, taken: Any, sizes: Mapping[str, int] | None) -> Proposal | None:
        if not self.shard_params:
            return None
        return ShardLargest(self.axis, self.min_bytes, source=self.source, joins=True).propose(leaf, taken, sizes)

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
        split = ", parameters split" if self.shard_params else ""
        return f"context parallel over {self.axis} ({self.method}{balanced}{split})"


def halves(device: int, ways: int, balanced: bool) -> tuple[int, int]:
    """The two half-chunks (of ``2·ways``) that ``device`` holds: consecutive, or head and tail when balanced.

    >>> halves(0, 4, True), halves(3, 4, True), halves(3, 4, False)
    ((0, 7), (3, 4), (6, 7))
    """
    return (device, 2 * ways - 1 - device) if balanced else (2 * device, 2 * device + 1)


def sources(ways: int, *, ring: bool, paired: bool = False) -> np.ndarray:
    """``sources[device, step]``: whose keys and values a device holds at each step of the blockwise attention:
    device ``step`` (all-gather), ``device − step`` (the ring), or, on the ring between neighbour pairs that runs
    inside a pipeline's branches (``paired``, see :func:`context_part`), itself, then ``device + t`` and
    ``device − t`` for t = 1, 2, ... (the blocks passed on from the right and from the left), and on an even axis
    the opposite device ``device + c/2`` last.

    >>> sources(4, ring=True).tolist()[1], sources(4, ring=True, paired=True).tolist()[1]
    ([1, 0, 3, 2], [1, 2, 0, 3])
    """
    if not ring:
        return np.tile(np.arange(ways), (ways, 1))
    if not paired:
        return np.array([[(d - t) % ways for t in range(ways)] for d in range(ways)])
    offsets = [0, *(o for t in range(1, (ways + 1) // 2) for o in (t, -t)), *([ways // 2] if ways % 2 == 0 else [])]
    return np.array([[(d + o) % ways for o in offsets[:ways]] for d in range(ways)])


def block_kinds(ways: int, balanced: bool, *, ring: bool, paired: bool = False) -> np.ndarray:
    """``kinds[device, step, query half, key half]``: what a device computes at each step, where at step ``t`` it
    holds the keys of :func:`sources` ``[device, t]``: :data:`FULL` where the key half precedes the query half,
    :data:`MASKED` on the same half, :data:`SKIP` after it. Every order visits every device once, so a device's
    work is the same in each; only the steps' order differs.

    >>> k = block_kinds(2, True, ring=False)
    >>> (k > 0).sum(axis=(1, 2, 3)).tolist()  # blocks computed per device: balanced
    [5, 5]
    >>> (block_kinds(2, False, ring=False) > 0).sum(axis=(1, 2, 3)).tolist()
    [3, 7]
    """
    table = sources(ways, ring=ring, paired=paired)
    kinds = np.zeros((ways, ways, 2, 2), np.int32)
    for device in range(ways):
        for step in range(ways):
            for a, qh in enumerate(halves(device, ways, balanced)):
                for b, kh in enumerate(halves(int(table[device, step]), ways, balanced)):
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

    Of the execution modes only a pipeline takes it: each device runs its own action of a tick in a per-device
    branch (a pipeline's F, B, W; an uneven share's or a subnetwork's part), where a collective completes only
    if every device it names reaches it. All-gathers, all-to-alls and reductions name the context axis's devices
    of one stage, which run the same action together; a collective-permute names every stage's pairs in one
    instruction, and would wait for stages running another action. So inside a pipeline the ring passes its
    blocks between neighbours by all-gathers over pairs of devices (``sources(paired=True)``), which move as
    many bytes as its permutes.

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
            f"over another axis, and to split the parameters over {found[0].axis!r} too use "
            f"context_parallel(shard_params=True) (--cp-shard-params)"
        )
    if found and execution is not None and not execution.takes_context:
        raise PlanError(
            f"{found[0].describe()} does not compose with {execution.describe()}: its exchanges would run inside "
            f"per-device branches; split the sequence without the execution mode, or remove cp"
        )
    return found[0] if found else None


def exchanges(ways: int) -> list[list[tuple[int, int]]]:
    """The two exchanges that put a sequence in head-tail order: half-chunk ``m`` moves from device ``m // 2``
    (consecutive order) to ``min(m, 2c − 1 − m)``; each device holds one even and one odd half-chunk in both
    orders, so one exchange moves the even ones and one the odd. Pairs that stay on their device are left out.

    >>> exchanges(2)  # the even half-chunks 0 and 2 stay where they are
    [[], [(0, 1), (1, 0)]]
    """
    moves = [[(m // 2, min(m, 2 * ways - 1 - m)) for m in range(parity, 2 * ways, 2)] for parity in (0, 1)]
    return [[(a, b) for a, b in pairs if a != b] for pairs in moves]
