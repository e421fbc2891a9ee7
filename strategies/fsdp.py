"""Fully sharded data parallelism (ZeRO stage 3): parameters split over the data-parallel axis."""

from __future__ import annotations

from spmd import Plan
from spmd._plan import ShardLargest


def fsdp(*, axis: str = "fsdp", min_bytes: int = 4096, avoid: tuple[str, ...] = ("layers",)) -> Plan:
    """Splits each parameter of at least ``min_bytes`` over ``axis`` on its largest dimension that the axis
    divides and that no other part of the plan took; the batch is split over ``axis`` too.

    Works on any model, annotated or not. Dimensions whose logical name is in ``avoid`` are never chosen:
    splitting the stacked ``layers`` dimension would make a scan gather every layer at once.

    >>> import numpy as np
    >>> fsdp(axis="fsdp", min_bytes=0).specs({"w": np.zeros((4, 16))}, {"fsdp": 4})
    {'w': P(None, 'fsdp')}
    """
    if min_bytes < 0:
        raise ValueError(f"strategies.fsdp: min_bytes must be >= 0, got {min_bytes}")
    return Plan(parts=(ShardLargest(axis=axis, min_bytes=min_bytes, avoid=tuple(avoid)),), batch_axes=(axis,))
