"""Pipeline schedules: what the executor runs against what the simulator predicts, in one run.

    python benchmarks/pipeline.py [--schedules gpipe,1f1b,interleaved,bfs,zb-h1,zb-h2] [--batch-size 64]

gpt-tiny (8 layers) on stage=4 × data=2, 8 microbatches. For each schedule:

- idle ticks: the compiled program runs the schedule and reports, per tick, which branch each device took; a
  device's idle ticks inside its own span are counted from that record and set against the simulator's (every
  op one tick), device by device;
- residual memory: the step is compiled at two batch sizes; the growth of ``memory_analysis()``'s temporaries
  is the memory that scales with activations. Its ratio to GPipe's is set against the simulator's peak of
  microbatches held (F started, W not finished) relative to GPipe's, and the executor's input slots.
"""

from __future__ import annotations

import argparse

import spmd

MESH = {"stage": 4, "data": 2}
VIRTUAL = {"interleaved": 2, "bfs": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved,bfs,zb-h1,zb-h2")
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
    from spmd._schedule import Costs, simulate
    from spmd._report import memory_of

    model = models.get("gpt-tiny", layers=8)
    mesh = spmd.make_mesh(MESH)
    abstract = jax.eval_shape(model.init, jax.random.key(0))

    def step_for(name: str) -> spmd.TrainStep:
        options = strategies.PipelineOptions(name, args.microbatches, VIRTUAL.get(name, 1))
        plan = strategies.from_names("pp+dp", MESH, pipeline_options=options)
        return spmd.train_step(models.loss_fn(model), optax.adam(1e-3), plan, mesh, staged=model.staged)

    def batch(size: int) -> dict:
        return data.batch(0, 0, size, model.config.seq_len, model.config.vocab)

    rows, growth = [], {}
    for name in args.schedules.split(","):
        step = step_for(name)
        state = step.init(model.init, jax.random.key(0))
        schedule = step.plan.pipeline.schedule
        v = schedule.virtual
        # Executed: the branch each device's switch took at each tick.
        codes = step.pipeline.executed(state.params, batch(args.batch_size), data_axes=step.data_axes)
        executed_idle = []
        for d in range(schedule.stages):
            busy = np.flatnonzero(codes[:, d])
            executed_idle.append(int(busy[-1] - busy[0] + 1 - len(busy)))
        simulated = simulate(schedule, Costs(F=v, B=v, W=v, BW=v))
        simulated_idle = [int(x) for x in simulated.idle]
        # Memory that grows with the activations: temporaries at twice the batch minus at the batch.
        temps = []
        for size in (args.batch_size, 2 * args.batch_size):
            s = step_for(name)
            s.prepare(abstract)
            temps.append(memory_of(s.compile(batch(size)))["temp_bytes"])
        growth[name] = temps[1] - temps[0]
        timeline = simulate(schedule)
        rows.append((name, v, executed_idle, simulated_idle, timeline, step.pipeline.program.slots))

    base = rows[0]
    table = Table(
        title=f"gpt-tiny on stage=4 × data=2, {args.microbatches} microbatches: executed vs simulated",
        title_justify="left",
    )
    columns = (
        "schedule",
        "idle ticks per device: executed",
        "simulated",
        "executed / simulated",
        "peak in flight",
        "peak held",
        "slots",
        "residual memory growth",
        f"memory / {base[0]}'s",
        f"held / {base[0]}'s",
    )
    for col in columns:
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for name, v, executed_idle, simulated_idle, timeline, slots in rows:
        ratio = "1.000 (both 0)" if sum(simulated_idle) == 0 == sum(executed_idle) else (
            f"{sum(executed_idle) / max(1, sum(simulated_idle)):.3f}"
        )
        table.add_row(
            name + (f" v={v}" if v > 1 else ""),
            " ".join(map(str, executed_idle)),
            " ".join(map(str, simulated_idle)),
            ratio,
            str(max(timeline.peak_inflight)),
            str(max(timeline.peak_held)),
            str(slots),
            spmd.format_bytes(growth[name]),
            f"{growth[name] / growth[base[0]]:.3f}",
            f"{max(timeline.peak_held) / max(base[4].peak_held):.3f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
