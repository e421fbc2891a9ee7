"""Offload: a plan that keeps parts of the training state in host memory (ZeRO-Offload), composed with ``+``."""

from __future__ import annotations

from spmd import Plan
from spmd.rules import check_offload

__all__ = ["offload"]


def offload(*parts: str) -> Plan:
    """A plan part keeping ``parts`` of the training state in host memory between steps: ``"optimizer"``
    (ZeRO-Offload's optimizer state, in ``pinned_host`` memory, moved to the device for each update and back).
    Compose it with any layout: ``strategies.zero3() + strategies.offload("optimizer")``.

    >>> import strategies
    >>> (strategies.zero3() + offload("optimizer")).describe().split("; ")[-1]
    'optimizer state offloaded to host'
    """
    return Plan(offload=check_offload(parts or ("optimizer",), "strategies.offload"))
