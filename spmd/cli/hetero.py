"""What a device profile changes for a plan, as the ``plan`` and ``compare`` commands show it: the uneven split,
and the modelled step time of the even and of the uneven split."""

from __future__ import annotations

from typing import Any

from spmd import Report, TrainStep, costmodel
from spmd.cli.setup import Setup
from spmd.execution import TensorShares
from strategies import hetero, tensor_shares

__all__ = ["figures", "text"]


def figures(s: Setup, report: Report, step: TrainStep) -> dict[str, Any]:
    """``batch_shares``, ``layers_per_stage`` (and a pipeline's ``rank_microbatches``) or ``tensor_units``, the
    modelled step time of the even split and of the uneven one, their ratio, and the ideal ratio Σs / (N · min s)
    (``report``: the ``step``'s, whose executor's bubble the modelled compute includes)."""
    workload = costmodel.Workload(s.batch_size, s.model.config.seq_len)
    bubble = step.executor.costs(step.layout, s.abstract_batch(), workload).compute_factor
    # A pipeline's layers per stage, as its engine placed them (an even split unless the plan says otherwise).
    layers = report.execution.figures.get("layers_per_stage") if report.execution is not None else None
    tensor = None
    if isinstance(s.plan.execution, TensorShares):  # each tensor position's FLOPs with its own units
        tensor = tensor_shares.tensor_position_flops(s.plan, s.params, dict(s.mesh.shape), workload)
    return hetero.summary(
        s.plan, dict(s.mesh.shape), s.profile, s.batch_size, report.flops_per_device, report.modelled_step_time,
        layers, tensor_flops=tensor, compute_factor=bubble,
    )  # fmt: skip


def text(info: dict[str, Any]) -> str:
    """One line for the terminal."""
    units = info.get("tensor_units")
    split = (
        f"batch shares {info['batch_shares']}"
        if info.get("batch_shares")
        else "tensor units " + ", ".join(f"{n} {u}" for n, u in units.items())
        if units
        else f"layers per stage {info['layers_per_stage']}"
        if info.get("layers_per_stage")
        else "even split"
    )
    if info.get("rank_microbatches"):
        split += f", microbatches per data position {info['rank_microbatches']}"
    t = info["simulated_step_time"]
    speedup, ideal, bound = info["simulated_speedup"], info["ideal_speedup"], info["speedup_bound"]
    return (
        f"heterogeneous devices (speeds {info['device_speeds']}): {split}; modelled step "
        f"{t['even'] * 1e3:.3g} ms even → {t['hetero'] * 1e3:.3g} ms uneven, speedup {speedup:.3f} (ideal {ideal:.3f}; "
        f"{bound:.3f} at most with the communication unchanged)"
    )
