"""The ZeRO family (Rajbhandari et al., SC 2020): what of the training state is split over the data axis.

| stage | split over the data axis | model state per device (fp32 Adam: 4 + 4 + 8 bytes per parameter) |
|---|---|---|
| DP | nothing | 16Ψ |
| 1 | optimizer state | 8Ψ + 8Ψ/N |
| 2 | + gradients (reduce-scattered into their shard) | 4Ψ + 12Ψ/N |
| 3 | + parameters (= FSDP) | 16Ψ/N |
"""

from __future__ import annotations

from spmd import Plan
from spmd.rules import ShardLargest
from strategies.data_parallel import data_parallel
from strategies.fsdp import fsdp


def zero1(*, axis: str = "data", min_bytes: int = 4096) -> Plan:
    """ZeRO-1: the optimizer state of each array of at least ``min_bytes`` is split over ``axis``; parameters and
    gradients stay replicated. The batch is split over ``axis``.

    >>> import numpy as np
    >>> params = {"w": np.zeros((64, 64), np.float32)}
    >>> zero1().specs(params, {"data": 8})["w"], zero1().specs(params, {"data": 8}, role="optimizer")["w"]
    (P(None, None), P('data', None))
    """
    part = ShardLargest(axis=axis, min_bytes=min_bytes, source="zero1", applies_to=("optimizer",))
    return data_parallel(axis=axis) + Plan(parts=(part,))


def zero2(*, axis: str = "data", min_bytes: int = 4096) -> Plan:
    """ZeRO-2: ZeRO-1 plus gradients constrained to the optimizer state's split layout before the update, so
    they are reduce-scattered into their shard rather than all-reduced.

    >>> import numpy as np
    >>> zero2().specs({"w": np.zeros((64, 64), np.float32)}, {"data": 8}, role="grads")["w"]
    P('data', None)
    """
    part = ShardLargest(axis=axis, min_bytes=min_bytes, source="zero2", applies_to=("grads", "optimizer"))
    return data_parallel(axis=axis) + Plan(parts=(part,))


def zero3(*, axis: str = "data", min_bytes: int = 4096) -> Plan:
    """ZeRO-3: parameters, gradients and optimizer state all split over ``axis``; the same as :func:`fsdp`
    on the data axis (with layer rematerialisation).

    >>> import numpy as np
    >>> zero3().specs({"w": np.zeros((64, 64), np.float32)}, {"data": 8})["w"], zero3() == fsdp(axis="data")
    (P('data', None), True)
    """
    return fsdp(axis=axis, min_bytes=min_bytes)


def hsdp(*, shard_axis: str = "fsdp", replicate_axis: str = "data", min_bytes: int = 4096) -> Plan:
    """Hybrid sharded data parallelism: FSDP inside ``shard_axis`` (fast links), plain data parallelism across
    ``replicate_axis``; the batch is split over both.

    >>> hsdp().batch_axes
    ('data', 'fsdp')
    """
    return data_parallel(axis=replicate_axis) + fsdp(axis=shard_axis, min_bytes=min_bytes)
