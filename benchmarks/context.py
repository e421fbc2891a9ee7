"""Context parallelism against one device: memory, traffic and causal work per device, per method and axis size.

    python benchmarks/context.py [--model gpt-tiny] [--seq-len 2048] [--batch-size 1] [--sizes 1,2,4,8]

For each context axis size c and each method (allgather, ring, alltoall) it compiles one training step of the
model on a batch of ``--batch-size`` sequences of ``--seq-len`` tokens over ``context=c`` (c = 1: one device)
and prints: the compiled temporaries per device (``memory_analysis()``) and their share of one device's; the
traffic over the context axis read from the compiled program and the cost model's, with their ratio; the
compiled matmul FLOPs per device (the busiest device's: the block switch weighted by its table) over the cost
model's; and the causal work per device, in half-chunk blocks computed, as max/min and max/mean over the
devices, with head-tail load balancing and without. Ulysses (``alltoall``) needs the heads to split over the
axis; a size they do not divide gets a row saying so.
"""

from __future__ import annotations

import argparse

import spmd

METHODS = ("allgather", "ring", "alltoall")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--sizes", default="1,2,4,8")
    args = parser.parse_args()
    spmd.emulate_devices(8)

    import jax
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import data, models

    overrides = {"seq_len": args.seq_len} | ({"layers": args.layers} if args.layers else {})
    model = models.get(args.model, **overrides)
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = data.batch(0, 0, args.batch_size, args.seq_len, model.config.vocab)
    title = f"{args.model}, {args.seq_len} tokens, batch {args.batch_size}: per device, one training step, compiled"
    table = Table(title=title, title_justify="left")
    columns = (
        "c", "method", "temp", "temp / c=1", "traffic over context", "analytic", "compiled / analytic",
        "FLOPs compiled / analytic", "blocks max/min", "max/mean", "in order: max/min", "max/mean",
    )  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("c", "method") else "right")
    one = None
    for c in (int(x) for x in args.sizes.split(",")):
        for method in METHODS if c > 1 else ("-",):
            if method == "alltoall" and model.config.heads % c:  # Ulysses splits the heads over the axis
                table.add_row(str(c), method, f"- ({model.config.heads} heads do not split {c} ways)")
                continue
            plan = strategies.context_parallel(method=method) if c > 1 else spmd.Plan()
            mesh = spmd.make_mesh({"context": c}, devices=jax.devices()[:c])
            step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=params)
            r = spmd.report(step, batch)
            temp = r.compiled_memory["temp_bytes"]
            one = one or temp
            compiled = sum(t.traffic_bytes for t in r.collectives if t.axes == ("context",))
            analytic = sum(t.traffic_bytes for t in r.analytic_collectives if t.axes == ("context",))
            balance = ["-"] * 4
            if c > 1:
                balance = []
                for balanced in (True, False):
                    blocks = strategies.context_parallel(method=method, load_balance=balanced).context
                    work = blocks.blocks_per_device(c)
                    balance += [f"{max(work) / min(work):.3f}", f"{max(work) * len(work) / sum(work):.3f}"]
            table.add_row(
                str(c), method, spmd.format_bytes(temp), f"{temp / one:.3f}", spmd.format_bytes(compiled),
                spmd.format_bytes(analytic), f"{compiled / analytic:.3f}" if analytic else "-",
                f"{r.compiled_flops / r.flops_per_device:.3f}", *balance,
            )  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
