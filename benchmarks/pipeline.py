"""Pipeline schedules: what the executor runs against what the simulator predicts, in one run.

    python benchmarks/pipeline.py [--schedules gpipe,1f1b,interleaved,bfs,zb-h1,zb-h2] [--batch-size 64]

gpt-tiny (8 layers) on stage=4 × data=2, 8 microbatches. For each schedule:

- idle ticks: the compiled program runs the schedule and reports, per tick, which branch each device took; a
  device's idle ticks inside its own span are counted from that record and set against the simulator's (every
  op one tick), device by device;
- residual memory: the step is compiled at two batch sizes; the growth of ``memory_analysis()``'s temporaries
  is the memory that scales with activations: one tick's working set (the same for every schedule with the same
  number of chunks) plus the input slots. Against a reference schedule, the difference in growth is set
  against the difference in slots times the slot's growth; the slots against the simulator's peaks.
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
    from spmd.pipeline import Costs, simulate

    model = models.get("gpt-tiny", layers=8)
    mesh = spmd.make_mesh(MESH)
    abstract = jax.eval_shape(model.init, jax.random.key(0))

    def step_for(name: str) -> spmd.TrainStep:
        options = strategies.PipelineOptions(name, args.microbatches, VIRTUAL.get(name, 1))
        plan = strategies.from_names("pp+dp", MESH, pipeline_options=options)
        return spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=abstract, staged=model.staged)

    def batch(size: int) -> dict:
        return data.batch(0, 0, size, model.config.seq_len, model.config.vocab)

    rows, growth, input_bytes = [], {}, 0
    for name in args.schedules.split(","):
        step = step_for(name)
        state = step.init(model.init, jax.random.key(0))
        engine = step.executor.engine
        schedule = step.plan.execution.schedule
        v = schedule.virtual
        # Executed: the branch each device's switch took at each tick.
        codes = engine.executed(state.params, batch(args.batch_size))
        executed_idle = []
        for d in range(schedule.stages):
            busy = np.flatnonzero(codes[:, d])
            executed_idle.append(int(busy[-1] - busy[0] + 1 - len(busy)))
        simulated = simulate(schedule, Costs(F=v, B=v, W=v, BW=v))
        simulated_idle = [int(x) for x in simulated.idle]
        # Memory that grows with the activations: temporaries at twice the batch minus at the batch.
        temps = [
            step.compile(batch(size)).memory_analysis().temp_size_in_bytes
            for size in (args.batch_size, 2 * args.batch_size)
        ]
        growth[name] = temps[1] - temps[0]
        x = engine.activation(state.params, batch(args.batch_size))
        input_bytes = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize  # doubles with the batch
        rows.append((name, v, executed_idle, simulated_idle, simulated, engine.program.slots))

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
        "temp growth ×2 batch",
        "Δ vs reference: compiled",
        "Δ slots × 2 inputs",
        "ratio",
    )
    for col in columns:
        table.add_column(col, justify="left" if col == "schedule" else "right")
    # Each slot keeps a stage input and its gradient: doubling the batch grows it by twice the input's bytes.
    per_slot = 2 * input_bytes
    reference: dict[int, tuple[str, int]] = {}
    for name, v, executed_idle, simulated_idle, timeline, slots in rows:
        ref_name, ref_slots = reference.setdefault(v, (name, slots))
        ratio = (
            "1.000 (both 0)"
            if sum(simulated_idle) == 0 == sum(executed_idle)
            else f"{sum(executed_idle) / max(1, sum(simulated_idle)):.3f}"
        )
        compiled = growth[name] - growth[ref_name]
        modelled = (slots - ref_slots) * per_slot
        table.add_row(
            name + (f" v={v}" if v > 1 else ""),
            " ".join(map(str, executed_idle)),
            " ".join(map(str, simulated_idle)),
            ratio,
            str(max(timeline.peak_inflight)),
            str(max(timeline.peak_held)),
            str(slots),
            spmd.format_bytes(growth[name]),
            f"{compiled / 1024:+.0f} KiB",
            f"{modelled / 1024:+.0f} KiB",
            "reference" if name == ref_name else f"{compiled / modelled:.3f}" if modelled else "-",
        )
    Console().print(table)
    print(
        f"A slot's input grows by {spmd.format_bytes(input_bytes)} when the batch doubles; the reference for each "
        f"number of chunks is the first schedule with it (chunks change the per-tick working set)."
    )


if __name__ == "__main__":
    main()
