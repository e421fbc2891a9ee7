"""Toolkit overhead: spmd's training step against the same step written by hand with jax.jit, in one run.

    python benchmarks/overhead.py [--model gpt-tiny[,gpt-small]] [--steps 20] [--batch-size 32]

The hand-written step uses the same loss, optax.adam, the PartitionSpecs spmd chose (taken from ``step.layout``),
the same gradient constraint and the model's own activation constraints (the loss runs under ``spmd.activate``,
because those constraints belong to the model, not to the toolkit). Prints, per model, whether the two compiled
programs are the same once names and metadata are normalised away, and the ratio of their median step times,
measured interleaved (spmd, hand, spmd, hand, ...) so that drift cancels. Goal: spmd / hand-written <= 1.02.
"""

from __future__ import annotations

import argparse
import difflib
import re
import statistics
import time

import spmd

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
STRATEGY = "dp+fsdp+tp"
GOAL = 1.02

# A metadata attribute, possibly holding quoted strings with braces in them.
_METADATA = re.compile(r',?\s*metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_MODULE = re.compile(r"^HloModule\s+\S+?(,|$)", re.MULTILINE)
_SOURCE_TABLES = {"FileNames", "FunctionNames", "FileLocations", "StackFrames"}


def normalise_hlo(text: str) -> list[str]:
    """The compiled HLO's lines without what legitimately differs between two jits of one program: the module
    name, the source tables (FileNames, FunctionNames, FileLocations, StackFrames), op_name/source metadata,
    and blank lines."""
    text = _MODULE.sub(r"HloModule MODULE\1", text)
    text = _METADATA.sub("", text)
    lines, skipping = [], False
    for line in text.splitlines():
        if line.strip() in _SOURCE_TABLES:
            skipping = True
        elif not line.strip():
            skipping = False
        elif not skipping:
            lines.append(line.rstrip())
    return lines


def diff_summary(a: list[str], b: list[str], limit: int = 6) -> str:
    """'identical', or how many lines differ and the first few of them."""
    if a == b:
        return "identical"
    diff = [
        line
        for line in difflib.unified_diff(a, b, "spmd", "hand-written", n=0, lineterm="")
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    removed = sum(line.startswith("-") for line in diff)
    added = len(diff) - removed
    shown = "\n".join(f"    {line[:160]}" for line in diff[:limit])
    more = f"\n    ... ({len(diff) - limit} more)" if len(diff) > limit else ""
    return f"differs: {removed} lines only in spmd, {added} only in hand-written\n{shown}{more}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny", help="model name(s), comma-separated (e.g. gpt-tiny,gpt-small)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each (after warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each before timing")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    spmd.emulate_devices(8)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import data, models

    console = Console()
    mesh = spmd.make_mesh(MESH)
    plan = strategies.from_names(STRATEGY, MESH)
    is_spec = lambda x: isinstance(x, PartitionSpec)
    named = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)

    table = Table(
        title=f"spmd vs hand-written jax.jit: {STRATEGY} on data=2,fsdp=2,tensor=2, batch {args.batch_size}, "
        f"median of {args.steps} interleaved steps",
        title_justify="left",
    )
    for col in ("model", "HLO (normalised)", "spmd ms/step", "hand-written ms/step", "spmd / hand-written"):
        table.add_column(col, justify="right")
    diffs: dict[str, str] = {}

    for name in (n.strip() for n in args.model.split(",")):
        overrides = {} if args.layers is None else {"layers": args.layers}
        model = models.get(name, remat=plan.remat, **overrides)
        c = model.config
        loss_fn = models.loss_fn(model)
        batches = [data.batch(args.seed, i, args.batch_size, c.seq_len, c.vocab) for i in range(args.steps + 1)]

        # -- spmd ---------------------------------------------------------------------------------------------
        params = jax.eval_shape(model.init, jax.random.key(args.seed))
        step = spmd.TrainStep(loss_fn, optax.adam(1e-3), plan, mesh, params=params)
        state = step.init(model.init, jax.random.key(args.seed))
        spmd_hlo = step.compile(batches[0]).as_text()

        # -- by hand: the same specs, a plain jax.jit -----------------------------------------------------------
        optimizer = optax.adam(1e-3)
        param_sh = named(step.layout.params.specs)
        grad_sh = named(step.layout.grads.specs)
        state_sh = (NamedSharding(mesh, PartitionSpec()), param_sh, named(step.layout.opt_state.specs))
        batch_sh = {"tokens": NamedSharding(mesh, plan.batch_spec())}
        replicated = NamedSharding(mesh, PartitionSpec())

        def create(rng):
            params = models.unbox(model.init(rng))  # noqa: B023 (used within this iteration)
            return jnp.zeros((), jnp.int32), params, optimizer.init(params)  # noqa: B023

        def train_step_fn(state, batch):
            count, params, opt_state = state
            with spmd.activate(plan, mesh):  # the model's activation constraints
                loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # noqa: B023
            grads = jax.lax.with_sharding_constraint(grads, grad_sh)  # noqa: B023
            updates, opt_state = optimizer.update(grads, opt_state, params)  # noqa: B023
            return (count + 1, optax.apply_updates(params, updates), opt_state), loss

        hand_state = jax.jit(create, out_shardings=state_sh)(jax.random.key(args.seed))
        hand = jax.jit(train_step_fn, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                       donate_argnums=0)  # fmt: skip
        hand_hlo = hand.lower(hand_state, jax.device_put(batches[0], batch_sh)).compile().as_text()
        diffs[name] = diff_summary(normalise_hlo(spmd_hlo), normalise_hlo(hand_hlo))

        # -- step time, interleaved -------------------------------------------------------------------------
        def run_spmd(state, batch):
            t0 = time.perf_counter()
            state, loss = step(state, batch)  # noqa: B023 (step device_puts the batch itself)
            jax.block_until_ready((state, loss))
            return state, time.perf_counter() - t0

        def run_hand(state, batch):
            t0 = time.perf_counter()
            state, loss = hand(state, jax.device_put(batch, batch_sh))  # noqa: B023
            jax.block_until_ready((state, loss))
            return state, time.perf_counter() - t0

        runners = {"spmd": run_spmd, "hand": run_hand}
        states = {"spmd": state, "hand": hand_state}
        times: dict[str, list[float]] = {"spmd": [], "hand": []}
        for i in range(args.warmup):
            for k in runners:
                states[k], _ = runners[k](states[k], batches[i % len(batches)])
        for i in range(args.steps):
            # Interleaved A B B A A B ...: each takes the first slot of a pair equally often.
            for k in ("spmd", "hand") if i % 2 == 0 else ("hand", "spmd"):
                states[k], t = runners[k](states[k], batches[1 + i])
                times[k].append(t)
        ms_spmd, ms_hand = statistics.median(times["spmd"]) * 1e3, statistics.median(times["hand"]) * 1e3
        # Both started from the same parameters and saw the same batches: they should still agree.
        same = all(
            np.allclose(a, b, rtol=1e-4, atol=1e-5)
            for a, b in zip(jax.tree.leaves(states["spmd"].params), jax.tree.leaves(states["hand"][1]), strict=True)
        )
        table.add_row(
            name,
            diffs[name].splitlines()[0] + ("" if same else " (params diverged!)"),
            f"{ms_spmd:.2f}",
            f"{ms_hand:.2f}",
            f"{ms_spmd / ms_hand:.3f}",
        )

    console.print(table)
    console.print(f"goal: spmd / hand-written <= {GOAL}")
    for name, summary in diffs.items():
        if summary != "identical":
            console.print(f"{name} HLO {summary}", markup=False, highlight=False)


if __name__ == "__main__":
    main()
