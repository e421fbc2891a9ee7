"""The analytic cost model against the compiler, strategy by strategy, on one model and 8 devices, in one run.

    python benchmarks/cost_model.py [--model gpt-small] [--batch-size 32] [--layers N] [--block 128]

For each strategy (the ZeRO family on data=8; tensor, sequence and 2-D tensor parallelism; block-aligned
ZeRO-3) it compiles one training step and prints the ratios compiled / analytic of the collective traffic per
device per step, of the step's argument bytes, and of its temporaries (the estimate: gradients, the optimizer's
update and the kept activations), plus block padding as a share of the model state.
"""

from __future__ import annotations

import argparse

import spmd

CASES = (
    ("dp", "data=8", None),
    ("zero1", "data=8", None),
    ("zero2", "data=8", None),
    ("zero3", "data=8", None),
    ("dp+tp", "data=2,tensor=4", None),
    ("dp+sp", "data=2,tensor=4", None),
    ("dp+tp2d", "data=2,tensor=2,tensor2=2", None),
    ("zero3", "data=8", "block"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--block", type=int, default=128, help="rows per block for the block-aligned case")
    args = parser.parse_args()
    spmd.emulate_devices(8)

    import jax
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import costmodel, data, models

    overrides = {"layers": args.layers} if args.layers else {}
    hardware = costmodel.HARDWARE["h100"]
    optimizer = optax.adam(1e-3)
    title = f"{args.model}, batch {args.batch_size}, 8 devices: compiled / analytic, per device, per step"
    table = Table(title=title, title_justify="left")
    columns = ("strategy", "mesh", "traffic", "arguments", "temporaries", "padding / state", "modelled step h100")
    for col in columns:
        table.add_column(col, justify="left" if col in ("strategy", "mesh") else "right")
    for name, mesh_text, option in CASES:
        axes = spmd.parse_mesh(mesh_text)
        model = models.get(args.model, **overrides)
        params = jax.eval_shape(model.init, jax.random.key(0))
        workload = costmodel.Workload(args.batch_size, model.config.seq_len)
        context = strategies.Context(params, workload, hardware, optimizer)
        plan = strategies.from_names(name, axes, context=context)
        if option == "block":
            plan = plan.with_block(args.block)
        model = models.get(args.model, **overrides, remat=plan.remat)
        step = spmd.TrainStep(models.loss_fn(model), optimizer, plan, spmd.make_mesh(axes), params=params)
        batch = data.batch(0, 0, args.batch_size, model.config.seq_len, model.config.vocab)
        r = spmd.report(step, batch, hardware=hardware)
        comm, am, cm = r.comm_bytes_per_step, r.analytic_memory, r.compiled_memory
        table.add_row(
            name + (f" block {args.block}" if option else ""),
            mesh_text,
            f"{comm['compiled'] / comm['analytic']:.3f}",
            f"{cm['argument_bytes'] / am['argument_bytes']:.3f}",
            f"{cm['temp_bytes'] / am['temp_bytes']:.2f}",
            f"{am['padding_bytes'] / r.per_device_bytes['total']:.3f}",
            f"{r.modelled_step_time.total_s * 1e3:.3g} ms",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
