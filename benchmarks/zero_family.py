"""ZeRO family on one model and mesh: compiled against analytic, and each stage against DP, in one run.

    python benchmarks/zero_family.py [--model gpt-small] [--devices 8] [--batch-size 32]

Prints, per stage, model state per device against the ZeRO paper's formula, compiled arguments + temporaries,
and collective traffic per device per step (compiled, analytic, their ratio, and the ratio to DP).
"""

from __future__ import annotations

import argparse

import spmd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    spmd.emulate_devices(args.devices)

    import jax
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import data, models

    mesh = spmd.make_mesh({"data": args.devices})
    n = args.devices
    reports = {}
    for name in ("dp", "zero1", "zero2", "zero3"):
        plan = strategies.from_names(name)
        model = models.get(args.model, remat=plan.remat)
        params = jax.eval_shape(model.init, jax.random.key(0))
        step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=params)
        batch = data.batch(0, 0, args.batch_size, model.config.seq_len, model.config.vocab)
        reports[name] = spmd.report(step, batch)

    psi = sum(row.bytes for row in reports["dp"].params) / 4  # fp32 parameters
    paper = {"dp": 16 * psi, "zero1": 8 * psi + 8 * psi / n, "zero2": 4 * psi + 12 * psi / n, "zero3": 16 * psi / n}
    dp = reports["dp"]
    table = Table(title=f"{args.model}, data={n}, batch {args.batch_size}: per device, per step", title_justify="left")
    for col in (
        "stage",
        "state / formula",
        "state / dp",
        "args+temp / dp",
        "traffic compiled / analytic",
        "traffic / dp",
    ):
        table.add_column(col, justify="right")

    def used(r):
        return r.compiled_memory["argument_bytes"] + r.compiled_memory["temp_bytes"]

    for name, r in reports.items():
        c = r.comm_bytes_per_step
        table.add_row(
            name,
            f"{r.per_device_bytes['total'] / paper[name]:.3f}",
            f"{r.per_device_bytes['total'] / dp.per_device_bytes['total']:.3f}",
            f"{used(r) / used(dp):.3f}",
            f"{c['compiled'] / c['analytic']:.3f}",
            f"{c['compiled'] / dp.comm_bytes_per_step['compiled']:.3f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
