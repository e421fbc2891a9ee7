"""Remat policies against each other, per strategy: the compiled program's matmul work and memory, in one run.

    python benchmarks/remat.py [--model gpt-small] [--batch-size 32] [--layers N] [--policies none,full,dots,...]

For each strategy (dp and zero3 on data=8, dp+tp on data=4,tensor=2) and each remat policy it compiles one
training step and prints its compiled matmul FLOPs over the model's 6·N·T (the report's ``model_flops``: N the
weights that act as matmuls, T tokens per step), the same against the strategy's step under the first policy
listed (none by default), arguments + temporaries per device against dp's under it, and what the compiled program
places in host memory (``memory_analysis()``'s host arguments and temporaries: offload); last, the compiled
matmul FLOPs against the cost model's (``costmodel.flops_per_device``, which counts each policy's recompute).
"""

from __future__ import annotations

import argparse

import spmd

CASES = (("dp", "data=8"), ("zero3", "data=8"), ("dp+tp", "data=4,tensor=2"))
POLICIES = "none,full,dots,names:query_proj,key_proj,value_proj,out_proj,mlp_hidden,mlp_out,offload:mlp_hidden"


def _policies(text: str) -> list[str]:
    # "names:a,b,full" is ambiguous when split on commas: a bare word that is a kind starts a new policy.
    out: list[str] = []
    for word in text.split(","):
        if word in ("none", "full", "dots") or ":" in word or not out:
            out.append(word)
        else:
            out[-1] += "," + word
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--policies", default=POLICIES)
    args = parser.parse_args()
    spmd.emulate_devices(8)

    import dataclasses

    import jax
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import data, models

    overrides = {"layers": args.layers} if args.layers else {}
    model = models.get(args.model, **overrides)
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = data.batch(0, 0, args.batch_size, model.config.seq_len, model.config.vocab)
    title = f"{args.model}, batch {args.batch_size}, 8 devices: per step, compiled"
    table = Table(title=title, title_justify="left")
    columns = (
        "strategy", "mesh", "remat", "matmul FLOPs / 6NT", "FLOPs / no remat", "args+temp / dp's", "host",
        "FLOPs compiled / analytic",
    )  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("strategy", "mesh", "remat") else "right")
    baseline: dict[str, float] = {}
    for name, mesh_text in CASES:
        axes = spmd.parse_mesh(mesh_text)
        mesh = spmd.make_mesh(axes)
        for policy in _policies(args.policies):
            plan = dataclasses.replace(strategies.from_names(name, axes), remat=policy)
            step = spmd.TrainStep(
                models.loss_fn(models.rematerialised(model, plan.remat)), optax.adam(1e-3), plan, mesh, params=params
            )
            r = spmd.report(step, batch)
            stats = step.compile(batch).memory_analysis()
            flops = r.compiled_flops * mesh.size
            used = r.compiled_memory["argument_bytes"] + r.compiled_memory["temp_bytes"]
            host = stats.host_temp_size_in_bytes + stats.host_argument_size_in_bytes
            baseline.setdefault(name, flops)
            baseline.setdefault("memory", used)
            table.add_row(
                name,
                mesh_text,
                plan.remat.kind + (f":{','.join(plan.remat.names)}" if plan.remat.names else ""),
                f"{r.compiled_flops / r.model_flops:.3f}",
                f"{flops / baseline[name]:.3f}",
                f"{used / baseline['memory']:.3f}",
                spmd.format_bytes(host),
                f"{r.compiled_flops / r.flops_per_device:.3f}",
            )
    Console().print(table)


if __name__ == "__main__":
    main()
