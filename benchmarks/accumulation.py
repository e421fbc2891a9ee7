"""Gradient accumulation: compiled temporaries and collectives for K microbatches per step, against K = 1.

    python benchmarks/accumulation.py [--model gpt-small] [--layers N] [--mesh data=8] [--strategy dp]
                                      [--batch-size 64] [--accumulate 1,2,4,8]

Compiles one training step per K (nothing runs) and prints, per K, the compiled temporaries
(``memory_analysis().temp_size_in_bytes``) and their ratio to K = 1, the analytic temporaries, and the
collectives the compiled program executes per step (loops weighted by trip count): all-reduce, reduce-scatter
and all-gather, each as ops run and bytes moved, with the bytes' ratio to K = 1. The batch is 64 by default: each
microbatch must split over the batch axes, so at data=8 the largest K, 8, needs 64 rows.
"""

from __future__ import annotations

import argparse
import math

import spmd

KINDS = ("all-reduce", "reduce-scatter", "all-gather")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--layers", type=int, help="override the model's number of layers")
    parser.add_argument("--mesh", default="data=8")
    parser.add_argument("--strategy", default="dp")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--accumulate", default="1,2,4,8", help="comma-separated K values; the first is the baseline")
    args = parser.parse_args()
    sizes = spmd.parse_mesh(args.mesh)
    spmd.emulate_devices(math.prod(sizes.values()))

    import jax
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import data, models

    mesh = spmd.make_mesh(sizes)
    model = models.get(args.model, **({"layers": args.layers} if args.layers else {}))
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = data.batch(0, 0, args.batch_size, model.config.seq_len, model.config.vocab)
    rows = {}
    for k in (int(x) for x in args.accumulate.split(",")):
        plan = strategies.from_names(args.strategy, dict(mesh.shape))
        plan = plan.with_accumulation(k) if k > 1 else plan
        step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=params)
        temp = step.compile(batch).memory_analysis().temp_size_in_bytes
        report = spmd.report(step, batch)
        moved = {kind: [0, 0] for kind in KINDS}
        for c in report.collectives:
            if c.kind in moved:
                moved[c.kind][0] += c.count
                moved[c.kind][1] += c.bytes
        rows[k] = (temp, report.analytic_memory.get("temp_bytes", 0), moved)

    title = f"{args.model}, {args.mesh}, {args.strategy}, batch {args.batch_size}: per device, per step"
    table = Table(title=title, title_justify="left")
    for col in ("K", "temp compiled", "temp / K=1", "temp analytic", *(f"{k} ops / bytes" for k in KINDS)):
        table.add_column(col, justify="right")
    base_temp, _, base_moved = next(iter(rows.values()))
    for k, (temp, analytic, moved) in rows.items():
        cells = []
        for kind in KINDS:
            ops, size = moved[kind]
            ratio = f" ({size / base_moved[kind][1]:.2f}×)" if base_moved[kind][1] else ""
            cells.append(f"{ops} / {spmd.format_bytes(size)}{ratio}")
        table.add_row(
            str(k),
            spmd.format_bytes(temp),
            f"{temp / base_temp:.3f}",
            spmd.format_bytes(analytic),
            *cells,
        )
    Console().print(table)


if __name__ == "__main__":
    main()
