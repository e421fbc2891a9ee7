"""Plan families. Each strategy is a pure function returning a :class:`spmd.Plan`; plans compose with ``+``.

``REGISTRY`` maps the names the CLI's ``--strategy`` joins with ``+`` to factories taking the mesh axis sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from spmd import Plan
from strategies.data_parallel import data_parallel
from strategies.expert import expert_parallel
from strategies.fsdp import fsdp
from strategies.tensor import sequence_parallel, tensor_parallel
from strategies.zero import hsdp, zero1, zero2, zero3

__all__ = [
    "REGISTRY",
    "data_parallel",
    "expert_parallel",
    "from_names",
    "fsdp",
    "hsdp",
    "sequence_parallel",
    "tensor_parallel",
    "zero1",
    "zero2",
    "zero3",
]

REGISTRY: dict[str, Callable[[], Plan]] = {
    "dp": lambda: data_parallel(axis="data"),
    "fsdp": lambda: fsdp(axis="fsdp"),
    "tp": lambda: tensor_parallel(axis="tensor"),
    "sp": lambda: sequence_parallel(axis="tensor"),
    "zero1": lambda: zero1(axis="data"),
    "zero2": lambda: zero2(axis="data"),
    "zero3": lambda: zero3(axis="data"),
    "hsdp": lambda: hsdp(shard_axis="fsdp", replicate_axis="data"),
    "ep": lambda: expert_parallel(axis="expert"),
}


def from_names(spec: str, mesh_axes: Mapping[str, int] | None = None) -> Plan:
    """Composes registry strategies named like ``"dp+fsdp+tp"`` into one plan.

    >>> from_names("dp+tp").batch_axes
    ('data',)
    """
    names = [n.strip() for n in spec.split("+")]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown or not names:
        raise ValueError(
            f"--strategy {spec!r}: unknown strategy {unknown[0] if unknown else ''!r}; "
            f"choose from {', '.join(REGISTRY)} joined with '+' (e.g. dp+fsdp+tp)"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"--strategy {spec!r}: a strategy appears twice; name each once")
    plan = Plan()
    for name in names:
        plan = plan + REGISTRY[name]()
    if mesh_axes is not None:
        plan.check_mesh(mesh_axes)
    return plan
