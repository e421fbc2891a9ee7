"""Gradient accumulation as a plan to compose: each step's batch run as ``k`` microbatches, reduced once."""

from __future__ import annotations

from spmd import Plan


def accumulate(k: int, /) -> Plan:
    """A plan that only accumulates gradients over ``k`` microbatches per step; add it to any other
    (the same as ``plan.with_accumulation(k)``).

    >>> import strategies
    >>> (strategies.data_parallel() + accumulate(4)).describe()
    'batch over data; parameters replicated; gradients accumulated over 4 microbatches'
    """
    return Plan().with_accumulation(k)
