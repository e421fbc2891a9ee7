"""Context parallelism: the sequence split over a mesh axis, attention across it (see :mod:`spmd._context_parallel`)."""

from __future__ import annotations

from spmd import Plan
from spmd.rules import ContextParallel


def context_parallel(*, axis: str = "context", method: str = "allgather", load_balance: bool = True) -> Plan:
    """Splits the sequence of the batch and of every activation named ``seq`` over ``axis``; :func:`spmd.attention`
    computes causal attention across the slices by ``method``: ``"allgather"`` (keys and values gathered),
    ``"ring"`` (key/value blocks passed around the ring, online softmax) or ``"alltoall"`` (Ulysses: heads
    exchanged for the sequence). ``load_balance`` lays the sequence out head-tail, so every device does the same
    causal work. Parameters stay replicated over ``axis`` (their gradients all-reduced there) unless another
    strategy splits them.

    >>> plan = context_parallel(method="ring")
    >>> plan.describe(), plan.batch_spec()
    ('batch over replicated; context parallel over context (ring, load-balanced)', P(None, 'context'))
    """
    return Plan(parts=(ContextParallel(axis, method, load_balance),))
