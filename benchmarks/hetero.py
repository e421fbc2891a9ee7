"""Heterogeneous clusters: the cost model's step time of an even split and of a speed-proportional one.

    python benchmarks/hetero.py [--model gpt-small] [--batch-size 256] [--device-kind h100]

For clusters of 8 devices — 4 fast + 4 slow at 2:1 and at 3:1, and three kinds at 4:2:1 — it plans data
parallelism (data=8: batch shares), FSDP (data=4 × fsdp=2: shares per data rank, each split over its fsdp pair)
and a pipeline two ways (stage=4 × data=2, 1F1B: layers per stage; stage=2 × data=4 with the devices of a kind
on one data position's stages: microbatches per data position), tensor parallelism with each tensor pair a fast
and a slow device (data=4 × tensor=2: heads and hidden units per tensor position by its speed, HAP's uneven
sharding), and prints the modelled step time of the even plan
and of the uneven one, their ratio, the ideal ratio Σs / (N · min s), and the bound the cost model leaves
(``hetero.speedup_bound``: the compute shrunk by the ideal ratio, the communication unchanged). Then the
planner's pick (``strategies.suggest.rank`` with the profile: every composition of up to 2-way tensor
parallelism, and pipelines of 2 and 4 stages under 1F1B and ZB-H1 with 2 and 4 microbatches a stage, priced
by their executor) against the best even plan on the same devices, which the slowest device paces. Nothing is
compiled: the plans are laid out on abstract parameters (8 emulated devices) and priced by the cost model, with
the fastest kind as ``--device-kind``.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

CLUSTERS = {
    "4 fast + 4 slow, 2:1": [2, 2, 2, 2, 1, 1, 1, 1],
    "4 fast + 4 slow, 3:1": [3, 3, 3, 3, 1, 1, 1, 1],
    "3 kinds, 4:2:1": [4, 4, 2, 2, 2, 1, 1, 1],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--device-kind", default="h100")
    args = parser.parse_args()
    import spmd

    spmd.emulate_devices(8)  # the plans are laid out on a mesh of 8 (emulated) devices; nothing runs

    import jax
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import costmodel, models
    from strategies import hetero, suggest, tensor_shares

    model = models.get(args.model)
    optimizer = optax.adam(1e-3)
    hardware = costmodel.hardware(args.device_kind)
    workload = costmodel.Workload(args.batch_size, model.config.seq_len)
    abstract = jax.eval_shape(model.init, jax.random.key(0))

    batch = {"tokens": jax.ShapeDtypeStruct((args.batch_size, model.config.seq_len), "int32")}

    def step_for(plan: spmd.Plan, axes: dict[str, int]) -> spmd.TrainStep:
        return spmd.TrainStep(
            models.loss_fn(model), optimizer, plan, spmd.make_mesh(axes), params=abstract, staged=model.staged,
            narrow=lambda sizes: models.loss_fn(models.narrowed(model, sizes)),
        )  # fmt: skip

    def priced(plan: spmd.Plan, axes: dict[str, int]) -> tuple[spmd.TrainStep, costmodel.Estimate, float]:
        """A plan's step, the cost model's estimate of it at the fastest device's speed with what its executor
        adds (a pipeline's sends between stages, its lock-step bubble), and that bubble."""
        step = step_for(plan, axes)
        costs = step.executor.costs(step.layout, batch, workload)
        return step, costmodel.estimate_layout(step.layout, plan, axes, workload, hardware, costs), costs.compute_factor

    def compared(plan: spmd.Plan, even: spmd.Plan, axes: dict[str, int], placed: Any, **extra: Any) -> dict:
        """``hetero.summary`` of ``plan`` on the devices of ``placed``, the even split charged the communication
        of the ``even`` plan (a pipeline's positions with more microbatches send more; stages padded to the
        deepest gather more)."""
        step, estimate, bubble = priced(plan, axes)
        if isinstance(plan.execution, spmd.execution.PipelineSpec):
            extra["layers_per_stage"] = step.executor.engine.placement.counts
        return hetero.summary(
            plan, axes, placed, args.batch_size, estimate.flops, estimate.time, compute_factor=bubble,
            even_comm_s=priced(even, axes)[1].time.comm_s, **extra,
        )  # fmt: skip

    @functools.cache
    def costs_of(axes: tuple[tuple[str, int], ...], plan: spmd.Plan) -> tuple[Any, costmodel.Contribution]:
        step = step_for(plan, dict(axes))
        return step.layout, step.executor.costs(step.layout, batch, workload)

    def executor_costs(axes: dict[str, int], plan: spmd.Plan) -> tuple[Any, costmodel.Contribution]:
        """A pipeline's stored layout and what its executor adds to the estimate (the planner's ``price``): the
        even plans recur on every cluster."""
        return costs_of(tuple(axes.items()), plan)

    even_ranked: dict[str, list] = {}  # the planner's ranking on devices of one kind: the same for every cluster
    table = Table(
        title=f"{args.model}, batch {args.batch_size}, 8 devices, fastest = {args.device_kind}: modelled step time",
        title_justify="left",
    )
    for col in ("cluster", "plan", "split", "even", "uneven", "speedup", "ideal", "bound", "speedup / ideal"):
        table.add_column(col, justify="left" if col in ("cluster", "plan", "split") else "right")
    for cluster, speeds in CLUSTERS.items():
        profile = spmd.devices.Profile.from_speeds(speeds)
        data_axes = {"data": 8}
        shares = hetero.batch_shares(args.batch_size, profile, data_axes)
        plan = strategies.data_parallel() + hetero.uneven_data_parallel(shares)
        _, estimate, _ = priced(strategies.data_parallel(), data_axes)
        dp = hetero.summary(plan, data_axes, profile, args.batch_size, estimate.flops, estimate.time)
        pp_axes = {"stage": 4, "data": 2}
        counts = hetero.stage_layers(model.config.layers, profile, pp_axes)
        options = strategies.PipelineOptions("1f1b", args.microbatches, 1, counts)
        pp_plan = strategies.from_names("pp+dp", pp_axes, pipeline_options=options)
        even_options = strategies.PipelineOptions("1f1b", args.microbatches, 1, None)
        pp = compared(pp_plan, strategies.from_names("pp+dp", pp_axes, pipeline_options=even_options), pp_axes, profile)
        # Each data position runs its own pipeline, on stage devices of one kind, with microbatches by its speed.
        columns = {"stage": 2, "data": 4}
        placed = profile.reordered(hetero.kind_order(profile, columns, outer="data"))
        even_plan = strategies.from_names("pp+dp", columns, pipeline_options=even_options)
        ranks_plan = hetero.apply_profile(
            even_plan, columns, placed, params=abstract, workload=workload, optimizer=optimizer
        )
        ranks = compared(ranks_plan, even_plan, columns, placed)
        # Uneven tensor parallelism: each tensor pair mixes a fast device with a slow one.
        tp_axes = {"data": 4, "tensor": 2}
        mixed = profile.reordered((0, 4, 1, 5, 2, 6, 3, 7))
        even_tp = strategies.from_names("dp+tp", tp_axes)
        tp_plan = hetero.apply_profile(
            even_tp, tp_axes, mixed, params=abstract, workload=workload, optimizer=optimizer
        )  # fmt: skip
        at = tensor_shares.tensor_position_flops(tp_plan, abstract, tp_axes, workload)
        tp = compared(tp_plan, even_tp, tp_axes, mixed, tensor_flops=at)
        units = ", ".join(f"{n} {u}" for n, u in tp["tensor_units"].items())
        picked = functools.partial(
            _picked, suggest, abstract, workload, hardware, optimizer, profile, executor_costs, even_ranked
        )
        for name, info, split in (
            ("dp, data=8", dp, f"shares {dp['batch_shares']}"),
            ("dp+fsdp, data=4 × fsdp=2", *picked(("dp+fsdp", {"data": 4, "fsdp": 2}))),
            ("pp+dp, stage=4 × data=2", pp, f"layers {pp['layers_per_stage']}"),
            ("pp+dp, stage=2 × data=4", ranks, f"microbatches per data position {ranks['rank_microbatches']}"),
            ("dp+tp, data=4 × tensor=2, pairs mixed", tp, f"tensor units {units}"),
            ("planner's pick", *picked()),
        ):
            t = info["simulated_step_time"]
            table.add_row(
                cluster,
                name,
                split,
                f"{t['even'] * 1e3:.3g} ms",
                f"{t['hetero'] * 1e3:.3g} ms",
                f"{info['simulated_speedup']:.3f}",
                f"{info['ideal_speedup']:.3f}",
                f"{info['speedup_bound']:.3f}" if "speedup_bound" in info else "-",
                f"{info['simulated_speedup'] / info['ideal_speedup']:.3f}",
            )
    Console().print(table)


def _picked(
    suggest: Any,
    params: Any,
    workload: Any,
    hardware: Any,
    optimizer: Any,
    profile: Any,
    price: Any,
    even_ranked: dict[str, list],
    only: Any = None,
) -> tuple[dict, str]:
    """The planner's pick on the profile's devices (``only``: of that strategy on that mesh, its best microbatch
    and policies) against the best even plan on them, which the slowest device paces: the figures as
    ``hetero.summary`` gives them, and the pick's mesh, strategy, split and microbatch."""
    options = {"devices": 8, "memory_per_device": 80 << 30, "optimizer": optimizer, "max_tensor": 2}
    options |= {"stages": (1, 2, 4), "schedules": ("1f1b", "zb-h1"), "microbatches_per_stage": (2, 4), "price": price}
    ranked, _ = suggest.rank(params, workload, hardware, **options, profile=profile)
    if "even" not in even_ranked:
        even_ranked["even"] = suggest.rank(params, workload, hardware, **options)[0]
    even = even_ranked["even"]
    if only is not None:
        ranked, even = ([s for s in r if (s.strategy, s.mesh) == only] for r in (ranked, even))
    pace = max(profile.speeds) / min(profile.speeds)
    slowest = min(s.estimate.time.compute_s * pace + s.estimate.time.comm_s for s in even if s.fits)
    best = ranked[0]
    speeds = profile.speeds
    info = {
        "simulated_step_time": {"even": slowest, "hetero": best.step_s},
        "simulated_speedup": slowest / best.step_s,
        "ideal_speedup": sum(speeds) / (len(speeds) * min(speeds)),
    }
    mesh = ",".join(f"{k}={v}" for k, v in best.mesh.items())
    shares = getattr(best.plan.execution, "shares", None)
    split = best.to_dict()
    if shares:
        split = f"shares {list(shares)}, microbatch {best.plan.execution.microbatch}"
    elif split.get("layers_per_stage") or split.get("rank_microbatches"):
        layers, ranks = split.get("layers_per_stage"), split.get("rank_microbatches")
        split = f"{split['schedule']}, " + ", ".join(
            ([f"layers {layers}"] if layers else []) + ([f"microbatches per data position {ranks}"] if ranks else [])
        )
    else:
        split = "even"
    return info, (f"{best.strategy} on {mesh}, " if only is None else "") + split


if __name__ == "__main__":
    main()
