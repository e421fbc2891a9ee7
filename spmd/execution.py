"""How a step's loss and gradients are computed: the execution seam, and the modes built on it.

A plan carries at most one execution spec (``Plan.execution``: plain data); the spec builds an
:class:`Executor` (a value of pure functions) for a :class:`Task`. Plain SPMD execution (:func:`plain`), pipelines
(:class:`PipelineSpec`, :class:`spmd.pipeline.Pipeline`), uneven data shares (:class:`Shares`,
:class:`UnevenData`), uneven tensor shares (:class:`TensorShares`, :class:`UnevenTensor`, with
:func:`unit_sum` in the model's blocks) and subnetworks (:class:`SubnetSpec`, :class:`Subnetworks`;
:class:`SimulatedSubnets` runs their algorithm on one device, the reference a subnetwork run is checked
against) are its implementations; a new
mode is an :class:`ExecutionSpec` whose ``executor`` returns an :class:`Executor`. A keyed executor passes the
step's :class:`StepKey` to the loss with :func:`call_loss`.

>>> import spmd, strategies
>>> plan = strategies.subnetwork_dp(coverage=0.5)
>>> isinstance(plan.execution, spmd.execution.SubnetSpec), plan.execution.axes()
(True, frozenset({'data'}))
"""

from spmd._accumulate import accumulated, check_batch, microbatches
from spmd._executor import Executor, Summary, Task, identity, plain
from spmd._keys import StepKey, call_loss
from spmd._pipeline import pipeline_executor
from spmd._shares import UnevenData, uneven_executor
from spmd._specs import (
    GRANULARITIES,
    MASKINGS,
    ExecutionSpec,
    PipelineSpec,
    Shares,
    SimulatedSubnets,
    SubnetSpec,
    TensorShares,
)
from spmd._subnet import Ownership, Subnetworks, ownership, subnet_executor
from spmd._tensor_shares import UnevenTensor, tensor_shares_executor, unit_sum

__all__ = [
    "accumulated",
    "check_batch",
    "microbatches",
    "GRANULARITIES",
    "MASKINGS",
    "ExecutionSpec",
    "Executor",
    "Ownership",
    "PipelineSpec",
    "Shares",
    "StepKey",
    "SimulatedSubnets",
    "SubnetSpec",
    "Subnetworks",
    "Summary",
    "Task",
    "TensorShares",
    "UnevenData",
    "UnevenTensor",
    "call_loss",
    "identity",
    "ownership",
    "pipeline_executor",
    "plain",
    "subnet_executor",
    "tensor_shares_executor",
    "uneven_executor",
    "unit_sum",
]
