"""Mixed precision as a plan part: fp32 master weights and optimizer state, bf16 compute and gathers."""

from __future__ import annotations

from typing import Any

from spmd import Plan, Precision


def mixed_precision(
    *, compute: Any = "bfloat16", params: Any = "float32", gather: Any = None, reduce: Any = "float32"
) -> Plan:
    """A plan that lays out nothing and computes under :class:`spmd.Precision` (``gather`` defaults to
    ``compute``); add it to any other plan.

    >>> import strategies
    >>> plan = strategies.zero3() + strategies.mixed_precision()
    >>> plan.precision.gather, plan.describe().endswith("gather bfloat16, reduce float32")
    ('bfloat16', True)
    """
    return Plan(precision=Precision(compute=compute, params=params, gather=gather, reduce=reduce))
