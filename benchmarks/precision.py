"""Mixed precision on the ZeRO family: model state against ZeRO's mixed-precision table, and what bf16 saves in
the compiled program (gathered bytes, traffic, memory), fp32 and bf16 side by side in one run.

    python benchmarks/precision.py [--model gpt-small] [--devices 8] [--batch-size 32]

Two bf16 arrangements are priced: ``bf16`` (this step's policy: fp32 master stored where the model reads it, a
bf16 copy cast each step) and ``bf16 zero`` (ZeRO's: bf16 parameters stored, the fp32 master inside the optimizer
state, ``spmd.master_weights``). Model state is the cost model's (every array split: ``min_bytes=0``), compared
with the paper's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N; the compiled figures are the program's own (bf16
collectives counted at bf16, as accelerators send them).
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

    import math

    import jax
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import costmodel, data, models

    n = args.devices
    mesh = spmd.make_mesh({"data": n})
    stages = {
        "dp": strategies.data_parallel,
        "zero1": lambda: strategies.zero1(min_bytes=0),
        "zero2": lambda: strategies.zero2(min_bytes=0),
        "zero3": lambda: strategies.zero3(min_bytes=0),
    }
    policies = {
        "fp32": (None, "float32", optax.adam(1e-3)),
        "bf16": (strategies.mixed_precision(), "bfloat16", optax.adam(1e-3)),
        "bf16 zero": (strategies.mixed_precision(params="bfloat16"), "bfloat16", spmd.master_weights(optax.adam(1e-3))),
    }

    def step_of(stage, policy):
        extra, dtype, optimizer = policies[policy]
        plan = stages[stage]() + (extra or spmd.Plan())
        model = models.get(args.model, remat=plan.remat, dtype=dtype)
        params = jax.eval_shape(model.init, jax.random.key(0))
        return spmd.TrainStep(models.loss_fn(model), optimizer, plan, mesh, params=params), model, plan

    psi = None
    state = {}
    for stage in stages:
        for policy in policies:
            step, model, plan = step_of(stage, policy)
            psi = psi or sum(math.prod(x.shape) for x in jax.tree.leaves(step.params_of(step.abstract_state())))
            state[stage, policy] = costmodel.model_state_bytes(step.layout, plan.precision)["total"]
    paper = {"dp": 16 * psi, "zero1": 4 * psi + 12 * psi / n, "zero2": 2 * psi + 14 * psi / n, "zero3": 16 * psi / n}

    compiled = {}
    for stage in stages:
        for policy in ("fp32", "bf16"):
            step, model, _ = step_of(stage, policy)
            batch = data.batch(0, 0, args.batch_size, model.config.seq_len, model.config.vocab)
            compiled[stage, policy] = spmd.report(step, batch)

    title = f"{args.model} (Ψ = {psi / 1e6:.1f}M), data={n}, batch {args.batch_size}, Adam: per device"
    table = Table(title=title, title_justify="left")
    columns = ("stage", "paper (bf16)", "fp32 / fp32 table", "bf16 / paper", "bf16 zero / paper", "gathered bf16/fp32")
    for col in (*columns, "traffic bf16/fp32", "args+temp bf16/fp32"):
        table.add_column(col, justify="right")

    def gathered(r):
        return sum(c.bytes for c in r.collectives if c.kind == "all-gather")

    def used(r):
        return r.compiled_memory["argument_bytes"] + r.compiled_memory["temp_bytes"]

    for stage in stages:
        fp32_formula = {"dp": 16 * psi, "zero1": 8 * psi + 8 * psi / n, "zero2": 4 * psi + 12 * psi / n}
        a, b = compiled[stage, "fp32"], compiled[stage, "bf16"]
        ratio = gathered(b) / gathered(a) if gathered(a) else float("nan")
        table.add_row(
            stage,
            f"{paper[stage] / 2**20:.1f} MiB",
            f"{(state[stage, 'fp32'] - 4) / fp32_formula.get(stage, 16 * psi / n):.3f}",
            f"{(state[stage, 'bf16'] - 4) / paper[stage]:.3f}",
            f"{(state[stage, 'bf16 zero'] - 4) / paper[stage]:.3f}",
            f"{ratio:.3f}",
            f"{b.comm_bytes_per_step['compiled'] / a.comm_bytes_per_step['compiled']:.3f}",
            f"{used(b) / used(a):.3f}",
        )
    Console().print(table)
    print("Adam's int32 step count (4 bytes) is left out of the model state. 'fp32 / fp32 table': fp32 state")
    print("against the fp32 table (16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N).")


if __name__ == "__main__":
    main()
