"""Explicit against Auto mesh axes: the compiled training step of each strategy on both kinds of mesh.

    python benchmarks/explicit_axes.py [--model gpt-small] [--layers N] [--batch-size 32]
                                       [--cases fsdp:fsdp=8,dp+tp:data=2+tensor=4]

A mesh with Explicit axes (``jax.make_mesh``'s default) carries each array's layout in its type; spmd keeps the
step's inputs and outputs typed so and traces its inside over the same mesh with Auto axes. Prints, per case,
whether the two compiled programs are the same once names and metadata are normalised away, the collectives
each runs (count and bytes, read from the HLO) and each one's memory per device (``memory_analysis()``).
"""

from __future__ import annotations

import argparse
import re

from overhead import diff_summary, normalise_hlo

import spmd

CASES = "fsdp:fsdp=8,dp+tp:data=2+tensor=4"
_NAME = re.compile(r"%[\w.-]+")


def renamed(lines: list[str]) -> list[str]:
    """The lines with every ``%name`` replaced by its order of first appearance: two traces of one program
    number their instructions differently (the Auto-typed inside adds casts that are traced and dropped)."""
    names: dict[str, str] = {}
    rename = lambda m: names.setdefault(m.group(0), f"%v{len(names)}")  # noqa: E731
    return [_NAME.sub(rename, line) for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--cases", default=CASES, help="strategy:mesh pairs, the mesh's axes joined by '+'")
    args = parser.parse_args()
    spmd.emulate_devices(8)

    import jax
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import data, models

    table = Table(
        title=f"Auto vs Explicit mesh axes: {args.model}, batch {args.batch_size}, one compiled training step",
        title_justify="left",
    )
    for col in ("strategy", "mesh", "HLO (normalised)", "collectives auto", "collectives explicit", "peak auto",
                "peak explicit"):  # fmt: skip
        table.add_column(col, justify="right")
    diffs = {}
    for case in args.cases.split(","):
        name, mesh_text = case.split(":")
        axes = spmd.parse_mesh(mesh_text.replace("+", ","))
        plan = strategies.from_names(name, axes)
        model = models.get(args.model, remat=plan.remat, **({} if args.layers is None else {"layers": args.layers}))
        c = model.config
        batch = data.batch(0, 0, args.batch_size, c.seq_len, c.vocab)
        params = jax.eval_shape(model.init, jax.random.key(0))
        row = {}
        for kind in ("auto", "explicit"):
            mesh = spmd.make_mesh(axes, explicit=kind == "explicit")
            step = spmd.TrainStep(models.loss_fn(model), optax.adam(1e-3), plan, mesh, params=params)
            report = spmd.report(step, batch)  # the collectives read from the compiled HLO, its memory_analysis()
            found, peak = report.collectives, report.compiled_memory.get("peak_bytes", 0)
            row[kind] = (
                renamed(normalise_hlo(step.compile(batch).as_text())),
                f"{sum(x.count for x in found)} / {sum(x.bytes for x in found) / 2**20:.2f} MiB",
                f"{peak / 2**20:.2f} MiB",
            )
        diffs[case] = diff_summary(row["auto"][0], row["explicit"][0])
        same = "identical" if diffs[case] == "identical" else "differs (below)"
        table.add_row(name, mesh_text.replace("+", ","), same, row["auto"][1], row["explicit"][1], row["auto"][2],
                      row["explicit"][2])  # fmt: skip
    Console().print(table)
    for case, diff in diffs.items():
        if diff != "identical":
            print(f"{case}: {diff}")


if __name__ == "__main__":
    main()
