"""Data parallelism: every device holds the whole model and a slice of the batch."""

from __future__ import annotations

from spmd import Plan


def data_parallel(*, axis: str = "data") -> Plan:
    """Splits the batch over ``axis``; parameters, gradients and optimizer state stay replicated.

    >>> data_parallel().batch_axes
    ('data',)
    """
    return Plan(batch_axes=(axis,))
