"""Partitioning plans: frozen data saying which mesh axes split which dimension of which array.

A plan is an ordered tuple of *parts* (:mod:`spmd.rules`) plus the batch axes and, where SPMD annotations cannot
say it all, one execution spec (:mod:`spmd.execution`). Each part proposes, for one array, a mesh-axis entry per
dimension (or no opinion); proposals are merged dimension by dimension, so ``fsdp() + tensor_parallel()`` splits
a kernel over both axes, and two parts that want different axes on one dimension are an error naming both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd import axes as names
from spmd._accumulate import check_accumulate, merged, with_accumulation
from spmd._context_parallel import ContextParallel, context_part
from spmd._layout import Layout
from spmd._offload import check_offload
from spmd._precision import Precision
from spmd._remat import Remat
from spmd._resolve import activation_spec, batch_shardings, check_axes, resolve, sizes_of
from spmd._rules import (
    LogicalRules,
    Part,
    PathRules,
    PlanError,
    ShardLargest,
)
from spmd._specs import ExecutionSpec

__all__ = ["Plan"]


def _merge_unique(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    return a + tuple(x for x in b if x not in a)


def _one_precision(a: Precision | None, b: Precision | None) -> Precision | None:
    if a is not None and b is not None and a != b:
        raise PlanError(f"two precision policies in one plan: {a} and {b}; a step computes in one, keep one")
    return a or b


@dataclasses.dataclass(frozen=True)
class Plan:
    """A partitioning plan: plain, frozen, comparable data. Build one with a strategy or :meth:`from_rules`.

    ``parts`` lay out the arrays; ``batch_axes`` split batches; ``replicate`` holds regexes of paths allowed to
    stay replicated where their axes do not divide; ``strict`` turns rules matching nothing and uncovered arrays
    into errors; ``remat`` is the remat policy each layer follows (a :class:`spmd.Remat`, or what
    :meth:`spmd.Remat.of` reads: a bool or ``"dots"``, ``"names:a,b"``...); ``execution`` is the one manual
    part, or None (see :mod:`spmd.execution`); ``offload`` names the parts of the training state kept in host
    memory; ``accumulate`` runs each step's batch as that many microbatches, gradients reduced once per step
    (:meth:`with_accumulation`); ``precision`` is the step's dtypes (a :class:`spmd.Precision`), or None.

    >>> import spmd, numpy as np
    >>> plan = spmd.Plan.from_rules([(r"kernel$", (None, "tensor"))]) + spmd.Plan(batch_axes=("data",))
    >>> plan.specs({"dense": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)}}), plan.batch_spec()
    ({'dense': {'bias': P(None,), 'kernel': P(None, 'tensor')}}, P('data', None))
    """

    parts: tuple[Part, ...] = ()
    batch_axes: tuple[str, ...] = ()
    replicate: tuple[str, ...] = ()
    strict: bool = False
    notes: tuple[str, ...] = ()
    remat: Remat = Remat()
    execution: ExecutionSpec | None = None
    offload: tuple[str, ...] = ()  # parts of the training state kept in host memory (strategies.offload)
    accumulate: int = 1
    precision: Precision | None = None

    def __post_init__(self) -> None:
        check_accumulate(self.accumulate, "Plan(accumulate=...)")
        object.__setattr__(self, "remat", Remat.of(self.remat))  # bools and strings, as plans took before
        object.__setattr__(self, "offload", check_offload(self.offload))
        context_part(self.parts, self.execution, self.batch_axes)  # one at most, checked

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_rules(
        cls, rules: Sequence[tuple[str, Any]], /, *, source: str = "rules", only_unannotated: bool = False,
        report_unused: bool = True,
    ) -> Plan:  # fmt: skip
        """A plan from ordered ``(regex, spec)`` path rules; spec is a PartitionSpec or a tuple of axes / None.

        >>> Plan.from_rules([("embed", ("fsdp", None))]).parts[0].rules
        (('embed', (('fsdp',), ())),)
        """
        part = PathRules.parse(rules, source, only_unannotated=only_unannotated, report_unused=report_unused)
        return cls(parts=(part,))

    @classmethod
    def from_logical_rules(cls, rules: Sequence[tuple[str, Any]], /, *, source: str = "logical rules") -> Plan:
        """A plan from flax-style ordered ``(logical_name, mesh_axes)`` rules, for logically annotated models.

        >>> Plan.from_logical_rules([("mlp", "tensor"), ("embed", None)]).parts[0].rules
        (('mlp', ('tensor',)), ('embed', ()))
        """
        return cls(parts=(LogicalRules.parse(rules, source),))

    def __add__(self, other: Plan) -> Plan:
        return _combined(self, other) if isinstance(other, Plan) else NotImplemented

    def allow_replication(self, *patterns: str) -> Plan:
        """Opts paths matching any regex into staying replicated where their mesh axes do not divide a dimension.
        The plan records the choice and the report shows every array it applied to.

        >>> Plan().allow_replication("bias").notes
        ('replication allowed where axes do not divide: bias',)
        """
        note = f"replication allowed where axes do not divide: {', '.join(patterns)}"
        return dataclasses.replace(
            self, replicate=_merge_unique(self.replicate, patterns), notes=_merge_unique(self.notes, (note,))
        )

    def with_block(self, rows: int) -> Plan:
        """Aligns every FSDP split (fsdp, zero3, hsdp) to whole blocks of ``rows`` (veScale-FSDP; see
        :class:`spmd.rules.ShardLargest`).

        >>> import strategies
        >>> strategies.fsdp().with_block(128).describe()
        'batch over fsdp; fsdp(axis=fsdp, min_bytes=4096, block=128); layers rematerialised (matmul outputs saved)'
        """
        splits = lambda p: isinstance(p, ShardLargest) and "params" in p.applies_to  # noqa: E731
        parts = tuple(dataclasses.replace(p, block=rows) if splits(p) else p for p in self.parts)
        if not any(map(splits, self.parts)):
            raise PlanError(
                f"block alignment ({rows} rows) applies to parameter splits, and this plan has none "
                f"({self.describe()}); combine it with fsdp, zero3 or hsdp"
            )
        return dataclasses.replace(self, parts=parts)

    with_accumulation = with_accumulation

    def with_strict(self, strict: bool = True) -> Plan:
        """Strict plans turn rules that match nothing, and arrays that no part covers, into errors.

        >>> Plan().with_strict().strict
        True
        """
        return dataclasses.replace(self, strict=strict)

    def describe(self) -> str:
        """One line: the batch axes, the parts, the execution mode and the training policies.

        >>> Plan(batch_axes=("data",)).describe()
        'batch over data; parameters replicated'
        """
        return _described(self)

    __str__ = describe

    # -- mesh axes ----------------------------------------------------------------------------------------
    @property
    def all_parts(self) -> tuple[Part, ...]:
        """The parts, with the rules of the execution mode's own stored dimensions (``stage``, ``worker``).

        >>> import strategies
        >>> [p.source for p in strategies.pipeline("1f1b", stages=2, microbatches=2).all_parts]
        ['pipeline']
        """
        ex = self.execution
        if ex is None or not ex.logical_rules():
            return self.parts
        return (*self.parts, LogicalRules(ex.logical_rules(), source=ex.source, report_unused=False))

    def axes_by_source(self) -> dict[str, set[str]]:
        """Every mesh axis the plan refers to, grouped by the part (strategy) that refers to it.

        >>> import strategies
        >>> {source: sorted(axes) for source, axes in strategies.hsdp().axes_by_source().items()}
        {'batch axes': ['data', 'fsdp'], 'fsdp': ['fsdp']}
        """
        used: dict[str, set[str]] = {}
        if self.batch_axes:
            used.setdefault("batch axes", set()).update(self.batch_axes)
        for part in self.parts:
            used.setdefault(part.source, set()).update(part.axes())
        if self.execution is not None:
            used.setdefault(self.execution.source, set()).update(self.execution.axes())
        return used

    def check_mesh(self, mesh: Mesh | Mapping[str, int]) -> None:
        """Raises if the plan names a mesh axis the mesh does not have.

        >>> Plan(batch_axes=("data",)).check_mesh({"data": 8})
        """
        check_axes(self.axes_by_source(), sizes_of(mesh))

    # -- resolution ---------------------------------------------------------------------------------------
    def resolve(
        self, tree: Any, mesh: Mesh | Mapping[str, int] | None = None, *, params: Any = None, role: str | None = None
    ) -> Layout:
        """Applies the plan to every array of ``tree`` (arrays, ShapeDtypeStructs, flax boxes, nnx Variables).

        With ``params=``, leaves of ``tree`` that mirror a parameter (an optimizer's moments: same path suffix,
        same shape) take that parameter's layout; other scalars are replicated. ``role`` says which part of the
        training state ``tree`` is ("params", "grads" or "optimizer"; default "optimizer" with ``params=``,
        else "params"): ZeRO-1/2 parts split only the optimizer state and gradients.

        >>> import numpy as np
        >>> Plan.from_rules([("w", ("data",))]).resolve({"w": np.zeros(8)}, {"data": 4}).leaves[0].bytes_per_device
        16
        """
        return resolve(self, tree, mesh, params=params, role=role)

    def specs(
        self, tree: Any, mesh: Mesh | Mapping[str, int] | None = None, *, params: Any = None, role: str | None = None
    ) -> Any:
        """A PartitionSpec for every array of ``tree``, in the tree's structure (see :meth:`resolve`).

        >>> import numpy as np
        >>> Plan().specs({"w": np.zeros(3)})
        {'w': P(None,)}
        """
        return self.resolve(tree, mesh, params=params, role=role).specs

    def shardings(self, tree: Any, mesh: Mesh, *, params: Any = None, role: str | None = None) -> Any:
        """A NamedSharding for every array of ``tree``, in the tree's structure (see :meth:`resolve`).

        >>> import spmd, numpy as np
        >>> mesh = spmd.make_mesh({"data": -1})
        >>> spmd.Plan().shardings({"w": np.zeros(3)}, mesh)["w"].spec
        P(None,)
        """
        specs = self.specs(tree, mesh, params=params, role=role)
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))

    def batch_spec(self, ndim: int = 2) -> PartitionSpec:
        """The layout of a batch array: leading dimension over the plan's batch axes, the rest replicated.

        >>> Plan(batch_axes=("data", "fsdp")).batch_spec(3)
        P(('data', 'fsdp'), None, None)
        """
        lead = None if not self.batch_axes else self.batch_axes[0] if len(self.batch_axes) == 1 else self.batch_axes
        seq = [self.context.axis] if self.context is not None and ndim > 1 else []
        return PartitionSpec(lead, *seq, *([None] * (ndim - 1 - len(seq))))

    @property
    def context(self) -> ContextParallel | None:
        """The plan's context parallelism (its sequence split; see :func:`spmd.attention`), or None.

        >>> import strategies
        >>> plan = strategies.data_parallel() + strategies.context_parallel()
        >>> plan.batch_spec(), plan.data_axes  # a batch's sequence (dimension 1) over context
        (P('data', 'context'), ('data', 'context'))
        """
        return context_part(self.parts, self.execution, self.batch_axes)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The batch axes, then :attr:`context`'s: the axes gradients are reduced over, FSDP splits gathered on."""
        return self.batch_axes + ((self.context.axis,) if self.context is not None else ())

    def batch_shardings(self, batch: Any, mesh: Mesh) -> Any:
        """A NamedSharding per batch array (see :meth:`batch_spec`), checking the batch size divides.

        >>> import spmd, numpy as np
        >>> mesh = spmd.make_mesh({"data": -1})
        >>> Plan(batch_axes=("data",)).batch_shardings({"x": np.zeros((8, 2))}, mesh)["x"].spec
        P('data', None)
        """
        self.check_mesh(mesh)
        if self.context is not None:
            self.context.check_batch(batch, mesh.shape)
        return batch_shardings(batch, mesh, self.batch_axes, self.batch_spec)

    def logical_rules(self) -> list[tuple[str, tuple[str, ...]]]:
        """Every logical rule of the plan in order, ``batch`` (its batch axes) first.

        >>> (Plan(batch_axes=("data",)) + Plan.from_logical_rules([("mlp", "tensor")])).logical_rules()
        [('batch', ('data',)), ('mlp', ('tensor',))]
        """
        return [(names.BATCH, self.batch_axes)] + [r for part in self.all_parts for r in part.logical_rules()]

    def flax_axis_rules(self, mesh: Mesh | None = None) -> list[tuple[str, Any]]:
        """The plan's logical rules in flax's ``(name, mesh_axes)`` form, ``batch`` first.

        >>> Plan(batch_axes=("data",)).flax_axis_rules()
        [('batch', 'data')]
        """
        rules = [(n, axes) for n, axes in self.logical_rules() if n != names.BATCH or axes]
        return [(n, None if not axes else axes if len(axes) > 1 else axes[0]) for n, axes in rules]

    def activation_spec(
        self, logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh | Mapping[str, int]
    ) -> PartitionSpec:
        """The layout for an activation named by logical axes (used by :func:`spmd.constrain`).

        >>> Plan(batch_axes=("data",)).activation_spec(("batch", "embed"), (8, 4), {"data": 2})
        P('data', None)
        """
        return activation_spec(self.logical_rules(), logical, shape, sizes_of(mesh))


def _combined(a: Plan, b: Plan) -> Plan:
    """``a + b``: parts in order, axes and notes merged, one execution mode and one of each policy."""
    x, y = a.execution, b.execution
    if x is not None and y is not None and x != y:
        what = f"two {x.source} parts in one plan" if type(x) is type(y) else f"{x.source} and {y.source}"
        raise PlanError(f"{what}: {x.describe()} and {y.describe()}; a plan runs one execution mode, keep one")
    return Plan(
        parts=a.parts + b.parts,
        batch_axes=_merge_unique(a.batch_axes, b.batch_axes),
        replicate=_merge_unique(a.replicate, b.replicate),
        strict=a.strict or b.strict,
        notes=_merge_unique(a.notes, b.notes),
        remat=a.remat.merge(b.remat),
        execution=x or y,
        offload=_merge_unique(a.offload, b.offload),
        accumulate=merged(a.accumulate, b.accumulate),
        precision=_one_precision(a.precision, b.precision),
    )


def _described(plan: Plan) -> str:
    ex = plan.execution
    parts = list(dict.fromkeys(part.describe() for part in plan.parts))  # each once, in order
    bare = "" if ex is not None and ex.splits_state else "; parameters replicated"
    said = [f"batch over {','.join(plan.batch_axes) or 'replicated'}", f"; {' + '.join(parts)}" if parts else bare]
    said += [f"; {plan.remat.describe()}" if plan.remat else "", f"; {ex.describe()}" if ex is not None else ""]
    if plan.accumulate > 1:
        said.append(f"; gradients accumulated over {plan.accumulate} microbatches")
    said += [f"; {part} state offloaded to host" for part in plan.offload]
    return "".join(said) + (f"; {plan.precision.describe()}" if plan.precision is not None else "")
