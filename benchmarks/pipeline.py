"""Pipeline schedules: what the executor runs against what the simulator and the cost model predict, in one run.

    python benchmarks/pipeline.py [--schedules gpipe,1f1b,interleaved,bfs,zb-h1,zb-h2,zb-v] [--batch-size 64]

gpt-tiny (8 layers) on stage=4 × data=2, 8 microbatches. For each schedule:

- idle ticks: the compiled program runs the schedule and reports, per tick, which branch each device took; a
  device's idle ticks inside its own span are counted from that record and set against the lock-step
  simulation's (every action one tick), device by device;
- matmul work: the compiled program's matmul FLOPs per device against a data-parallel step's on data=8 (same
  model and batch): a pipeline computes nothing twice; and, per run of each tick-switch branch, B, W and BW
  against F (the backward split in two halves of about one forward each, BW a whole backward);
- memory: the compiled temporaries against the report's analytic temporaries (the slots at the schedule's peak,
  each keeping an input, its gradient, the layers' residuals and what B hands W, plus one tick's working set);
- time: the report's modelled step time (compute times the lock-step makespan over the busy time, plus
  communication) against 1F1B's (or the first schedule's, when 1F1B is not run). Modelled, not measured: wall
  time on emulated CPU devices says nothing about an accelerator.
"""

from __future__ import annotations

import argparse

import spmd

MESH = {"stage": 4, "data": 2}
VIRTUAL = {"interleaved": 2, "bfs": 2, "zb-v": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved,bfs,zb-h1,zb-h2,zb-v")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    spmd.emulate_devices(8)

    import jax
    import numpy as np
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import data, models
    from spmd.pipeline import Costs, simulate_lockstep

    model = models.get("gpt-tiny", layers=8)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    batch = data.batch(0, 0, args.batch_size, model.config.seq_len, model.config.vocab)

    def step_on(plan: spmd.Plan, axes: dict) -> spmd.TrainStep:
        mesh = spmd.make_mesh(axes)
        return spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=abstract, staged=model.staged)

    dp = spmd.report(step_on(strategies.data_parallel(), {"data": 8}), batch)
    rows = []
    for name in args.schedules.split(","):
        options = strategies.PipelineOptions(name, args.microbatches, VIRTUAL.get(name, 1))
        step = step_on(strategies.from_names("pp+dp", MESH, pipeline_options=options), MESH)
        state = step.init(model.init, jax.random.key(0))
        engine, schedule = step.executor.engine, step.plan.execution.schedule
        v = schedule.virtual
        codes = engine.executed(state.params, batch)  # the branch each device's switch took at each tick
        executed = []
        for d in range(schedule.stages):
            busy = np.flatnonzero(codes[:, d])
            executed.append(int(busy[-1] - busy[0] + 1 - len(busy)))
        lockstep = simulate_lockstep(schedule, Costs(F=v, B=v, W=v, BW=v))
        report = spmd.report(step, batch)
        idle = [int(x) for x in lockstep.idle]
        rows.append(
            (name, v, executed, idle, report, engine.branch_flops(step.compile(batch).as_text()), engine.program.slots)
        )

    reference = next((r[4] for r in rows if r[0] == "1f1b"), rows[0][4])
    ref_name = next((r[0] for r in rows if r[4] is reference), "")
    table = Table(
        title=f"gpt-tiny (8 layers) on stage=4 × data=2, {args.microbatches} microbatches, batch "
        f"{args.batch_size}: executed vs simulated and modelled",
        title_justify="left",
    )
    columns = (
        "schedule",
        "idle ticks per device: executed",
        "lock-step simulated",
        "executed / simulated",
        "FLOPs / dp",
        "B/F",
        "W/F",
        "BW/F",
        "temp: compiled",
        "analytic",
        "compiled / analytic",
        "slots",
        "lock-step bubble",
        f"modelled step / {ref_name}",
    )
    for col in columns:
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for name, v, executed, simulated, report, flops, slots in rows:
        ratio = (
            "1.000 (both 0)"
            if sum(simulated) == 0 == sum(executed)
            else f"{sum(executed) / max(1, sum(simulated)):.3f}"
        )
        compiled, analytic = report.compiled_memory["temp_bytes"], report.analytic_memory["temp_bytes"]
        figures = report.execution.figures
        time = report.modelled_step_time.total_s / reference.modelled_step_time.total_s
        table.add_row(
            name + (f" v={v}" if v > 1 else ""),
            " ".join(map(str, executed)),
            " ".join(map(str, simulated)),
            ratio,
            f"{report.compiled_flops / dp.compiled_flops:.3f}",
            *(f"{flops[kind] / flops['F']:.3f}" for kind in ("B", "W", "BW")),
            spmd.format_bytes(compiled),
            spmd.format_bytes(analytic),
            f"{compiled / analytic:.3f}",
            str(slots),
            f"{figures['lockstep_bubble_fraction']:.3f}",
            f"{time:.3f}",
        )
    Console().print(table)
    print(
        f"FLOPs / dp: compiled matmul FLOPs per device against data parallelism on data=8 "
        f"({dp.compiled_flops:.4g}); B/F, W/F, BW/F per run of each branch (W/F 0: a schedule without W); "
        f"modelled step times on {reference.modelled_step_time.hardware} (compute × lock-step makespan / busy, "
        f"plus communication)."
    )


if __name__ == "__main__":
    main()
