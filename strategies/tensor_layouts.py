"""The layouts tensor parallelism recognises in models without logical names: which projections are
column-parallel (the output features split) and which row-parallel (the input features split), found by path, and
the plan part that applies them and says what it could not pair."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Hashable, Mapping
from typing import Any, ClassVar

from spmd import axes as A
from spmd.rules import ROLES, Entries, LogicalRules, PathRules, PlanError, Proposal

__all__ = ["KNOWN", "LAYOUTS", "Projections", "TensorParallelRules"]


@dataclasses.dataclass(frozen=True)
class Projections:
    """One family's column-parallel projections and their row-parallel partners, as regexes matched in full
    against ``"/"`` + the path of the layer (the array's path without its last key). The group ``unit`` names the
    block a column layer and its row partner share (an attention layer, an MLP); ``transposed`` kernels are stored
    ``[out, in]`` (GPT-2's ``Conv1D``) instead of flax's ``[in, out]``. Under ``by_shape`` a 2-D kernel's
    orientation is read from its shape: the dimension split (the MLP's hidden one, the fused ``q, k, v``) is the
    larger, and ``transposed`` only decides a square kernel (GPT-Neo names its ``nn.Dense`` MLP as GPT-2 names its
    ``Conv1D`` one).

    >>> bert = LAYOUTS[0]
    >>> bert.match("/bert/encoder/layer/0/attention/self/query"), bert.match("/bert/pooler/dense")
    (('column', '/bert/encoder/layer/0/attention'), None)
    """

    family: str
    column: str
    row: str
    transposed: bool = False
    by_shape: bool = False

    def match(self, layer: str) -> tuple[str, str] | None:
        """``(role, unit)`` of ``layer`` ("/"-prefixed path), or None when neither pattern matches it."""
        for role, pattern in (("column", self.column), ("row", self.row)):
            found = re.fullmatch(pattern, layer)
            if found:
                return role, found.group("unit")
        return None


# First match wins: BERT's `attention/output/dense` is the attention's row layer before it could be read as the
# MLP's `output/dense`.
LAYOUTS = (
    Projections(
        "BERT/RoBERTa/ViT attention",
        r"(?P<unit>.*/attention)/(self|attention)/(query|key|value)",
        r"(?P<unit>.*/attention)/output/dense",
    ),
    Projections("BERT/RoBERTa/ViT MLP", r"(?P<unit>.*)/intermediate/dense", r"(?P<unit>.*)/output/dense"),
    Projections(
        "T5 attention",
        r"(?P<unit>.*/(SelfAttention|EncDecAttention))/(q|k|v)",
        r"(?P<unit>.*/(SelfAttention|EncDecAttention))/o",
    ),
    Projections("GPT-2 attention", r"(?P<unit>.*/attn)/c_attn", r"(?P<unit>.*/attn)/c_proj", True, by_shape=True),
    Projections("GPT-2 MLP", r"(?P<unit>.*/mlp)/c_fc", r"(?P<unit>.*/mlp)/c_proj", True, by_shape=True),
    Projections(
        "attention (Llama/Mistral/Gemma, OPT, BART, CLIP, GPT-Neo, GPT-J, flax's MultiHeadDotProductAttention)",
        r"(?P<unit>.*)/(q_proj|k_proj|v_proj|qkv_proj|query|key|value|qkv)",
        r"(?P<unit>.*)/(o_proj|out_proj|out)",
    ),
    Projections(
        "MLP (Llama/Mistral/Gemma, T5, OPT, BART, CLIP, GPT-J)",
        r"(?P<unit>.*)/(gate_proj|up_proj|wi|wi_0|wi_1|fc1|fc_in)",
        r"(?P<unit>.*)/(down_proj|wo|fc2|fc_out)",
    ),
)


KNOWN = "BERT/RoBERTa/ViT, T5, GPT-2, Llama/Mistral/Gemma, and q_proj/query/out_proj/fc1/fc_in/up_proj-style names"
_SPLIT = ("split",)  # the hit of a proposal that splits a dimension


@dataclasses.dataclass(frozen=True)
class TensorParallelRules:
    """The part :func:`strategies.tensor_parallel` makes: logical rules (``heads``, ``mlp``) for annotated arrays,
    the user's path rules, then :data:`LAYOUTS` for arrays without logical names. A column-parallel kernel is split
    on its output features and its bias with it; a row-parallel kernel on its input features, its bias kept whole.

    It warns (:class:`spmd.PlanWarning`, through :meth:`advice`) when a column layer has no row partner in its
    block, and when it splits nothing at all.

    >>> import numpy as np, spmd
    >>> tree = {"mlp": {"up_proj": {"kernel": np.zeros((8, 32))}, "down_proj": {"kernel": np.zeros((32, 8))}}}
    >>> spmd.Plan(parts=(TensorParallelRules("tensor"),)).specs(tree, {"tensor": 2})
    {'mlp': {'down_proj': {'kernel': P('tensor', None)}, 'up_proj': {'kernel': P(None, 'tensor')}}}
    """

    axis: str
    rules: PathRules = PathRules((), "tensor_parallel rules")
    source: str = "tensor_parallel"
    roles: ClassVar[tuple[str, ...]] = ROLES
    after_rules: ClassVar[bool] = False
    reports_idle: ClassVar[bool] = True  # advice() says when it splits nothing, so the idle-axis check need not

    @property
    def logical(self) -> LogicalRules:
        return LogicalRules(((A.HEADS, (self.axis,)), (A.MLP, (self.axis,))), self.source, report_unused=False)

    def propose(self, leaf: Any, taken: Entries, sizes: Mapping[str, int] | None) -> Proposal | None:
        logical = self.logical.propose(leaf, taken, sizes)
        ruled = self.rules.propose(leaf, taken, sizes)
        if logical is None and ruled is None:
            return None if leaf.names is not None else self._by_layout(leaf)
        entries = _merged(leaf, logical, ruled)
        hits = tuple(("rule", i) for i in (ruled.hits if ruled else ())) + ((_SPLIT,) if any(entries) else ())
        return Proposal(
            entries, hits=hits + self._role(leaf), covers=any(p is not None and p.covers for p in (logical, ruled))
        )

    def _role(self, leaf: Any) -> tuple[tuple, ...]:
        """The layout role of a layer a user rule laid out: a row layer given by rule is a column's partner."""
        *layer, kind = leaf.keys
        found = _classify("/" + "/".join(layer)) if leaf.names is None and kind in ("kernel", "bias") else None
        return () if found is None else ((found[1], found[0], found[2], "/".join(layer)),)

    def _by_layout(self, leaf: Any) -> Proposal | None:
        *layer, kind = leaf.keys
        if kind not in ("kernel", "bias") or (kind == "kernel" and len(leaf.shape) < 2):
            return None
        found = _classify("/" + "/".join(layer))
        if found is None:
            return None
        i, role, unit = found
        split = (self.axis,)
        if kind == "bias":
            entries = (split,) if role == "column" else ()
        else:  # the output features of a column kernel, the input features of a row kernel
            layout = LAYOUTS[i]
            on_first = (role == "column") == layout.transposed
            if layout.by_shape and len(leaf.shape) == 2 and leaf.shape[0] != leaf.shape[1]:
                on_first = leaf.shape[0] > leaf.shape[1]
            entries = (split, ()) if on_first else ((), split)
        entries = entries + ((),) * (len(leaf.shape) - len(entries))
        hits = ((role, i, unit, "/".join(layer)),) + ((_SPLIT,) if any(entries) else ())
        return Proposal(entries, hits=hits, covers=True)

    def axes(self) -> frozenset[str]:
        return frozenset((self.axis,)) | self.rules.axes()

    def logical_rules(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return self.logical.rules

    def unused(self, hits: set[Hashable]) -> list[str]:
        return self.rules.unused({h[1] for h in hits if h[0] == "rule"})

    def advice(self, hits: set[Hashable]) -> list[str]:
        """What it could not do as tensor parallelism means to: column layers without a row partner, or nothing
        split at all (then the axis only replicates work)."""
        if _SPLIT not in hits:
            return [self._splits_nothing()]
        rows = {(h[1], h[2]) for h in hits if h[0] == "row"}
        alone = sorted({h[1:] for h in hits if h[0] == "column" and (h[1], h[2]) not in rows})
        return [self._no_partner([layer for _, _, layer in alone], alone[0][1], LAYOUTS[alone[0][0]])] if alone else []

    def _no_partner(self, layers: list[str], unit: str, layout: Projections) -> str:
        more = f" (and {len(layers) - 1} more)" if len(layers) > 1 else ""
        return (
            f"{self.source}: column-parallel layer {layers[0]!r}{more} ({layout.family}) has no row-parallel "
            f"partner in its block {unit.lstrip('/')!r}: its output, split over {self.axis!r}, is gathered whole "
            f"for the next layer "
            f"instead of feeding a matmul split on its input; give the layer that consumes it as a rule, e.g. "
            f"tensor_parallel(rules=[(r'<consumer>/kernel$', ({self.axis!r}, None))])"
        )

    def _splits_nothing(self) -> str:
        return (
            f"{self.source} splits nothing in this model: no array has the logical names 'heads' or 'mlp', matches "
            f"its rules, or has a path of a layout it recognises ({KNOWN}), so mesh axis {self.axis!r} splits no "
            f"parameter and the work is replicated over it; give rules for the model's own layers, e.g. "
            f"tensor_parallel(rules=[(r'up/kernel$', (None, {self.axis!r})), (r'down/kernel$', ({self.axis!r}, None))])"
        )

    def describe(self) -> str:
        return self.source


@functools.lru_cache(maxsize=1 << 16)  # a layer's kernel, bias and every step's resolutions ask the same
def _classify(layer: str) -> tuple[int, str, str] | None:
    """``(index in LAYOUTS, role, unit)`` of the first layout matching ``layer`` ("/"-prefixed), or None."""
    for i, layout in enumerate(LAYOUTS):
        found = layout.match(layer)
        if found is not None:
            return (i, *found)
    return None


def _merged(leaf: Any, *proposals: Proposal | None) -> Entries:
    """The logical and the user's rules' entries for one array, which must agree where both split a dimension."""
    entries: list[tuple[str, ...]] = [()] * len(leaf.shape)
    for proposal in proposals:
        for d, axes in enumerate(proposal.entries if proposal else ()):
            if axes and entries[d] and entries[d] != axes:
                raise PlanError(
                    f"{leaf.path} {leaf.shape}: tensor_parallel's logical rules put dimension {d} on {entries[d]} "
                    f"but its rules put it on {axes}; drop the rule or make it agree"
                )
            entries[d] = axes or entries[d]
    return tuple(entries)
