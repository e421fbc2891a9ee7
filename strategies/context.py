"""Context parallelism: the sequence split over a mesh axis, attention across it (see :mod:`spmd._context_parallel`)."""

from __future__ import annotations

from spmd import Plan
from spmd.rules import ContextParallel


def context_parallel(
    *,
    axis: str = "context",
    method: str = "allgather",
    load_balance: bool = True,
    shard_params: bool = False,
    min_bytes: int = 4096,
) -> Plan:
    """Splits the sequence of the batch and of every activation named ``seq`` over ``axis``; :func:`spmd.attention`
    computes causal attention across the slices by ``method``: ``"allgather"`` (keys and values gathered),
    ``"ring"`` (key/value blocks passed around the ring, online softmax) or ``"alltoall"`` (Ulysses: heads
    exchanged for the sequence). ``load_balance`` lays the sequence out head-tail, so every device does the same
    causal work.

    Parameters stay replicated over ``axis`` (their gradients all-reduced there) unless another strategy splits
    them, or ``shard_params`` splits them over it as FSDP does (MaxText's fsdp over ``context``, torchtitan's
    FSDP over ``dp_shard × cp``): every array of at least ``min_bytes`` (its gradient and optimizer state too)
    on its largest free dimension the axis divides, or further along another part's split; each is gathered
    before use and its gradient reduce-scattered. As with :func:`fsdp`, the layers are rematerialised keeping
    their matmul outputs, so gathered weights are not kept from the forward pass to the backward.

    >>> plan = context_parallel(method="ring")
    >>> plan.describe(), plan.batch_spec()
    ('batch over replicated; context parallel over context (ring, load-balanced)', P(None, 'context'))
    >>> import numpy as np
    >>> context_parallel(shard_params=True).specs({"w": np.zeros((64, 16))}, {"context": 4})
    {'w': P('context', None)}
    """
    part = ContextParallel(axis, method, load_balance, shard_params, min_bytes)
    return Plan(parts=(part,), remat="dots" if shard_params else False)
