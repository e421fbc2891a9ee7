"""Megatron-style tensor parallelism: attention split by heads, the MLP column- then row-parallel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spmd import Plan
from spmd._plan import LogicalRules

# Common parameter names of unannotated third-party Flax models: column-parallel, then row-parallel projections.
_COLUMN = r"(query|key|value|q_proj|k_proj|v_proj|qkv|wi|wi_0|wi_1|up_proj|gate_proj|fc1|c_fc|c_attn)/kernel$"
_ROW = r"(out|o_proj|out_proj|wo|down_proj|fc2|c_proj)/kernel$"


def tensor_parallel(*, axis: str = "tensor", rules: Sequence[tuple[str, Any]] = ()) -> Plan:
    """Splits attention heads and the MLP hidden dimension over ``axis`` (Megatron's column/row split).

    Logically annotated models (the built-in ones, or any using ``heads``/``mlp`` names) are split through
    logical rules. Unannotated models are split by path: ``rules`` first (your model's names), then defaults
    for common projection names (``query``/``q_proj``/``fc1``... column-parallel, ``out``/``o_proj``/``fc2``...
    row-parallel) on 2-D kernels ``[in, out]``.

    >>> import numpy as np
    >>> tensor_parallel().specs({"fc1": {"kernel": np.zeros((8, 32))}}, {"tensor": 2})
    {'fc1': {'kernel': P(None, 'tensor')}}
    """
    # The logical rules are generic, so a model without heads (an MLP) must not warn about them.
    plan = Plan(parts=(LogicalRules((("heads", (axis,)), ("mlp", (axis,))), "tensor_parallel", report_unused=False),))
    if rules:
        plan = plan + Plan.from_rules(rules, source="tensor_parallel rules")
    defaults = [(_COLUMN, (None, axis)), (_ROW, (axis, None))]
    return plan + Plan.from_rules(defaults, source="tensor_parallel", only_unannotated=True, report_unused=False)


def sequence_parallel(*, axis: str = "tensor") -> Plan:
    """Megatron sequence parallelism: tensor parallelism, plus the regions between the blocks (residual stream,
    layer norms, dropout) split on the sequence dimension over the same ``axis``. The compiler then turns each
    block's activation all-reduce into a reduce-scatter (into the sequence shards) and an all-gather (before the
    next block), and the norm regions' activations take 1/``axis`` of the memory.

    Acts through activation constraints named ``seq`` in model code (:func:`spmd.constrain`); parameters are laid
    out as by :func:`tensor_parallel`.

    >>> from spmd import Plan
    >>> sequence_parallel().activation_spec(("batch", "seq", "embed"), (8, 32, 64), {"tensor": 2})
    P(None, 'tensor', None)
    """
    seq = Plan(parts=(LogicalRules((("seq", (axis,)),), "sequence_parallel", report_unused=False),))
    return tensor_parallel(axis=axis) + seq
