"""The parts a plan is made of, for strategy authors: each proposes mesh axes for the dimensions of an array.

Every part follows one protocol (:class:`Part`); a :class:`spmd.Plan` merges their :class:`Proposal` per
dimension. ``PathRules`` match regexes on parameter paths, ``LogicalRules`` map flax logical names to mesh axes,
``ShardLargest`` (FSDP and the ZeRO family) splits each large array on its largest free divisible dimension,
``ContextParallel`` splits the sequence over a mesh axis and chooses how :func:`spmd.attention` crosses it.

>>> from spmd import rules
>>> import spmd
>>> plan = spmd.Plan(parts=(rules.LogicalRules((("mlp", ("tensor",)),), "my tensor parallelism"),))
>>> plan.describe()
'batch over replicated; my tensor parallelism'
"""

from spmd._context_parallel import ContextParallel
from spmd._offload import OFFLOADABLE, check_offload
from spmd._rules import (
    ROLES,
    Entries,
    LogicalRules,
    Part,
    PathRules,
    PlanError,
    Proposal,
    ShardLargest,
    as_entries,
    assign_by_rules,
    entry,
    quote,
    to_spec,
)
from spmd._tree import Leaf, leaves_with_paths

__all__ = [
    "OFFLOADABLE",
    "ROLES",
    "ContextParallel",
    "Entries",
    "Leaf",
    "LogicalRules",
    "Part",
    "PathRules",
    "PlanError",
    "Proposal",
    "ShardLargest",
    "as_entries",
    "assign_by_rules",
    "check_offload",
    "entry",
    "leaves_with_paths",
    "quote",
    "to_spec",
]
