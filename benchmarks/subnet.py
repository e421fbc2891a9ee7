"""Subnetwork data parallelism against data parallelism: loss after a fixed step budget, and memory per device.

    python benchmarks/subnet.py [--steps 60] [--layers 8] [--coverages 0.5,0.25,0.125]

gpt-tiny on data=8 trains the same steps (same data, same initial parameters) under dp and under sdp at each
coverage, block and neuron granularity, forward masking. It prints the training loss (each worker's own
subnetwork's, mean of the last 5 steps), the whole trained model's loss on held-out sequences, each against dp's,
and the model state per device against dp's (the paper: near-dp loss above coverage ~0.3, model-state memory
about C × dp's plus the shared parameters).
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--coverages", default="0.5,0.25,0.125")
    parser.add_argument("--granularities", default="block,neuron")
    args = parser.parse_args()
    import spmd

    spmd.emulate_devices(8)

    import jax
    import numpy as np
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import costmodel, data, models

    model = models.get("gpt-tiny", layers=args.layers)
    mesh = spmd.make_mesh({"data": 8})
    narrow = lambda kept: models.loss_fn(models.narrowed(model, kept))  # noqa: E731

    held_out = data.batch(0, 10**6, 256, model.config.seq_len, model.config.vocab)  # the same chain, unseen steps
    evaluate = jax.jit(models.loss_fn(model))
    abstract = jax.eval_shape(model.init, jax.random.key(0))

    def train(plan: spmd.Plan) -> tuple[float, float, int]:
        optimizer = optax.adam(3e-3, eps=1e-6)
        step = spmd.TrainStep(models.loss_fn(model), optimizer, plan, mesh, params=abstract, narrow=narrow)
        state = step.init(model.init, jax.random.key(0))
        losses = []
        for i in range(args.steps):
            state, loss = step(state, data.batch(0, i, args.batch_size, model.config.seq_len, model.config.vocab))
            losses.append(float(loss))
        full = jax.device_put(step.params_of(state), jax.devices()[0])
        held = float(evaluate(full, jax.device_put(held_out, jax.devices()[0])))
        return float(np.mean(losses[-5:])), held, costmodel.model_state_bytes(step.layout)["total"]

    rows = [("dp", "-", 1.0, *train(strategies.data_parallel()))]
    c = model.config
    groups = {"block": (c.layers,), "neuron": (c.mlp, c.heads)}  # what each granularity cuts into parts
    for granularity in args.granularities.split(","):
        for coverage in (float(x) for x in args.coverages.split(",")):
            if any(n % round(1 / coverage) for n in groups[granularity]):
                print(f"skipped: {granularity} at coverage {coverage:g} (groups {groups[granularity]} do not split)")
                continue
            plan = strategies.subnetwork_dp(coverage=coverage, granularity=granularity)
            rows.append(("sdp", granularity, coverage, *train(plan)))
    dp_loss, dp_held, dp_bytes = rows[0][3:]
    table = Table(
        title=f"gpt-tiny ({args.layers} layers), data=8, {args.steps} steps of {args.batch_size}: loss and memory",
        title_justify="left",
    )
    columns = ("plan", "granularity", "coverage", "training loss", "/ dp", "full model, held out", "/ dp")
    for col in (*columns, "model state per device", "memory / dp"):
        table.add_column(col, justify="left" if col in ("plan", "granularity") else "right")
    for name, granularity, coverage, loss, held, state in rows:
        table.add_row(
            name,
            granularity,
            f"{coverage:g}",
            f"{loss:.4f}",
            f"{loss / dp_loss:.3f}",
            f"{held:.4f}",
            f"{held / dp_held:.3f}",
            spmd.format_bytes(state),
            f"{state / dp_bytes:.3f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
