"""Subnetwork data parallelism (SDP): each data-parallel worker trains and stores only its subnetwork."""

from __future__ import annotations

from spmd import Plan
from spmd.execution import SubnetSpec

__all__ = ["subnetwork_dp"]


def subnetwork_dp(
    *,
    axis: str = "data",
    coverage: float = 0.5,
    granularity: str = "block",
    masking: str = "forward",
    seed: int = 0,
) -> Plan:
    """Data parallelism over ``axis`` in which each worker owns a ``coverage`` share of the model's groups —
    whole blocks (``granularity="block"``) or MLP hidden units and attention heads (``"neuron"``) — and every
    group's gradient is the mean of its owners' (see :class:`spmd.execution.Subnetworks`). ``masking="forward"``
    runs only the subnetwork and stores only it; ``"backward"`` runs the full model and reduces only owned
    gradients.

    >>> subnetwork_dp(coverage=0.25, granularity="neuron").describe()
    'batch over data; subnetworks over data (coverage 0.25, neuron, forward masking)'
    """
    spec = SubnetSpec(axis=axis, coverage=coverage, granularity=granularity, masking=masking, seed=seed)
    return Plan(batch_axes=(axis,), execution=spec)
