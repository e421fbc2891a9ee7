"""How a plan executes, as plain data: the one manual field of a plan (``Plan.execution``).

Most plans need no manual program: SPMD annotations say it all and XLA writes the collectives. Where they cannot
(a pipeline schedule, uneven shares of the batch, subnetworks owned by groups of workers) the plan carries one
execution spec. A spec is a frozen dataclass with no arrays, devices or closures; it names the mesh axes it uses,
the logical names the arrays it stores carry (``stage``, ``worker``) and the mesh axes they go to, and builds its
:class:`spmd.execution.Executor` for a :class:`spmd.execution.Task` (the implementation is imported only then, so
this module stays free of JAX).

A new execution mode is a subclass of :class:`ExecutionSpec` whose ``executor(task)`` returns an executor.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, ClassVar

from spmd import axes as names
from spmd._schedule import Schedule

if TYPE_CHECKING:
    from spmd._executor import Executor, Task

__all__ = [
    "GRANULARITIES",
    "MASKINGS",
    "ExecutionSpec",
    "PipelineSpec",
    "Shares",
    "SimulatedSubnets",
    "SubnetSpec",
    "TensorShares",
]


class ExecutionSpec:
    """The base of execution specs (see the module docstring); subclasses are frozen dataclasses.

    ``source`` names the mode in errors; ``splits_state`` says whether the mode itself splits part of the
    training state over its axes (a plan then does not describe its parameters as replicated);
    ``takes_context`` whether context parallelism's grouped collectives (all-gathers, all-to-alls over the
    context axis) complete inside its per-device branches (see :func:`spmd._context_parallel.context_part`);
    ``splits_units`` whether the model's unit blocks (:func:`spmd.unit_sum`) run each device's own units.

    >>> import dataclasses, jax
    >>> from spmd.execution import Executor
    >>> @dataclasses.dataclass(frozen=True)
    ... class Plain(ExecutionSpec):
    ...     def executor(self, task):
    ...         return Executor(jax.value_and_grad(task.loss))
    >>> Plain().describe(), Plain().axes()
    ('Plain', frozenset())
    """

    source: ClassVar[str] = "execution"
    splits_state: ClassVar[bool] = False
    takes_context: ClassVar[bool] = False
    splits_units: ClassVar[bool] = False

    def describe(self) -> str:
        """A few words for the plan's description."""
        return type(self).__name__

    def axes(self) -> frozenset[str]:
        """The mesh axes the mode uses (checked against the mesh)."""
        return frozenset()

    @property
    def iterations(self) -> int:
        """How many microbatches the busiest device runs the model on per step, each gathering the parameters
        split over the batch axes anew (the cost model counts FSDP's traffic so): 1 unless the mode loops."""
        return 1

    def logical_rules(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """``(logical name, mesh axes)`` rules for the dimensions the mode adds to the arrays it stores."""
        return ()

    def executor(self, task: Task) -> Executor:
        """The executor running this mode for ``task``."""
        raise NotImplementedError(f"{type(self).__name__}.executor(task) must return a spmd.execution.Executor")


@dataclasses.dataclass(frozen=True)
class PipelineSpec(ExecutionSpec):
    """A pipeline: the mesh axis whose devices are the stages, the schedule they run, and how many of the model's
    stacked layers each global stage holds (None: an even split). Stored layers are ``[stage, chunk, layer, ...]``.

    >>> import strategies
    >>> spec = strategies.pipeline("zb-h1", stages=4, microbatches=8).execution
    >>> spec.describe(), spec.logical_rules()
    ('pipeline zb-h1 over stage (4 stages, 8 microbatches)', (('stage', ('stage',)),))
    """

    axis: str
    schedule: Schedule
    layers_per_stage: tuple[int, ...] | None = None
    # Uneven data shares: position ``i`` of ``data_axis`` runs its own pipeline, ``data_schedules[i]`` (the
    # schedule with its own number of microbatches, all of one size), so a slow rank runs fewer of them.
    data_schedules: tuple[Schedule, ...] | None = None
    data_axis: str = "data"
    source: ClassVar[str] = "pipeline"
    splits_state: ClassVar[bool] = True
    takes_context: ClassVar[bool] = True  # a tick's action is the same on one stage's context devices

    def __post_init__(self) -> None:
        if self.data_schedules is None:
            return
        s = self.schedule
        if not self.data_schedules:
            raise ValueError(f"pipeline: data_schedules is empty; give one schedule per {self.data_axis} position")
        for i, d in enumerate(self.data_schedules):
            # One kind of schedule everywhere: the program's slots and branches are the plan's schedule's.
            if (d.name, d.stages, d.virtual, d.placement) != (s.name, s.stages, s.virtual, s.placement):
                raise ValueError(
                    f"pipeline: the schedule of {self.data_axis} position {i} is {d.name} on {d.stages} stages × "
                    f"{d.virtual} chunks ({d.placement}), the plan's {s.name} on {s.stages} × {s.virtual} "
                    f"({s.placement}); every data "
                    f"position runs the plan's pipeline, with its own number of microbatches"
                )

    @property
    def busiest(self) -> Schedule:
        """The schedule of the data position with the most microbatches (the plan's own without shares): the
        compiled program's counts are that device's."""
        return max(self.data_schedules or (self.schedule,), key=lambda s: s.microbatches)

    @property
    def rank_microbatches(self) -> tuple[int, ...] | None:
        """Microbatches per position of ``data_axis`` (None: every position runs the plan's schedule)."""
        return None if self.data_schedules is None else tuple(s.microbatches for s in self.data_schedules)

    def describe(self) -> str:
        s = self.schedule
        chunks = f", {s.virtual} chunks per device" if s.virtual > 1 else ""
        layers = f", layers per stage {list(self.layers_per_stage)}" if self.layers_per_stage else ""
        micro = (
            f"microbatches per {self.data_axis} position {list(self.rank_microbatches)}"
            if self.data_schedules
            else f"{s.microbatches} microbatches"
        )
        return f"pipeline {s.name} over {self.axis} ({s.stages} stages, {micro}{chunks}{layers})"

    def axes(self) -> frozenset[str]:
        return frozenset((self.axis, self.data_axis) if self.data_schedules else (self.axis,))

    def logical_rules(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return ((names.STAGE, (self.axis,)),)

    def executor(self, task: Task) -> Executor:
        from spmd._pipeline import pipeline_executor

        return pipeline_executor(self, task)


@dataclasses.dataclass(frozen=True)
class Shares(ExecutionSpec):
    """Uneven data parallelism: ``shares[i]`` examples for position ``i`` of mesh axis ``axis``, run as
    ``shares[i] / microbatch`` loop iterations of ``microbatch`` examples.

    >>> Shares("data", (12, 4), 4).loops
    (3, 1)
    """

    axis: str
    shares: tuple[int, ...]
    microbatch: int = 1
    source: ClassVar[str] = "uneven data parallelism"

    def __post_init__(self) -> None:
        if self.microbatch < 1 or any(s < 0 or s % self.microbatch for s in self.shares) or not sum(self.shares):
            raise ValueError(
                f"uneven data parallelism: shares {list(self.shares)} must be non-negative multiples of the "
                f"microbatch ({self.microbatch}) with a positive sum"
            )

    @property
    def loops(self) -> tuple[int, ...]:
        return tuple(s // self.microbatch for s in self.shares)

    @property
    def iterations(self) -> int:
        return max(self.loops)

    @property
    def batch(self) -> int:
        return sum(self.shares)

    def describe(self) -> str:
        return f"uneven shares {list(self.shares)} over {self.axis} (microbatches of {self.microbatch})"

    def axes(self) -> frozenset[str]:
        return frozenset((self.axis,))

    def executor(self, task: Task) -> Executor:
        from spmd._shares import uneven_executor

        return uneven_executor(self, task)


@dataclasses.dataclass(frozen=True)
class TensorShares(ExecutionSpec):
    """Uneven tensor parallelism (HAP) over ``axis``: for each logical unit dimension (``mlp``, ``heads``), the
    units each position of the axis computes, ``units = (("heads", (3, 1)), ("mlp", (171, 85)))``. Arrays
    carrying those dimensions are stored padded to the most units a position holds (see
    :mod:`spmd._tensor_shares`); the plan's rules split the padded dimensions over ``axis`` evenly.

    >>> TensorShares("tensor", (("heads", (3, 1)), ("mlp", (171, 85)))).describe()
    'uneven tensor shares over tensor: heads [3, 1], mlp [171, 85] per device'
    """

    axis: str = "tensor"
    units: tuple[tuple[str, tuple[int, ...]], ...] = ()
    source: ClassVar[str] = "uneven tensor shares"
    splits_units: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple((str(n), tuple(int(u) for u in c)) for n, c in self.units))
        if not self.units:
            raise ValueError("uneven tensor shares: units is empty; give the units per position of each dimension")
        if len(set(self.names)) != len(self.units):
            raise ValueError(
                f"uneven tensor shares: units names a dimension twice ({list(self.names)}); name each once"
            )
        ways = {len(c) for _, c in self.units}
        if len(ways) != 1 or any(u < 1 for _, c in self.units for u in c):
            raise ValueError(
                f"uneven tensor shares: units {dict(self.units)} must give every dimension one positive count "
                f"per position of {self.axis!r}"
            )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.units)

    def of(self, name: str) -> tuple[int, ...]:
        """The units per position of logical dimension ``name``."""
        return dict(self.units)[name]

    def describe(self) -> str:
        shown = ", ".join(f"{n} {list(c)}" for n, c in self.units)
        return f"uneven tensor shares over {self.axis}: {shown} per device"

    def axes(self) -> frozenset[str]:
        return frozenset((self.axis,))

    def executor(self, task: Task) -> Executor:
        from spmd._tensor_shares import tensor_shares_executor

        return tensor_shares_executor(self, task)


GRANULARITIES = ("block", "neuron")
MASKINGS = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class SubnetSpec(ExecutionSpec):
    """Subnetwork data parallelism over ``axis``: each worker owns ``coverage`` (1/P) of the model's groups —
    whole blocks or neurons (``granularity``) — assigned by ``seed``; ``masking`` says whether a worker runs
    only its subnetwork (forward) or the full model with only its gradients kept (backward). Owned arrays are
    stored ``[worker, ...]``.

    >>> SubnetSpec(coverage=0.25).parts
    4
    """

    axis: str = "data"
    coverage: float = 0.5
    granularity: str = "block"
    masking: str = "forward"
    seed: int = 0
    source: ClassVar[str] = "sdp"
    splits_state: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"sdp: granularity {self.granularity!r}; choose from {', '.join(GRANULARITIES)}")
        if self.masking not in MASKINGS:
            raise ValueError(f"sdp: masking {self.masking!r}; choose from {', '.join(MASKINGS)}")
        if not 0 < self.coverage <= 1:
            raise ValueError(f"sdp: coverage must be in (0, 1], got {self.coverage}")
        self.parts  # noqa: B018 - checks that the coverage is 1/P

    @property
    def parts(self) -> int:
        """P: how many disjoint subnetworks the groups are cut into (coverage 1/P)."""
        parts = round(1 / self.coverage)
        if not math.isclose(parts * self.coverage, 1.0, rel_tol=1e-9):
            raise ValueError(
                f"sdp: coverage {self.coverage:g} is not 1/P for a whole number P (each worker owns one of P equal "
                f"parts); use 1, 0.5, 0.25, 0.125, ..."
            )
        return parts

    def describe(self) -> str:
        return f"subnetworks over {self.axis} (coverage {self.coverage:g}, {self.granularity}, {self.masking} masking)"

    def axes(self) -> frozenset[str]:
        return frozenset((self.axis,))

    def logical_rules(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return ((names.WORKER, (self.axis,)),)

    def executor(self, task: Task) -> Executor:
        from spmd._subnet import subnet_executor

        return subnet_executor(self, task)


@dataclasses.dataclass(frozen=True)
class SimulatedSubnets(ExecutionSpec):
    """``subnet``'s algorithm over ``workers`` workers simulated on one device, parameters in the model's layout:
    the single-device reference of a subnetwork plan (``--check``). Uses no mesh axis.

    >>> SimulatedSubnets(SubnetSpec(coverage=0.5), workers=8).describe()
    'subnetworks over 8 simulated workers (coverage 0.5, block, forward masking)'
    """

    subnet: SubnetSpec
    workers: int
    source: ClassVar[str] = "sdp"

    def describe(self) -> str:
        s = self.subnet
        return (
            f"subnetworks over {self.workers} simulated workers (coverage {s.coverage:g}, {s.granularity}, "
            f"{s.masking} masking)"
        )

    def executor(self, task: Task) -> Executor:
        from spmd._subnet import simulated_subnet_executor

        return simulated_subnet_executor(self.subnet, self.workers, task)
