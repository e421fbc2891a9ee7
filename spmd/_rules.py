"""The parts a plan is made of: each proposes, for one array, mesh axes for some of its dimensions.

Every part follows one protocol (:class:`Part`): it proposes a layout for a leaf (:class:`Proposal`), names the
mesh axes it uses, names the logical rules it contributes to activations, reports its rules that matched nothing,
and describes itself in a few words. A plan merges the proposals of its parts dimension by dimension.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from jax.sharding import PartitionSpec

from spmd import axes as names
from spmd._tree import Leaf

__all__ = [
    "ROLES",
    "Entries",
    "LogicalRules",
    "Part",
    "PathRules",
    "PlanError",
    "PlanWarning",
    "Proposal",
    "ShardLargest",
    "assign_by_rules",
    "as_entries",
    "axis_used_twice",
    "entry",
    "is_activation_name",
    "to_spec",
    "user_stacklevel",
]

ROLES = ("params", "grads", "optimizer")  # the three roles of the training state a plan lays out
Entries = tuple[tuple[str, ...], ...]  # per dimension, the mesh axes splitting it (empty: not split)


class PlanError(ValueError):
    """A plan that cannot be applied to this tree on this mesh; the message says where and how to fix it.

    >>> import spmd, numpy as np
    >>> try:
    ...     spmd.Plan.from_rules([("w", ("data",))]).specs({"w": np.zeros(3)}, {"data": 2})
    ... except PlanError as e:
    ...     print(str(e).split(";")[0])
    w (3,): dimension 0 has size 3, not divisible by mesh axes ('data',) of size 2 (chosen by rules)
    """


def entry(value: Any, where: str) -> tuple[str, ...]:
    """One spec entry (None, ``"axis"``, ``("a", "b")``) as a tuple of mesh axis names.

    >>> entry(None, "x"), entry("data", "x"), entry(("data", "fsdp"), "x")
    ((), ('data',), ('data', 'fsdp'))
    """
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise PlanError(f"{where}: spec entry {value!r} must be None, a mesh axis name, or a tuple of names")


def as_entries(spec: Any, where: str) -> Entries:
    """A PartitionSpec (or a tuple of entries, or one axis name) as :data:`Entries`.

    >>> as_entries(PartitionSpec("data", None), "x")
    (('data',), ())
    """
    if isinstance(spec, str):  # a bare axis name reads as a one-dimensional spec
        spec = (spec,)
    if not isinstance(spec, (PartitionSpec, tuple, list)):
        raise PlanError(f"{where}: spec {spec!r} must be a PartitionSpec or a tuple of mesh axis names / None")
    return tuple(entry(v, where) for v in spec)


def to_spec(entries: Sequence[tuple[str, ...]]) -> PartitionSpec:
    """:data:`Entries` as a PartitionSpec.

    >>> to_spec((("data",), (), ("tensor", "fsdp")))
    P('data', None, ('tensor', 'fsdp'))
    """
    return PartitionSpec(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])


@dataclasses.dataclass(frozen=True)
class Proposal:
    """What one part asks of one array.

    ``entries``: mesh axes per dimension (empty: no opinion); ``hits``: which of the part's rules matched (so the
    plan can report rules that matched nothing), or any hashable keys the part reads back in ``unused`` and
    ``advice``; ``covers``: the part decided this array's layout (strict plans want every array covered);
    ``pads``: dimensions padded up to a size (block alignment); ``note``: recorded in the array's layout row;
    ``unmet``: the part should have split the array and could not — an error unless another part split it or the
    plan allows it to stay replicated (``note`` then says why).

    >>> Proposal(((), ("tensor",)), hits=(0,), covers=True).entries
    ((), ('tensor',))
    """

    entries: Entries = ()
    hits: tuple[Hashable, ...] = ()
    covers: bool = False
    pads: Mapping[int, int] = dataclasses.field(default_factory=dict)
    note: str | None = None
    unmet: str | None = None


@runtime_checkable
class Part(Protocol):
    """The protocol of a plan's parts.

    - ``source``: who made the part (a strategy's name), used in errors and descriptions;
    - ``roles``: which roles of the training state (:data:`ROLES`) it lays out;
    - ``after_rules``: whether it proposes after the rule parts, into the dimensions they left free;
    - ``propose(leaf, taken, sizes)``: its :class:`Proposal` for one array (None: no opinion), given the axes
      already taken per dimension and the mesh sizes (None when planning without a mesh);
    - ``axes()``: the mesh axes it may use; ``logical_rules()``: the ``(logical name, mesh axes)`` rules it
      contributes to activations (flax's rule context and :func:`spmd.constrain`);
    - ``unused(hits)``: one message per rule of its own that no array matched (an error under a strict plan);
    - ``advice(hits)``: what else it could not do as asked (a warning even under a strict plan: e.g. tensor
      parallelism splitting nothing); a part whose advice says when it splits nothing sets ``reports_idle``
      (optional, False when absent: the idle-axis check then leaves its axes to it);
    - ``describe()``: a few words.

    The plan resolves an array in two phases. First every rule part (``after_rules`` False) proposes for every
    role; their proposals merge, a conflict is an error, and the mesh axes are checked against the array's
    sizes. Then each part with ``after_rules`` proposes, for the roles it lays out, into the dimensions still
    free: its ``pads``, ``note`` and ``unmet`` apply, and such a part counts as covering every array (it decides
    to leave small ones alone). For an optimizer moment, which mirrors a parameter, only the after-rules parts
    that lay out the optimizer state but not the parameters (ZeRO-1/2) add to the parameter's layout.

    >>> isinstance(ShardLargest("fsdp"), Part), isinstance(LogicalRules((("mlp", ("tensor",)),)), Part)
    (True, True)
    """

    source: str
    roles: tuple[str, ...]
    after_rules: bool

    def propose(self, leaf: Leaf, taken: Entries, sizes: Mapping[str, int] | None) -> Proposal | None: ...

    def axes(self) -> frozenset[str]: ...

    def logical_rules(self) -> tuple[tuple[str, tuple[str, ...]], ...]: ...

    def unused(self, hits: set[int]) -> list[str]: ...

    def advice(self, hits: set[Hashable]) -> list[str]: ...

    def describe(self) -> str: ...


def _unused_rules(part: Any, hits: set[int]) -> list[str]:
    if not part.report_unused:
        return []
    return [f"{part.source}: rule {rule[0]!r} matched nothing" for i, rule in enumerate(part.rules) if i not in hits]


@dataclasses.dataclass(frozen=True)
class PathRules:
    """Ordered ``(regex, spec)`` rules on the "/"-joined path; the first rule whose regex ``re.search``es wins.

    A spec shorter than the array's rank leaves the trailing dimensions to other parts.
    ``only_unannotated`` limits the rules to arrays without logical names (defaults for third-party models).

    >>> from spmd._tree import leaves_with_paths
    >>> import numpy as np
    >>> (leaf,), _ = leaves_with_paths({"fc1": {"kernel": np.zeros((8, 32))}})
    >>> PathRules(((r"fc1/kernel$", ((), ("tensor",))),)).propose(leaf, ((), ()), {"tensor": 2}).entries
    ((), ('tensor',))
    """

    rules: tuple[tuple[str, Entries], ...]
    source: str = "rules"
    only_unannotated: bool = False
    report_unused: bool = True
    roles: ClassVar[tuple[str, ...]] = ROLES
    after_rules: ClassVar[bool] = False
    reports_idle: ClassVar[bool] = False

    @classmethod
    def parse(
        cls, rules: Sequence[tuple[str, Any]], source: str = "rules", *, only_unannotated: bool = False,
        report_unused: bool = True,
    ) -> PathRules:  # fmt: skip
        """Path rules from ``(regex, spec)`` pairs, checked (see :meth:`spmd.Plan.from_rules`).

        >>> PathRules.parse([("kernel$", (None, "tensor"))]).rules
        (('kernel$', ((), ('tensor',))),)
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
            checked.append((pattern, as_entries(spec, f"Plan.from_rules rule {pattern!r}")))
        return cls(tuple(checked), source, only_unannotated=only_unannotated, report_unused=report_unused)

    def propose(self, leaf: Leaf, taken: Entries, sizes: Mapping[str, int] | None) -> Proposal | None:
        if self.only_unannotated and leaf.names is not None:
            return None
        for i, (pattern, entries) in enumerate(self.rules):
            if re.search(pattern, leaf.path):
                if len(entries) > len(leaf.shape):
                    raise PlanError(
                        f"{self.source}: rule {pattern!r} gives spec {to_spec(entries)} with {len(entries)} entries "
                        f"to {leaf.path!r} of shape {leaf.shape} (rank {len(leaf.shape)}); "
                        f"shorten the spec or make the regex stricter"
                    )
                return Proposal(entries + ((),) * (len(leaf.shape) - len(entries)), hits=(i,), covers=True)
        return None

    def axes(self) -> frozenset[str]:
        return frozenset(a for _, entries in self.rules for e in entries for a in e)

    def logical_rules(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return ()

    def unused(self, hits: set[int]) -> list[str]:
        return _unused_rules(self, hits)

    def advice(self, hits: set[Hashable]) -> list[str]:
        return []

    def describe(self) -> str:
        return self.source


@dataclasses.dataclass(frozen=True)
class LogicalRules:
    """Ordered ``(logical_name, mesh_axes)`` rules (flax's convention) for arrays annotated with logical names.

    For each dimension the first rule naming its logical axis whose mesh axes are still free in that array wins.

    >>> from spmd._tree import leaves_with_paths
    >>> from flax import linen as nn
    >>> import numpy as np
    >>> (leaf,), _ = leaves_with_paths({"wi": nn.LogicallyPartitioned(np.zeros((8, 32)), ("embed", "mlp"))})
    >>> LogicalRules((("mlp", ("tensor",)),)).propose(leaf, ((), ()), None).entries
    ((), ('tensor',))
    """

    rules: tuple[tuple[str, tuple[str, ...]], ...]
    source: str = "logical rules"
    report_unused: bool = True
    roles: ClassVar[tuple[str, ...]] = ROLES
    after_rules: ClassVar[bool] = False
    reports_idle: ClassVar[bool] = False

    @classmethod
    def parse(cls, rules: Sequence[tuple[str, Any]], source: str = "logical rules") -> LogicalRules:
        """Logical rules from ``(logical_name, mesh_axes)`` pairs, checked (see
        :meth:`spmd.Plan.from_logical_rules`).

        >>> LogicalRules.parse([("mlp", "tensor")]).rules
        (('mlp', ('tensor',)),)
        """
        checked = []
        for item in rules:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
                raise PlanError(f"Plan.from_logical_rules: each rule is (logical_name, mesh_axes); got {item!r}")
            checked.append((item[0], entry(item[1], f"Plan.from_logical_rules rule {item[0]!r}")))
        return cls(tuple(checked), source=source)

    def propose(self, leaf: Leaf, taken: Entries, sizes: Mapping[str, int] | None) -> Proposal | None:
        if leaf.names is None:
            return None
        # A rule counts as used when its logical name occurs, even if an earlier rule took the dimension.
        hits = tuple(i for i, (logical, _) in enumerate(self.rules) if logical in leaf.names)
        entries = assign_by_rules(leaf.names, self.rules)
        self._check_dropped(leaf, entries)
        return Proposal(entries, hits=hits, covers=bool(hits))

    def _check_dropped(self, leaf: Leaf, entries: Entries) -> None:
        """Raises if a rule went unapplied because another rule gave its mesh axes to another dimension of the
        same array. For activations that fallback is flax's convention (``heads`` before ``seq``), but a stored
        array would silently lose a split the user asked for, where path rules raise for the same request. A
        name with a rule to None, or a second rule for it, is a fallback the user wrote, and no error."""
        names = leaf.names or ()
        for d, name in enumerate(names):
            mine = [(i, axes) for i, (logical, axes) in enumerate(self.rules) if logical == name]
            if entries[d] or not mine or len(mine) > 1 or not mine[0][1]:
                continue
            i, axes = mine[0]
            for e, other in enumerate(entries):
                shared = [a for a in axes if a in other]
                j = next((k for k, rule in enumerate(self.rules) if rule == (names[e], other)), i)
                if shared and j != i:  # the same rule twice: the array repeats a name, its first dimension wins
                    raise axis_used_twice(
                        leaf,
                        shared[0],
                        (e, f"rule {_rule(self.rules[j])}"),
                        (d, f"rule {_rule(self.rules[i])} of {self.source}"),
                        f"one mesh axis can split only one dimension of an array, so map {name!r} or "
                        f"{names[e]!r} to another mesh axis (or to None to keep it whole)",
                    )

    def axes(self) -> frozenset[str]:
        return frozenset(a for _, axes in self.rules for a in axes)

    def logical_rules(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return self.rules

    def unused(self, hits: set[int]) -> list[str]:
        # A logical rule lays out activations that name it too (spmd.constrain, flax's with_logical_constraint):
        # one for an activation name (MaxText's ``activation_*``, spmd's ``batch`` and ``seq``) that no parameter
        # names is doing what it is for, and is not reported as matching nothing.
        for_activations = {i for i, (name, _) in enumerate(self.rules) if is_activation_name(name)}
        return _unused_rules(self, hits | for_activations)

    def advice(self, hits: set[Hashable]) -> list[str]:
        return []

    def describe(self) -> str:
        return self.source


def is_activation_name(name: str) -> bool:
    """Whether a logical name names activations only: MaxText's ``activation_*`` names, spmd's ``batch`` and
    ``seq``. Rules for them match no parameter by design.

    >>> is_activation_name("activation_length"), is_activation_name("seq"), is_activation_name("mlp")
    (True, True, False)
    """
    return name.startswith("activation_") or name in ("batch", "seq")


def _rule(rule: tuple[str, tuple[str, ...]]) -> str:
    name, axes = rule
    value = None if not axes else axes[0] if len(axes) == 1 else axes
    return f"({name!r}, {value!r})"


def axis_used_twice(leaf: Leaf, axis: str, first: tuple[int, str], second: tuple[int, str], fix: str) -> PlanError:
    """The error for one mesh axis splitting two dimensions of one array, naming both dimensions and who put the
    axis on each (shared by path rules, logical rules and plans composed of several parts).

    >>> from spmd._tree import leaves_with_paths
    >>> import numpy as np
    >>> (leaf,), _ = leaves_with_paths({"w": np.zeros((4, 4))})
    >>> print(axis_used_twice(leaf, "tensor", (0, "rule a"), (1, "rule b"), "change one"))
    w (4, 4): mesh axis 'tensor' is used twice, on dimension 0 by rule a and on dimension 1 by rule b; change one
    """
    (d1, by1), (d2, by2) = first, second
    names = f" (logical axes {leaf.names})" if leaf.names is not None else ""
    return PlanError(
        f"{leaf.path} {leaf.shape}{names}: mesh axis {axis!r} is used twice, on dimension {d1} by {by1} and on "
        f"dimension {d2} by {by2}; {fix}"
    )


def assign_by_rules(
    names: Sequence[str | None], rules: Sequence[tuple[str, tuple[str, ...]]], used: frozenset[str] = frozenset()
) -> Entries:
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
    choice such as OSDP's).

    With ``joins``, an array with no free dimension the axis divides is split over ``axis`` on the largest
    dimension another part split, where that dimension's shards divide: FSDP over the context axis beside
    another FSDP split or a tensor split (MaxText splits ``embed`` over ``fsdp`` and ``context`` together).

    >>> ShardLargest("fsdp", block=128).describe()
    'fsdp(axis=fsdp, min_bytes=4096, block=128)'
    """

    axis: str
    min_bytes: int = 4096
    avoid: tuple[str, ...] = (names.LAYERS,)
    source: str = "fsdp"
    applies_to: tuple[str, ...] = ROLES
    block: int = 1
    paths: tuple[str, ...] = ()
    joins: bool = False
    after_rules: ClassVar[bool] = True
    reports_idle: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.block < 1:
            raise PlanError(f"{self.source}: block must be a positive number of rows, got {self.block}")
        if self.block > 1 and "params" not in self.applies_to:
            raise PlanError(
                f"{self.source}: block-aligned shards need the parameters split too (the padded array is what "
                f"is stored); use block alignment with fsdp/zero3/hsdp"
            )

    @property
    def roles(self) -> tuple[str, ...]:
        return self.applies_to

    def propose(self, leaf: Leaf, taken: Entries, sizes: Mapping[str, int] | None) -> Proposal | None:
        if leaf.nbytes < self.min_bytes or not leaf.shape or any(self.axis in e for e in taken):
            return None
        if self.paths and leaf.path not in self.paths:
            return None
        if sizes is None:
            raise PlanError(
                f"{self.source} chooses a divisible dimension, so it needs the mesh sizes: pass the mesh "
                f"(plan.specs(tree, mesh))"
            )
        ways = sizes[self.axis]
        logical = leaf.names or (None,) * len(leaf.shape)
        free = [d for d in range(len(leaf.shape)) if not taken[d] and logical[d] not in self.avoid]
        unit = ways * self.block
        fits = [d for d in free if leaf.shape[d] % unit == 0]
        if not fits and self.block > 1 and free and ways > 1:
            return self._padded(leaf, free, unit)
        joined = self._joined(leaf, taken, sizes) if not fits and self.joins else None
        if joined is not None:
            return joined
        if not fits:
            return Proposal(
                note=f"not split by {self.source}: no free dimension divisible by {self.axis!r} ({ways})",
                unmet=(
                    f"{leaf.path} {leaf.shape} ({leaf.nbytes} bytes, above {self.source}'s min_bytes="
                    f"{self.min_bytes}): no free dimension is divisible by mesh axis {self.axis!r} of size {ways}; "
                    f"change the mesh size or add a rule for it, or opt in to replication with "
                    f"plan.allow_replication({quote(leaf.path)})"
                ),
            )
        best = max(fits, key=lambda d: (leaf.shape[d], -d))  # largest, first on ties
        return Proposal(self._on(best, len(leaf.shape)))

    def _joined(self, leaf: Leaf, taken: Entries, sizes: Mapping[str, int]) -> Proposal | None:
        """The largest dimension another part split whose shards the axis divides, split over it too."""
        logical = leaf.names or (None,) * len(leaf.shape)
        ways = lambda d: math.prod(sizes.get(a, 1) for a in taken[d]) * sizes[self.axis]  # noqa: E731
        split = [d for d in range(len(leaf.shape)) if taken[d] and logical[d] not in self.avoid]
        fits = [d for d in split if leaf.shape[d] % ways(d) == 0]
        if not fits:
            return None
        best = max(fits, key=lambda d: (leaf.shape[d], -d))
        entries = tuple((*e, self.axis) if d == best else () for d, e in enumerate(taken))
        return Proposal(entries, note=f"{self.axis} joins {'+'.join(taken[best])} on dimension {best}")

    def _padded(self, leaf: Leaf, free: list[int], unit: int) -> Proposal:
        """No dimension holds whole blocks on every device: pad the one that costs the fewest extra bytes."""

        def padded(d: int) -> int:
            return -(-leaf.shape[d] // unit) * unit

        best = min(free, key=lambda d: (padded(d) * leaf.nbytes // leaf.shape[d], -leaf.shape[d], d))
        note = f"padded from {leaf.shape[best]} to {padded(best)} on dimension {best} for {self.block}-row blocks"
        return Proposal(self._on(best, len(leaf.shape)), pads={best: padded(best)}, note=note)

    def _on(self, dim: int, ndim: int) -> Entries:
        return tuple((self.axis,) if d == dim else () for d in range(ndim))

    def axes(self) -> frozenset[str]:
        return frozenset((self.axis,))

    def logical_rules(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return ()

    def unused(self, hits: set[int]) -> list[str]:
        return []

    def advice(self, hits: set[Hashable]) -> list[str]:
        return []

    def describe(self) -> str:
        options = f"axis={self.axis}, min_bytes={self.min_bytes}"
        options += f", block={self.block}" if self.block > 1 else ""
        options += f", {len(self.paths)} chosen arrays" if self.paths else ""
        if self.applies_to != ROLES:
            options += f", {'+'.join(self.applies_to)} only"
        return f"{self.source}({options})"


def quote(path: str) -> str:
    """A regex matching exactly ``path``, quoted (for the fixes error messages offer).

    >>> quote("params/w")
    "'^params/w$'"
    """
    return repr("^" + re.escape(path) + "$")


_OURS = (
    os.path.dirname(os.path.abspath(__file__)),
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "strategies"),
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller of this function point at the first frame
    outside spmd and the strategies: the user's line that built the plan or the step.

    >>> user_stacklevel() >= 1
    True
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    return level


class PlanWarning(UserWarning):
    """Something in a plan that is probably a mistake but does not stop it (e.g. a rule matching nothing).

    >>> import spmd, warnings, numpy as np
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     _ = spmd.Plan.from_rules([("nothing", (None,))]).specs({"w": np.zeros(2)})
    >>> str(seen[0].message)
    "rules: rule 'nothing' matched nothing"
    """
