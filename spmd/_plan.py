"""Partitioning plans: frozen data saying which mesh axes split which dimension of which array.

A plan is an ordered tuple of *parts* plus the batch axes. Each part proposes, for one array, a mesh-axis entry
per dimension (or no opinion); proposals are merged dimension by dimension, so ``fsdp() + tensor_parallel()``
splits a kernel over both axes, and two parts that want different axes on one dimension are an error naming both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd._schedule import PipelineSpec
from spmd._shares import Shares
from spmd._subnet import SubnetSpec
from spmd._tree import Leaf, leaves_with_paths, rebuild

AxisEntry = Union[None, str, tuple[str, ...]]  # noqa: UP007 (a runtime alias)


class PlanError(ValueError):
    """A plan that cannot be applied to this tree on this mesh; the message says where and how to fix it."""


class PlanWarning(UserWarning):
    """Something in a plan that is probably a mistake but does not stop it (e.g. a rule matching nothing)."""


def _entry(value: Any, where: str) -> tuple[str, ...]:
    """Normalises one spec entry (None, "axis", ("a", "b")) to a tuple of axis names."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise PlanError(f"{where}: spec entry {value!r} must be None, a mesh axis name, or a tuple of names")


def _as_entries(spec: Any, where: str) -> tuple[tuple[str, ...], ...]:
    if isinstance(spec, str):  # a bare axis name reads as a one-dimensional spec
        spec = (spec,)
    if not isinstance(spec, (PartitionSpec, tuple, list)):
        raise PlanError(f"{where}: spec {spec!r} must be a PartitionSpec or a tuple of mesh axis names / None")
    return tuple(_entry(v, where) for v in spec)


def _to_spec(entries: Sequence[tuple[str, ...]]) -> PartitionSpec:
    return PartitionSpec(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])


def _fmt(entries: Sequence[tuple[str, ...]]) -> str:
    return str(_to_spec(entries))


# ----------------------------------------------------------------------------------------------------- parts
@dataclasses.dataclass(frozen=True)
class PathRules:
    """Ordered ``(regex, spec)`` rules on the "/"-joined path; the first rule whose regex ``re.search``es wins.

    A spec shorter than the array's rank leaves the trailing dimensions to other parts.
    ``only_unannotated`` limits the rules to arrays without logical names (defaults for third-party models).
    """

    rules: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...]
    source: str = "rules"
    only_unannotated: bool = False
    report_unused: bool = True

    def propose(self, leaf: Leaf) -> tuple[int | None, tuple[tuple[str, ...], ...] | None]:
        if self.only_unannotated and leaf.names is not None:
            return None, None
        for i, (pattern, entries) in enumerate(self.rules):
            if re.search(pattern, leaf.path):
                if len(entries) > len(leaf.shape):
                    raise PlanError(
                        f"{self.source}: rule {pattern!r} gives spec {_fmt(entries)} with {len(entries)} entries "
                        f"to {leaf.path!r} of shape {leaf.shape} (rank {len(leaf.shape)}); "
                        f"shorten the spec or make the regex stricter"
                    )
                return i, entries + ((),) * (len(leaf.shape) - len(entries))
        return None, None


@dataclasses.dataclass(frozen=True)
class LogicalRules:
    """Ordered ``(logical_name, mesh_axes)`` rules (flax's convention) for arrays annotated with logical names.

    For each dimension the first rule naming its logical axis whose mesh axes are still free in that array wins.
    """

    rules: tuple[tuple[str, tuple[str, ...]], ...]
    source: str = "logical rules"
    report_unused: bool = True

    def propose(self, leaf: Leaf) -> tuple[list[int], tuple[tuple[str, ...], ...] | None]:
        if leaf.names is None:
            return [], None
        # A rule counts as used when its logical name occurs, even if an earlier rule took the dimension.
        hits = [i for i, (logical, _) in enumerate(self.rules) if logical in leaf.names]
        return hits, assign_by_rules(leaf.names, self.rules)


def assign_by_rules(
    names: Sequence[str | None], rules: Sequence[tuple[str, tuple[str, ...]]], used: frozenset[str] = frozenset()
) -> tuple[tuple[str, ...], ...]:
    """Mesh axes per dimension from ordered logical rules: rules are tried in order, each giving its axes to the
    first still-unassigned dimension of its name if none of those axes is taken yet.

    Rule order, not dimension order, decides: with ``heads → tensor`` before ``seq → tensor`` an attention
    activation ``(batch, seq, heads, head_dim)`` splits its heads, while the residual ``(batch, seq, embed)``
    splits its sequence (Megatron's sequence parallelism).

    >>> assign_by_rules(("seq", "heads"), [("heads", ("tensor",)), ("seq", ("tensor",))])
    ((), ('tensor',))
    """
    taken = set(used)
    out: list[tuple[str, ...]] = [()] * len(names)
    for logical, axes in rules:
        if not axes or taken & set(axes):
            continue
        for d, name in enumerate(names):
            if name == logical and not out[d]:
                out[d] = axes
                taken |= set(axes)
                break
    return tuple(out)


ROLES = ("params", "grads", "optimizer")


@dataclasses.dataclass(frozen=True)
class ShardLargest:
    """Each array of at least ``min_bytes`` is split over ``axis`` on its largest dimension that no other part
    took and whose size the axis divides. Dimensions named in ``avoid`` (e.g. stacked ``layers``, which a scan
    walks through) are never chosen.

    ``applies_to`` names the training-state roles it lays out: all three for FSDP/ZeRO-3 (the parameters
    themselves are split), ``("optimizer",)`` for ZeRO-1 and ``("grads", "optimizer")`` for ZeRO-2, where the
    parameters stay replicated.

    ``block > 1`` aligns shards to whole blocks of that many rows (veScale-FSDP), so a block-wise optimizer sees
    whole blocks on every device: the chosen dimension's shard must be a multiple of ``block``. Where no free
    dimension allows that, the one needing the least padding is padded up to a multiple of ``block`` × the axis
    size; the layout records the padded shape, and the training step stores the padded array and slices it
    before the model sees it. ``paths``, when given, limits the part to exactly those arrays (a per-parameter
    choice such as OSDP's)."""

    axis: str
    min_bytes: int = 4096
    avoid: tuple[str, ...] = ("layers",)
    source: str = "fsdp"
    applies_to: tuple[str, ...] = ROLES
    block: int = 1
    paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.block < 1:
            raise PlanError(f"{self.source}: block must be a positive number of rows, got {self.block}")
        if self.block > 1 and "params" not in self.applies_to:
            raise PlanError(
                f"{self.source}: block-aligned shards need the parameters split too (the padded array is what "
                f"is stored); use block alignment with fsdp/zero3/hsdp"
            )


Part = Union[PathRules, LogicalRules, ShardLargest]  # noqa: UP007


# ----------------------------------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one array is laid out: the report's per-parameter row."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: PartitionSpec
    names: tuple[str | None, ...] | None
    sources: tuple[str | None, ...]  # per dimension, the plan part that chose its axes
    bytes: int
    bytes_per_device: int
    replicas: int
    note: str | None = None
    padded_shape: tuple[int, ...] | None = None  # what is stored, when block alignment pads a dimension

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the array the training state holds: the padded shape, or the shape."""
        return self.padded_shape or self.shape

    @property
    def padding_bytes_per_device(self) -> int:
        """Bytes per device that block alignment adds (zero without padding)."""
        if self.padded_shape is None:
            return 0
        return self.bytes_per_device - self.bytes_per_device * math.prod(self.shape) // math.prod(self.padded_shape)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "padded_shape": None if self.padded_shape is None else list(self.padded_shape),
            "dtype": self.dtype,
            "spec": [None if e is None else e if isinstance(e, str) else list(e) for e in self.spec],
            "bytes": self.bytes,
            "bytes_per_device": self.bytes_per_device,
            "replicas": self.replicas,
            "names": None if self.names is None else list(self.names),
            "note": self.note,
        }


@dataclasses.dataclass(frozen=True)
class Layout:
    """The result of applying a plan to a tree: specs in the tree's structure plus a row per array."""

    specs: Any
    leaves: tuple[LeafLayout, ...]
    unused_rules: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def bytes_per_device(self) -> int:
        return sum(leaf.bytes_per_device for leaf in self.leaves)

    @property
    def bytes(self) -> int:
        return sum(leaf.bytes for leaf in self.leaves)

    @property
    def padded(self) -> bool:
        """Whether block alignment padded any array (the training step then pads and slices)."""
        return any(leaf.padded_shape is not None for leaf in self.leaves)


# ----------------------------------------------------------------------------------------------------- plan
def _merge_unique(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    return a + tuple(x for x in b if x not in a)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A partitioning plan: plain, frozen, comparable data. Build one with a strategy or :meth:`from_rules`.

    >>> import spmd
    >>> from jax.sharding import PartitionSpec as P
    >>> plan = spmd.Plan.from_rules([(r"kernel$", (None, "tensor"))]) + spmd.Plan(batch_axes=("data",))
    >>> plan.specs({"dense": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)}})
    {'dense': {'bias': P(None,), 'kernel': P(None, 'tensor')}}
    >>> plan.batch_spec()
    P('data', None)
    """

    parts: tuple[Part, ...] = ()
    batch_axes: tuple[str, ...] = ()
    replicate: tuple[str, ...] = ()  # regexes of paths allowed to stay replicated where their axes do not divide
    strict: bool = False
    notes: tuple[str, ...] = ()
    remat: bool = False  # rematerialise each layer in the backward pass (FSDP: re-gather rather than keep weights)
    pipeline: PipelineSpec | None = None  # stages on a mesh axis, run by a schedule (strategies.pipeline)
    uneven: Shares | None = None  # uneven batch shares over the data axis (strategies.hetero)
    subnet: SubnetSpec | None = None  # each data-parallel worker trains its subnetwork (strategies.subnetwork_dp)

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_rules(
        cls,
        rules: Sequence[tuple[str, Any]],
        /,
        *,
        source: str = "rules",
        only_unannotated: bool = False,
        report_unused: bool = True,
    ) -> Plan:
        """A plan from ordered ``(regex, spec)`` path rules; spec is a PartitionSpec or a tuple of axes / None.

        >>> Plan.from_rules([("embed", ("fsdp", None))]).parts[0].rules
        (('embed', (('fsdp',), ())),)
        """
        checked = []
        for item in rules:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
                raise PlanError(f"Plan.from_rules: each rule is (regex, spec); got {item!r}")
            pattern, spec = item
            try:
                re.compile(pattern)
            except re.error as e:
                raise PlanError(f"Plan.from_rules: rule regex {pattern!r} does not compile: {e}") from None
            checked.append((pattern, _as_entries(spec, f"Plan.from_rules rule {pattern!r}")))
        part = PathRules(tuple(checked), source, only_unannotated=only_unannotated, report_unused=report_unused)
        return cls(parts=(part,))

    @classmethod
    def from_logical_rules(cls, rules: Sequence[tuple[str, Any]], /, *, source: str = "logical rules") -> Plan:
        """A plan from flax-style ordered ``(logical_name, mesh_axes)`` rules, for logically annotated models.

        >>> Plan.from_logical_rules([("mlp", "tensor"), ("embed", None)]).parts[0].rules
        (('mlp', ('tensor',)), ('embed', ()))
        """
        checked = []
        for item in rules:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
                raise PlanError(f"Plan.from_logical_rules: each rule is (logical_name, mesh_axes); got {item!r}")
            checked.append((item[0], _entry(item[1], f"Plan.from_logical_rules rule {item[0]!r}")))
        return cls(parts=(LogicalRules(tuple(checked), source=source),))

    def __add__(self, other: Plan) -> Plan:
        if not isinstance(other, Plan):
            return NotImplemented
        if self.subnet and other.subnet and self.subnet != other.subnet:
            raise PlanError(f"two subnetwork parts in one plan: {self.subnet.describe()} and {other.subnet.describe()}")
        if (self.subnet or other.subnet) and (self.pipeline or other.pipeline or self.uneven or other.uneven):
            raise PlanError("subnetwork data parallelism does not combine with a pipeline or uneven shares")
        if self.uneven and other.uneven and self.uneven != other.uneven:
            raise PlanError(f"two uneven splits in one plan: {self.uneven.describe()} and {other.uneven.describe()}")
        if (self.pipeline or other.pipeline) and (self.uneven or other.uneven):
            raise PlanError(
                "uneven data parallelism inside a pipeline is not supported; a heterogeneous pipeline gives its "
                "stages uneven layers instead (layers_per_stage)"
            )
        if self.pipeline and other.pipeline and self.pipeline != other.pipeline:
            raise PlanError(
                f"two pipeline parts in one plan: {self.pipeline.describe()} and {other.pipeline.describe()}; keep one"
            )
        return Plan(
            parts=self.parts + other.parts,
            batch_axes=_merge_unique(self.batch_axes, other.batch_axes),
            replicate=_merge_unique(self.replicate, other.replicate),
            strict=self.strict or other.strict,
            notes=_merge_unique(self.notes, other.notes),
            remat=self.remat or other.remat,
            pipeline=self.pipeline or other.pipeline,
            uneven=self.uneven or other.uneven,
            subnet=self.subnet or other.subnet,
        )

    def allow_replication(self, *patterns: str) -> Plan:
        """Opts paths matching any regex into staying replicated where their mesh axes do not divide a dimension.

        The plan records the choice and the report shows every array it applied to.
        """
        note = f"replication allowed where axes do not divide: {', '.join(patterns)}"
        return dataclasses.replace(
            self, replicate=_merge_unique(self.replicate, patterns), notes=_merge_unique(self.notes, (note,))
        )

    def with_block(self, rows: int) -> Plan:
        """Aligns every FSDP split (fsdp, zero3, hsdp) to whole blocks of ``rows`` (veScale-FSDP; see
        :class:`ShardLargest`).

        >>> import strategies
        >>> strategies.fsdp().with_block(128).describe()
        'batch over fsdp; fsdp(axis=fsdp, min_bytes=4096, block=128); layers rematerialised'
        """
        splits = lambda p: isinstance(p, ShardLargest) and "params" in p.applies_to  # noqa: E731
        parts = tuple(dataclasses.replace(p, block=rows) if splits(p) else p for p in self.parts)
        if not any(map(splits, self.parts)):
            raise PlanError(
                f"block alignment ({rows} rows) applies to parameter splits, and this plan has none "
                f"({self.describe()}); combine it with fsdp, zero3 or hsdp"
            )
        return dataclasses.replace(self, parts=parts)

    def with_strict(self, strict: bool = True) -> Plan:
        """Strict plans turn rules that match nothing, and arrays that no part covers, into errors."""
        return dataclasses.replace(self, strict=strict)

    def describe(self) -> str:
        """One line: the batch axes and the parts.

        >>> Plan(batch_axes=("data",)).describe()
        'batch over data; parameters replicated'
        """
        parts: list[str] = []
        for part in self.parts:
            if isinstance(part, ShardLargest):
                options = f"axis={part.axis}, min_bytes={part.min_bytes}"
                options += f", block={part.block}" if part.block > 1 else ""
                options += f", {len(part.paths)} chosen arrays" if part.paths else ""
                parts.append(f"{part.source}({options})")
                if part.applies_to != ROLES:
                    parts[-1] = parts[-1][:-1] + f", {'+'.join(part.applies_to)} only)"
            elif part.source not in parts and part.source not in ("pipeline", "sdp"):
                parts.append(part.source)  # (a pipeline's own rule is described with the pipeline below)
        batch = ",".join(self.batch_axes) or "replicated"
        remat = "; layers rematerialised" if self.remat else ""
        pipeline = f"; {self.pipeline.describe()}" if self.pipeline else ""
        pipeline += f"; {self.uneven.describe()}" if self.uneven else ""
        pipeline += f"; {self.subnet.describe()}" if self.subnet else ""
        return (
            f"batch over {batch}"
            + (f"; {' + '.join(parts)}" if parts else "" if self.pipeline or self.subnet else "; parameters replicated")
            + remat
            + pipeline
        )

    def __str__(self) -> str:
        return self.describe()

    # -- mesh axes ----------------------------------------------------------------------------------------
    def axes_by_source(self) -> dict[str, set[str]]:
        """Every mesh axis the plan refers to, grouped by the part (strategy) that refers to it."""
        used: dict[str, set[str]] = {}
        if self.batch_axes:
            used.setdefault("batch axes", set()).update(self.batch_axes)
        for part in self.parts:
            bucket = used.setdefault(part.source, set())
            if isinstance(part, PathRules):
                bucket.update(a for _, entries in part.rules for e in entries for a in e)
            elif isinstance(part, LogicalRules):
                bucket.update(a for _, axes in part.rules for a in axes)
            else:
                bucket.add(part.axis)
        if self.pipeline:
            used.setdefault("pipeline", set()).add(self.pipeline.axis)
        if self.uneven:
            used.setdefault("uneven data parallelism", set()).add(self.uneven.axis)
        return used

    def check_mesh(self, mesh: Mesh | Mapping[str, int]) -> None:
        """Raises if the plan names a mesh axis the mesh does not have."""
        sizes = _sizes(mesh)
        for source, axes in self.axes_by_source().items():
            missing = sorted(axes - set(sizes))
            if missing:
                shown = ",".join(f"{k}={v}" for k, v in sizes.items())
                first, size = next(iter(sizes.items()))
                example = f"{first}={size // 2},{missing[0]}=2" if size % 2 == 0 else f"{shown},{missing[0]}=..."
                raise PlanError(
                    f"{source} uses mesh axis {missing[0]!r}, but the mesh has only {shown}; add the axis to the "
                    f"mesh (e.g. {example}) or drop that part of the plan"
                )

    # -- resolution ---------------------------------------------------------------------------------------
    def resolve(
        self, tree: Any, mesh: Mesh | Mapping[str, int] | None = None, *, params: Any = None, role: str | None = None
    ) -> Layout:
        """Applies the plan to every array of ``tree`` (arrays, ShapeDtypeStructs, flax boxes, nnx Variables).

        With ``params=``, leaves of ``tree`` that mirror a parameter (an optimizer's moments: same path suffix,
        same shape) take that parameter's layout; other scalars are replicated. ``role`` says which part of the
        training state ``tree`` is ("params", "grads" or "optimizer"; default "optimizer" with ``params=``,
        else "params"): ZeRO-1/2 parts split only the optimizer state and gradients.
        """
        with _gc_paused():
            return self._resolve(tree, mesh, params=params, role=role)

    def _resolve(self, tree: Any, mesh: Mesh | Mapping[str, int] | None, *, params: Any, role: str | None) -> Layout:
        role = role or ("optimizer" if params is not None else "params")
        if role not in ROLES:
            raise PlanError(f"Plan.resolve: role {role!r} must be one of {ROLES}")
        sizes = None if mesh is None else _sizes(mesh)
        if sizes is not None:
            self.check_mesh(sizes)
        leaves, treedef = leaves_with_paths(tree)
        mirror: dict[tuple[str, ...], LeafLayout] = {}
        if params is not None:
            param_leaves, _ = leaves_with_paths(params)
            param_layout = self._resolve_leaves(param_leaves, sizes, report=False, role="params")[0]
            for leaf, row in zip(param_leaves, param_layout, strict=True):
                mirror[leaf.keys] = row
                if len(leaf.keys) > 1 and leaf.keys[0] == "params":  # linen's collection name is optional
                    mirror.setdefault(leaf.keys[1:], row)
        rows: list[LeafLayout | None] = [None] * len(leaves)
        own: list[int] = []
        for i, leaf in enumerate(leaves):
            twin = _find_mirror(leaf, mirror) if mirror else None
            if twin is not None:
                rows[i] = self._on_top(twin, leaf, sizes, role)
            elif mirror and not leaf.shape:
                rows[i] = _row(leaf, (), (), sizes, None)
            else:
                own.append(i)
        resolved, unused, notes = self._resolve_leaves(
            [leaves[i] for i in own], sizes, report=params is None, role=role
        )
        for i, row in zip(own, resolved, strict=True):
            rows[i] = row
        specs = rebuild(treedef, [row.spec for row in rows])
        return Layout(specs=specs, leaves=tuple(rows), unused_rules=tuple(unused), notes=tuple(notes))

    def specs(
        self, tree: Any, mesh: Mesh | Mapping[str, int] | None = None, *, params: Any = None, role: str | None = None
    ) -> Any:
        """A PartitionSpec for every array of ``tree``, in the tree's structure (see :meth:`resolve`)."""
        return self.resolve(tree, mesh, params=params, role=role).specs

    def shardings(self, tree: Any, mesh: Mesh, *, params: Any = None, role: str | None = None) -> Any:
        """A NamedSharding for every array of ``tree``, in the tree's structure (see :meth:`resolve`).

        >>> import spmd
        >>> mesh = spmd.make_mesh({"data": -1})
        >>> spmd.Plan().shardings({"w": np.zeros(3)}, mesh)["w"].spec
        P(None,)
        """
        specs = self.specs(tree, mesh, params=params, role=role)
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))

    def batch_spec(self, ndim: int = 2) -> PartitionSpec:
        """The layout of a batch array: leading dimension over the plan's batch axes, the rest replicated."""
        lead = None if not self.batch_axes else self.batch_axes[0] if len(self.batch_axes) == 1 else self.batch_axes
        return PartitionSpec(lead, *([None] * (ndim - 1)))

    def batch_shardings(self, batch: Any, mesh: Mesh) -> Any:
        """A NamedSharding per batch array (see :meth:`batch_spec`), checking the batch size divides."""
        self.check_mesh(mesh)
        ways = math.prod(mesh.shape[a] for a in self.batch_axes)

        def one(x: Any) -> NamedSharding:
            shape = tuple(getattr(x, "shape", np.shape(x)))
            if not shape or shape[0] % ways:
                raise PlanError(
                    f"batch of shape {shape} cannot be split over batch axes {self.batch_axes} ({ways} ways); "
                    f"make the batch size a multiple of {ways}"
                )
            return NamedSharding(mesh, self.batch_spec(len(shape)))

        return jax.tree.map(one, batch)

    def flax_axis_rules(self, mesh: Mesh | None = None) -> list[tuple[str, Any]]:
        """The plan's logical rules in flax's ``(name, mesh_axes)`` form, ``batch`` first."""
        rules: list[tuple[str, Any]] = []
        if self.batch_axes:
            rules.append(("batch", self.batch_axes if len(self.batch_axes) > 1 else self.batch_axes[0]))
        for part in self.parts:
            if isinstance(part, LogicalRules):
                rules.extend(
                    (name, None if not axes else axes if len(axes) > 1 else axes[0]) for name, axes in part.rules
                )
        return rules

    def activation_spec(self, names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
        """The layout for an activation named by logical axes (used by :func:`spmd.constrain`)."""
        sizes = _sizes(mesh)
        rules = [("batch", self.batch_axes)] + [r for p in self.parts if isinstance(p, LogicalRules) for r in p.rules]
        entries = assign_by_rules(names, rules)
        for dim, axes in enumerate(entries):
            ways = math.prod(sizes[a] for a in axes)
            if axes and shape[dim] % ways:
                raise PlanError(
                    f"spmd.constrain: activation dimension {dim} ({names[dim]!r}) of shape {shape} has size "
                    f"{shape[dim]}, not divisible by mesh axes {axes} ({ways} ways); change the sizes or the rules"
                )
        return _to_spec(entries)

    # -- internals ----------------------------------------------------------------------------------------
    def _on_top(self, twin: LeafLayout, leaf: Leaf, sizes: dict[str, int] | None, role: str) -> LeafLayout:
        """A parameter's layout for a leaf mirroring it, plus the splits only ``role`` gets (ZeRO-1/2)."""
        entries = [_entry(e, leaf.path) for e in twin.spec]
        owners = list(twin.sources)
        note = twin.note
        named = dataclasses.replace(leaf, names=twin.names, keys=tuple(twin.path.split("/")))
        for part in self.parts:
            if isinstance(part, ShardLargest) and role in part.applies_to and "params" not in part.applies_to:
                note = self._shard_largest(part, named, entries, owners, sizes, {}) or note
        return _row(leaf, entries, owners, sizes, note)

    def _resolve_leaves(
        self, leaves: list[Leaf], sizes: dict[str, int] | None, *, report: bool, role: str
    ) -> tuple[list[LeafLayout], list[str], list[str]]:
        hits: set[tuple[int, int]] = set()
        rows: list[LeafLayout] = []
        notes: list[str] = []
        for leaf in leaves:
            row = self._resolve_one(leaf, sizes, hits, role)
            if row.note:
                notes.append(f"{row.path}: {row.note}")
            rows.append(row)
        unused: list[str] = []
        if report and leaves:
            for p, part in enumerate(self.parts):
                if isinstance(part, ShardLargest) or not part.report_unused:
                    continue
                for r, rule in enumerate(part.rules):
                    if (p, r) not in hits:
                        unused.append(f"{part.source}: rule {rule[0]!r} matched nothing")
            if unused:
                if self.strict:
                    raise PlanError(f"strict plan: {unused[0]} (and {len(unused) - 1} more); fix or remove the rule")
                warnings.warn("; ".join(unused), PlanWarning, stacklevel=4)
        return rows, unused, notes

    def _resolve_one(
        self, leaf: Leaf, sizes: dict[str, int] | None, hits: set[tuple[int, int]], role: str
    ) -> LeafLayout:
        ndim = len(leaf.shape)
        entries: list[tuple[str, ...]] = [()] * ndim
        owners: list[str | None] = [None] * ndim
        covered = False
        for p, part in enumerate(self.parts):
            if isinstance(part, ShardLargest):
                continue
            if isinstance(part, PathRules):
                index, proposal = part.propose(leaf)
                if index is not None:
                    hits.add((p, index))
            else:
                indices, proposal = part.propose(leaf)
                hits.update((p, i) for i in indices)
            if proposal is None:
                continue
            covered = covered or isinstance(part, PathRules) or bool(indices)
            for d, axes in enumerate(proposal):
                if not axes:
                    continue
                if entries[d] and entries[d] != axes:
                    raise PlanError(
                        f"{leaf.path} {leaf.shape}: {owners[d]} puts dimension {d} on {entries[d]} but "
                        f"{part.source} puts it on {axes}; make the two parts agree or restrict one's rules"
                    )
                entries[d], owners[d] = axes, part.source
        if sizes is not None:
            self._check_axes(leaf, entries, owners, sizes)
        note = self._check_divisible(leaf, entries, owners, sizes)
        pads: dict[int, int] = {}
        for part in self.parts:
            if isinstance(part, ShardLargest):
                covered = True
                if role in part.applies_to:
                    note = self._shard_largest(part, leaf, entries, owners, sizes, pads) or note
        if self.strict and not covered and ndim:
            raise PlanError(
                f"strict plan: no rule covers {leaf.path} {leaf.shape}; add a rule for it (use spec (None,) * rank "
                f"to keep it replicated on purpose) or drop strict mode"
            )
        return _row(leaf, entries, owners, sizes, note, pads)

    def _check_axes(self, leaf: Leaf, entries: list, owners: list, sizes: dict[str, int]) -> None:
        seen: dict[str, int] = {}
        for d, axes in enumerate(entries):
            for a in axes:
                if a not in sizes:
                    raise PlanError(f"{owners[d]} puts {leaf.path} on mesh axis {a!r}, which the mesh lacks")
                if a in seen:
                    raise PlanError(
                        f"{leaf.path} {leaf.shape}: mesh axis {a!r} is used twice, on dimension {seen[a]} by "
                        f"{owners[seen[a]]} and on dimension {d} by {owners[d]}; one axis can split only one "
                        f"dimension, so change one of the two parts"
                    )
                seen[a] = d

    def _check_divisible(self, leaf: Leaf, entries: list, owners: list, sizes: dict[str, int] | None) -> str | None:
        if sizes is None:
            return None
        note = None
        for d, axes in enumerate(entries):
            ways = math.prod(sizes[a] for a in axes)
            if axes and leaf.shape[d] % ways:
                if any(re.search(p, leaf.path) for p in self.replicate):
                    note = f"dimension {d} ({leaf.shape[d]}) left replicated: {axes} ({ways} ways) do not divide it"
                    entries[d], owners[d] = (), None
                    continue
                raise PlanError(
                    f"{leaf.path} {leaf.shape}: dimension {d} has size {leaf.shape[d]}, not divisible by mesh axes "
                    f"{axes} of size {ways} (chosen by {owners[d]}); change the rule so it picks a divisible "
                    f"dimension, or opt in to replication with plan.allow_replication({_quote(leaf.path)}) "
                    f"(the report then shows it)"
                )
        return note

    def _shard_largest(
        self,
        part: ShardLargest,
        leaf: Leaf,
        entries: list,
        owners: list,
        sizes: dict[str, int] | None,
        pads: dict[int, int],
    ) -> str | None:
        if leaf.nbytes < part.min_bytes or not leaf.shape or any(part.axis in e for e in entries):
            return None
        if part.paths and leaf.path not in part.paths:
            return None
        if sizes is None:
            raise PlanError(
                f"{part.source} chooses a divisible dimension, so it needs the mesh sizes: pass the mesh "
                f"(plan.specs(tree, mesh))"
            )
        ways = sizes[part.axis]
        names = leaf.names or (None,) * len(leaf.shape)
        free = [d for d in range(len(leaf.shape)) if not entries[d] and names[d] not in part.avoid]
        unit = ways * part.block
        fits = [d for d in free if leaf.shape[d] % unit == 0]
        if not fits and part.block > 1 and free and ways > 1:
            # No dimension holds whole blocks on every device: pad the one that costs the fewest extra bytes.
            def padded(d: int) -> int:
                return -(-leaf.shape[d] // unit) * unit

            best = min(free, key=lambda d: (padded(d) * leaf.nbytes // leaf.shape[d], -leaf.shape[d], d))
            entries[best], owners[best] = (part.axis,), part.source
            pads[best] = padded(best)
            return f"padded from {leaf.shape[best]} to {pads[best]} on dimension {best} for {part.block}-row blocks"
        if not fits:
            why = f"not split by {part.source}: no free dimension divisible by {part.axis!r} ({ways})"
            # Already split by another part (e.g. a bias over tensor): not replicated, so a recorded note suffices.
            if any(entries) or any(re.search(p, leaf.path) for p in self.replicate):
                return why
            raise PlanError(
                f"{leaf.path} {leaf.shape} ({leaf.nbytes} bytes, above {part.source}'s min_bytes={part.min_bytes}): "
                f"no free dimension is divisible by mesh axis {part.axis!r} of size {ways}; change the mesh size "
                f"or add a rule for it, or opt in to replication with plan.allow_replication({_quote(leaf.path)})"
            )
        best = max(fits, key=lambda d: (leaf.shape[d], -d))  # largest, first on ties
        entries[best], owners[best] = (part.axis,), part.source
        return None


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


def _quote(path: str) -> str:
    return repr("^" + re.escape(path) + "$")


def _sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    return dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)


def _bytes(nbytes: int, spec: PartitionSpec, sizes: dict[str, int] | None) -> dict[str, int]:
    ways = 1
    for e in spec:
        for a in _entry(e, "spec"):
            ways *= 1 if sizes is None else sizes[a]
    total = 1 if sizes is None else math.prod(sizes.values())
    return {"bytes": nbytes, "bytes_per_device": nbytes // ways, "replicas": total // ways}


def _row(
    leaf: Leaf,
    entries: Sequence,
    owners: Sequence,
    sizes: dict[str, int] | None,
    note: str | None,
    pads: Mapping[int, int] | None = None,
) -> LeafLayout:
    entries = tuple(entries) + ((),) * (len(leaf.shape) - len(entries))
    owners = tuple(owners) + (None,) * (len(leaf.shape) - len(owners))
    spec = _to_spec(entries)
    padded = tuple(pads.get(d, n) for d, n in enumerate(leaf.shape)) if pads else None
    stored_bytes = leaf.nbytes if padded is None else leaf.nbytes // math.prod(leaf.shape) * math.prod(padded)
    counts = _bytes(stored_bytes, spec, sizes)
    return LeafLayout(
        path=leaf.path,
        shape=leaf.shape,
        dtype=leaf.dtype,
        spec=spec,
        names=leaf.names,
        sources=owners,
        note=note,
        padded_shape=padded,
        bytes=leaf.nbytes,
        bytes_per_device=counts["bytes_per_device"],
        replicas=counts["replicas"],
    )


def _find_mirror(leaf: Leaf, mirror: dict[tuple[str, ...], LeafLayout]) -> LeafLayout | None:
    for start in range(len(leaf.keys)):
        twin = mirror.get(leaf.keys[start:])
        if twin is not None and twin.stored_shape == leaf.shape:
            return twin
    return None
