"""Optimizer state offloaded to host memory (ZeRO-Offload) under DP and ZeRO-3: device and host memory per device
from the compiled program, with and without offload, in one run.

    python benchmarks/offload.py [--model gpt-small] [--devices 8] [--batch-size 32] [--layers N]

Per strategy and setting: the compiled program's device arguments and temporaries, its host arguments
(``memory_analysis()``'s host fields, or where the backend leaves them 0, the arrays its entry layout places in
host memory), the share of the optimizer state that left the device's arguments, and the host<->device transfer
per step the cost model adds. On the CPU backend host and device memory are the same RAM: the placement is
real in the compiled program, the transfers are not timed (nothing here is).
"""

from __future__ import annotations

import argparse

import spmd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layers", type=int, help="override the model's number of layers")
    args = parser.parse_args()
    spmd.emulate_devices(args.devices)

    import jax
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import data, models

    mesh = spmd.make_mesh({"data": args.devices})
    fmt = spmd.format_bytes
    sizes = {"layers": args.layers} if args.layers else {}
    title = f"{args.model}, data={args.devices}, batch {args.batch_size}, adam: per device"
    table = Table(title=title, title_justify="left")
    columns = (
        "strategy", "offload", "device args", "device temp", "device args+temp", "host args", "host args analytic",
        "args saved / optimizer state", "args+temp / without", "host<->device per step",
    )  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("strategy", "offload") else "right")
    for name in ("dp", "zero3"):
        without = None
        for offload in (False, True):
            plan = strategies.from_names(name)
            plan = plan + strategies.offload("optimizer") if offload else plan
            model = models.get(args.model, remat=plan.remat, **sizes)
            params = jax.eval_shape(model.init, jax.random.key(0))
            step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=params)
            batch = data.batch(0, 0, args.batch_size, model.config.seq_len, model.config.vocab)
            report = spmd.report(step, batch)
            cm, am = report.compiled_memory, report.analytic_memory
            used = cm["argument_bytes"] + cm["temp_bytes"]
            optimizer = step.layout.opt_state.bytes_per_device
            if without is None:
                without = (cm["argument_bytes"], used)
            saved = (without[0] - cm["argument_bytes"]) / optimizer
            table.add_row(
                name,
                "optimizer" if offload else "-",
                fmt(cm["argument_bytes"]),
                fmt(cm["temp_bytes"]),
                fmt(used),
                fmt(cm.get("host_argument_bytes", 0)),
                fmt(am.get("host_argument_bytes", 0)),
                f"{saved:.3f}",
                f"{used / without[1]:.3f}",
                fmt(am.get("host_transfer_bytes", 0)),
            )
    Console().print(table)


if __name__ == "__main__":
    main()
