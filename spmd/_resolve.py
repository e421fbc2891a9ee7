"""Applying a plan to a tree: every part proposes, the proposals merge dimension by dimension, and each array gets
one layout row (checked for mesh axes the mesh lacks, axes used twice, and sizes the axes do not divide)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd._layout import Layout, LeafLayout, row
from spmd._rules import (
    ROLES,
    Part,
    PlanError,
    PlanWarning,
    assign_by_rules,
    axis_used_twice,
    entry,
    quote,
    to_spec,
    user_stacklevel,
)
from spmd._tree import Leaf, leaves_with_paths, rebuild

if TYPE_CHECKING:
    from spmd._plan import Plan

__all__ = [
    "PlanWarning",
    "activation_spec",
    "batch_shardings",
    "check_axes",
    "check_unused_axes",
    "idle_axes",
    "idle_axes_text",
    "resolve",
    "sizes_of",
    "unused_axes",
]


def sizes_of(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    """Axis sizes of a mesh, or of a mapping of sizes.

    >>> sizes_of({"data": 2})
    {'data': 2}
    """
    return dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)


def check_axes(axes_by_source: Mapping[str, set[str]], sizes: Mapping[str, int]) -> None:
    """Raises if a part (by source) uses a mesh axis the mesh lacks, with a mesh that would have it.

    >>> try:
    ...     check_axes({"tensor_parallel": {"tensor"}}, {"data": 8})
    ... except PlanError as e:
    ...     print(e)
    tensor_parallel uses mesh axis 'tensor', but the mesh has only data=8; add the axis to the mesh (e.g. data=4,tensor=2) or drop that part of the plan
    """  # noqa: E501
    for source, axes in axes_by_source.items():
        missing = sorted(axes - set(sizes))
        if missing:
            shown = ",".join(f"{k}={v}" for k, v in sizes.items())
            first, size = next(iter(sizes.items()))
            example = f"{first}={size // 2},{missing[0]}=2" if size % 2 == 0 else f"{shown},{missing[0]}=..."
            raise PlanError(
                f"{source} uses mesh axis {missing[0]!r}, but the mesh has only {shown}; add the axis to the "
                f"mesh (e.g. {example}) or drop that part of the plan"
            )


def resolve(plan: Plan, tree: Any, mesh: Mesh | Mapping[str, int] | None, *, params: Any, role: str | None) -> Layout:
    """See :meth:`spmd.Plan.resolve`."""
    with _gc_paused():
        return _resolve(plan, tree, mesh, params=params, role=role)


def _resolve(plan: Plan, tree: Any, mesh: Mesh | Mapping[str, int] | None, *, params: Any, role: str | None) -> Layout:
    role = role or ("optimizer" if params is not None else "params")
    if role not in ROLES:
        raise PlanError(f"Plan.resolve: role {role!r} must be one of {ROLES}")
    sizes = None if mesh is None else sizes_of(mesh)
    if sizes is not None:
        plan.check_mesh(sizes)
    leaves, treedef = leaves_with_paths(tree)
    mirror: dict[tuple[str, ...], LeafLayout] = {}
    if params is not None:
        param_leaves, _ = leaves_with_paths(params)
        for leaf, param_row in zip(param_leaves, _Resolver(plan, sizes, "params").rows(param_leaves), strict=True):
            mirror[leaf.keys] = param_row
            if len(leaf.keys) > 1 and leaf.keys[0] == "params":  # linen's collection name is optional
                mirror.setdefault(leaf.keys[1:], param_row)
    resolver = _Resolver(plan, sizes, role)
    rows: list[LeafLayout | None] = [None] * len(leaves)
    own: list[int] = []
    for i, leaf in enumerate(leaves):
        twin = _find_mirror(leaf, mirror) if mirror else None
        if twin is not None:
            rows[i] = resolver.on_top(twin, leaf)
        elif mirror and not leaf.shape:
            rows[i] = row(leaf, (), (), sizes)
        else:
            own.append(i)
    resolved = resolver.rows([leaves[i] for i in own])
    for i, own_row in zip(own, resolved, strict=True):
        rows[i] = own_row
    unused, advice = resolver.unused() if params is None and own else ([], [])
    notes = [f"{r.path}: {r.note}" for r in resolved if r.note]
    specs = rebuild(treedef, [r.spec for r in rows])
    return Layout(specs, tuple(rows), unused_rules=tuple(unused), notes=tuple(notes), advice=tuple(advice))


@dataclasses.dataclass
class _Resolver:
    """Resolves the arrays of one role under one plan and mesh, remembering which rules matched."""

    plan: Plan
    sizes: dict[str, int] | None
    role: str
    hits: set[tuple[int, int]] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.parts: tuple[Part, ...] = self.plan.all_parts

    def rows(self, leaves: list[Leaf]) -> list[LeafLayout]:
        return [self.one(leaf) for leaf in leaves]

    def unused(self) -> tuple[list[str], list[str]]:
        """Rules that matched nothing (a warning, or under a strict plan an error), and the parts' advice (a
        warning each)."""
        mine = [{r for q, r in self.hits if q == p} for p in range(len(self.parts))]
        out = [m for part, hits in zip(self.parts, mine, strict=True) for m in part.unused(hits)]
        advice = [m for part, hits in zip(self.parts, mine, strict=True) for m in part.advice(hits)]
        if out:
            if self.plan.strict:
                raise PlanError(f"strict plan: {out[0]} (and {len(out) - 1} more); fix or remove the rule")
            warnings.warn("; ".join(out), PlanWarning, stacklevel=user_stacklevel())
        for message in advice:
            warnings.warn(message, PlanWarning, stacklevel=user_stacklevel())
        return out, advice

    def one(self, leaf: Leaf) -> LeafLayout:
        ndim = len(leaf.shape)
        entries: list[tuple[str, ...]] = [()] * ndim
        sources: list[str | None] = [None] * ndim
        covered = False
        for p, part in enumerate(self.parts):
            if part.after_rules:
                continue
            proposal = part.propose(leaf, tuple(entries), self.sizes)
            if proposal is None:
                continue
            self.hits.update((p, i) for i in proposal.hits)
            covered = covered or proposal.covers
            self._merge(leaf, entries, sources, proposal.entries, part.source)
        self._check_axes(leaf, entries, sources)
        note = self._check_divisible(leaf, entries, sources)
        pads: dict[int, int] = {}
        for part in self.parts:
            if not part.after_rules:
                continue
            covered = True
            if self.role in part.roles:
                note = self._fill(part, leaf, entries, sources, pads) or note
        if self.plan.strict and not covered and ndim:
            raise PlanError(
                f"strict plan: no rule covers {leaf.path} {leaf.shape}; add a rule for it (use spec (None,) * rank "
                f"to keep it replicated on purpose) or drop strict mode"
            )
        return row(leaf, entries, sources, self.sizes, note, pads)

    def on_top(self, twin: LeafLayout, leaf: Leaf) -> LeafLayout:
        """A parameter's layout for a leaf mirroring it, plus the splits only this role gets (ZeRO-1/2)."""
        entries = [entry(e, leaf.path) for e in twin.spec]
        sources = list(twin.sources)
        note = twin.note
        named = dataclasses.replace(leaf, names=twin.names, keys=tuple(twin.path.split("/")))
        for part in self.parts:
            if self.role in part.roles and "params" not in part.roles:
                note = self._fill(part, named, entries, sources, {}) or note
        return row(leaf, entries, sources, self.sizes, note)

    def _fill(self, part: Part, leaf: Leaf, entries: list, sources: list, pads: dict[int, int]) -> str | None:
        """Applies a part that chooses among the dimensions the rules left free."""
        proposal = part.propose(leaf, tuple(entries), self.sizes)
        if proposal is None:
            return None
        p = self.parts.index(part)
        self.hits.update((p, i) for i in proposal.hits)
        if proposal.unmet and not any(entries) and not self._replicable(leaf):
            raise PlanError(proposal.unmet)
        for d, axes in enumerate(proposal.entries):
            if axes:
                entries[d], sources[d] = axes, part.source
        pads.update(proposal.pads)
        return proposal.note

    def _replicable(self, leaf: Leaf) -> bool:
        return any(re.search(p, leaf.path) for p in self.plan.replicate)

    @staticmethod
    def _merge(leaf: Leaf, entries: list, sources: list, proposed: tuple, source: str) -> None:
        for d, axes in enumerate(proposed):
            if not axes:
                continue
            if entries[d] and entries[d] != axes:
                raise PlanError(
                    f"{leaf.path} {leaf.shape}: {sources[d]} puts dimension {d} on {entries[d]} but "
                    f"{source} puts it on {axes}; make the two parts agree or restrict one's rules"
                )
            entries[d], sources[d] = axes, source

    def _check_axes(self, leaf: Leaf, entries: list, sources: list) -> None:
        """Axes the mesh lacks (with a mesh), and an axis on two dimensions (with or without one: such a spec
        is invalid on every mesh, so planning without one must not let it through)."""
        seen: dict[str, int] = {}
        for d, axes in enumerate(entries):
            for a in axes:
                if self.sizes is not None and a not in self.sizes:
                    raise PlanError(f"{sources[d]} puts {leaf.path} on mesh axis {a!r}, which the mesh lacks")
                if a in seen:
                    fix = "one axis can split only one dimension, so change one of the two parts"
                    raise axis_used_twice(leaf, a, (seen[a], sources[seen[a]]), (d, sources[d]), fix)
                seen[a] = d

    def _check_divisible(self, leaf: Leaf, entries: list, sources: list) -> str | None:
        if self.sizes is None:
            return None
        note = None
        for d, axes in enumerate(entries):
            ways = math.prod(self.sizes[a] for a in axes)
            if axes and leaf.shape[d] % ways:
                if self._replicable(leaf):
                    note = f"dimension {d} ({leaf.shape[d]}) left replicated: {axes} ({ways} ways) do not divide it"
                    entries[d], sources[d] = (), None
                    continue
                raise PlanError(
                    f"{leaf.path} {leaf.shape}: dimension {d} has size {leaf.shape[d]}, not divisible by mesh axes "
                    f"{axes} of size {ways} (chosen by {sources[d]}); change the rule so it picks a divisible "
                    f"dimension, or opt in to replication with plan.allow_replication({quote(leaf.path)}) "
                    f"(the report then shows it)"
                )
        return note


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Resolution makes many small objects; a full collection over JAX's and flax's live objects in the middle of
    it took a third of the time of a 10,000-leaf plan, so collection waits until the plan is done."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _find_mirror(leaf: Leaf, mirror: dict[tuple[str, ...], LeafLayout]) -> LeafLayout | None:
    for start in range(len(leaf.keys)):
        twin = mirror.get(leaf.keys[start:])
        if twin is not None and twin.stored_shape == leaf.shape:
            return twin
    return None


def batch_shardings(batch: Any, mesh: Mesh, batch_axes: tuple[str, ...], spec: Callable[[int], PartitionSpec]) -> Any:
    """A NamedSharding per batch array (``spec(ndim)``), checking the batch size divides over ``batch_axes``
    (see :meth:`spmd.Plan.batch_shardings`)."""
    ways = math.prod(mesh.shape[a] for a in batch_axes)

    def one(x: Any) -> NamedSharding:
        shape = tuple(getattr(x, "shape", np.shape(x)))
        if not shape or shape[0] % ways:
            raise PlanError(
                f"batch of shape {shape} cannot be split over batch axes {batch_axes} ({ways} ways); "
                f"make the batch size a multiple of {ways}"
            )
        return NamedSharding(mesh, spec(len(shape)))

    return jax.tree.map(one, batch)


def activation_spec(
    rules: Sequence[tuple[str, tuple[str, ...]]],
    logical: tuple[str | None, ...],
    shape: tuple[int, ...],
    sizes: Mapping[str, int],
) -> PartitionSpec:
    """The layout of an activation named by logical axes under ordered logical ``rules`` (see
    :meth:`spmd.Plan.activation_spec`)."""
    entries = assign_by_rules(logical, rules)
    for dim, axes in enumerate(entries):
        ways = math.prod(sizes[a] for a in axes)
        if axes and shape[dim] % ways:
            raise PlanError(
                f"spmd.constrain: activation dimension {dim} ({logical[dim]!r}) of shape {shape} has size "
                f"{shape[dim]}, not divisible by mesh axes {axes} ({ways} ways); change the sizes or the rules"
            )
    return to_spec(entries)


def unused_axes(plan: Plan, mesh: Any) -> list[str]:
    """The mesh axes (of more than one device) that no part of ``plan`` uses: everything is replicated over
    them, so their devices repeat each other's work.

    >>> import spmd
    >>> unused_axes(spmd.Plan(batch_axes=("data",)), {"data": 2, "tensor": 4})
    ['tensor']
    """
    used = set().union(*plan.axes_by_source().values())
    return [axis for axis, size in sizes_of(mesh).items() if size > 1 and axis not in used]


def idle_axes(plan: Plan, layout: Any, mesh: Any) -> dict[str, list[str]]:
    """The mesh axes (of more than one device) that parts of ``plan`` name but that split no array of the
    training state ``layout`` (a :class:`spmd._layout.StateLayout`), with those parts: a strategy whose rules
    matched nothing in this model. Batch axes and an execution mode's axes split the batch and the work instead,
    and are not counted; nor are parts that say so themselves (``reports_idle``: tensor_parallel's advice).

    >>> import spmd, optax, jax
    >>> from spmd._layout import resolve_state
    >>> from spmd.rules import LogicalRules
    >>> mine = LogicalRules((("mlp", ("tensor",)),), "my_tensor_parallel", report_unused=False)
    >>> plan = spmd.Plan(parts=(mine,), batch_axes=("data",))
    >>> sizes, params = {"data": 2, "tensor": 4}, {"norm": jax.ShapeDtypeStruct((64,), "float32")}
    >>> idle_axes(plan, resolve_state(plan, params, optax.sgd(0.1), sizes), sizes)
    {'tensor': ['my_tensor_parallel']}
    """
    sizes = sizes_of(mesh)
    by_source = plan.axes_by_source()
    # A part that says itself when it splits nothing (tensor_parallel) has its axes said once, by it: not again
    # for another part on the same axis (sequence_parallel's activation rules).
    reported = {a for part in plan.all_parts if getattr(part, "reports_idle", False) for a in part.axes()}
    elsewhere = set(plan.batch_axes) | (set(plan.execution.axes()) if plan.execution is not None else set())
    elsewhere |= reported
    rows = [*layout.params.leaves, *layout.grads.leaves, *layout.opt_state.leaves]
    splitting = {a for r in rows for e in r.spec if e for a in ((e,) if isinstance(e, str) else e)}
    idle: dict[str, list[str]] = {}
    for source, axes in by_source.items():
        for axis in sorted(axes - splitting - elsewhere):
            if sizes.get(axis, 1) > 1 and source != "batch axes":
                idle.setdefault(axis, []).append(source)
    return idle


def idle_axes_text(idle: Mapping[str, list[str]], mesh: Any) -> str:
    """The warning about :func:`idle_axes`, one clause per axis.

    >>> idle_axes_text({"tensor": ["tensor_parallel"]}, {"tensor": 4})[:60]
    "mesh axis 'tensor' (4 devices) splits no parameter, gradient"
    """
    sizes = sizes_of(mesh)
    return "; ".join(
        f"mesh axis {axis!r} ({sizes[axis]} devices) splits no parameter, gradient or optimizer state: "
        f"{' and '.join(sources)} matched no array of this model, so unless the model's own activation "
        f"constraints use its rules all work is replicated over it; give the strategy rules for the model's layer "
        f"names (e.g. tensor_parallel(rules=[(r'mlp/up/kernel', (None, {axis!r}))])) or remove the axis"
        for axis, sources in idle.items()
    )


def check_unused_axes(plan: Plan, mesh: Any, layout: Any = None) -> None:
    """Warns (:class:`PlanWarning`) about :func:`unused_axes`, under a strict plan raises :class:`PlanError`; with
    the training state's ``layout``, warns about :func:`idle_axes` too."""
    unused = unused_axes(plan, mesh)
    sizes = sizes_of(mesh)
    texts = []
    if unused:
        texts.append(
            f"mesh axis {', '.join(f'{a!r} ({sizes[a]} devices)' for a in unused)} is used by no part of the plan "
            f"({plan.describe()}): every array and all work is replicated over it; remove it from the mesh or add "
            f"a strategy that uses it"
        )
    for text in texts:
        if plan.strict:
            raise PlanError(f"strict plan: {text}")
        warnings.warn(text, PlanWarning, stacklevel=user_stacklevel())
    idle = idle_axes(plan, layout, mesh) if layout is not None else {}
    if idle:  # a warning even under a strict plan: the model's activation constraints may use the axis
        warnings.warn(idle_axes_text(idle, mesh), PlanWarning, stacklevel=user_stacklevel())
