"""Planning time: how long ``plan.resolve`` takes on parameter trees of growing size, and how it grows.

    python benchmarks/planning.py [--sizes 100,1000,10000] [--repeats 5] [--profile]

Builds synthetic abstract parameter trees (nested dicts of ``jax.ShapeDtypeStruct`` named like
``layer_{i}/attn/query/kernel``), resolves a composed plan (dp + fsdp + ten path rules + tensor_parallel) against
mesh sizes alone (no devices), and resolves an Adam optimizer state mirroring the largest tree (``params=``).
Prints the median time, the time per leaf, and each size's time over the previous one's against the ratio of
their leaf counts (linear growth: the two match). Goal: under 0.3 s at 10,000 leaves.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import time
import warnings

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
GOAL_S = 0.3
GOAL_LEAVES = 10_000

# Path rules for what tensor_parallel's defaults leave alone; they agree with them where both apply.
RULES = [
    (r"embed/embedding$", ("tensor", None)),  # vocab-parallel embedding
    (r"pos_embed/embedding$", (None, None)),
    (r"head/kernel$", (None, "tensor")),
    (r"attn/(query|key|value)/bias$", ("tensor",)),
    (r"attn/out/bias$", (None,)),
    (r"mlp/wi/bias$", ("tensor",)),
    (r"mlp/wo/bias$", (None,)),
    (r"ln[12]/scale$", (None,)),
    (r"ln[12]/bias$", (None,)),
    (r"final_norm/(scale|bias)$", (None,)),
]


def synthetic_params(n: int, d_model: int = 512, mlp: int = 2048, vocab: int = 8192, seq: int = 1024) -> dict:
    """An abstract transformer parameter tree of exactly ``n`` leaves: embeddings, then layers of 16 arrays each
    (query/key/value/out and wi/wo kernels and biases, two layer norms), then a final norm and head, cut at ``n``."""
    import jax
    import numpy as np

    f32 = np.float32
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, f32)
    layer = [
        ("attn/query/kernel", (d_model, d_model)),
        ("attn/query/bias", (d_model,)),
        ("attn/key/kernel", (d_model, d_model)),
        ("attn/key/bias", (d_model,)),
        ("attn/value/kernel", (d_model, d_model)),
        ("attn/value/bias", (d_model,)),
        ("attn/out/kernel", (d_model, d_model)),
        ("attn/out/bias", (d_model,)),
        ("mlp/wi/kernel", (d_model, mlp)),
        ("mlp/wi/bias", (mlp,)),
        ("mlp/wo/kernel", (mlp, d_model)),
        ("mlp/wo/bias", (d_model,)),
        ("ln1/scale", (d_model,)),
        ("ln1/bias", (d_model,)),
        ("ln2/scale", (d_model,)),
        ("ln2/bias", (d_model,)),
    ]
    head = [("embed/embedding", (vocab, d_model)), ("pos_embed/embedding", (seq, d_model))]
    tail = [("final_norm/scale", (d_model,)), ("final_norm/bias", (d_model,)), ("head/kernel", (d_model, vocab))]
    layers = max(0, -(-(n - len(head) - len(tail)) // len(layer)))
    flat = head + [(f"layer_{i}/{p}", s) for i in range(layers) for p, s in layer]
    flat = flat[: n - len(tail)] + tail if n > len(head) + len(tail) else (head + tail)[:n]
    tree: dict = {}
    for path, shape in flat:
        node = tree
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = sds(*shape)
    return {"params": tree}


def median_time(fn, repeats: int) -> tuple[float, float]:
    """The median wall time of ``fn()`` over ``repeats`` runs, and the median time spent in garbage collection."""
    totals, in_gc, start = [], [], [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            in_gc[-1] += time.perf_counter() - start[0]

    gc.callbacks.append(on_gc)
    try:
        for _ in range(repeats):
            in_gc.append(0.0)
            t0 = time.perf_counter()
            fn()
            totals.append(time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(on_gc)
    return statistics.median(totals), statistics.median(in_gc)


def profile(fn, top: int = 15) -> str:
    """cProfile of ``fn()`` by own time, with the garbage collector off (its time, shown in the table, would
    otherwise land on whichever function happened to allocate when a collection started)."""
    prof = cProfile.Profile()
    gc.disable()
    try:
        prof.runcall(fn)
    finally:
        gc.enable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,10000", help="leaf counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement (the median is shown)")
    parser.add_argument("--profile", action="store_true", help="always print a cProfile of the largest resolve")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if not sizes or sizes[0] < 1 or args.repeats < 1:
        parser.error("--sizes must be positive leaf counts and --repeats >= 1")

    import jax
    import optax
    from rich.console import Console
    from rich.table import Table

    import strategies
    from spmd import Plan

    console = Console()
    plan = strategies.data_parallel() + strategies.fsdp() + Plan.from_rules(RULES) + strategies.tensor_parallel()
    warnings.simplefilter("ignore")  # a small tree leaves some rules unmatched; that warning is not measured here

    table = Table(
        title=f"plan.resolve on data=2,fsdp=2,tensor=2 (no devices), dp + fsdp + {len(RULES)} rules + tp, "
        f"median of {args.repeats}",
        title_justify="left",
    )
    for col in ("tree", "leaves", "seconds", "of which GC", "µs / leaf", "time / previous", "leaves / previous"):
        table.add_column(col, justify="right")

    trees = {n: synthetic_params(n) for n in sizes}
    rows: list[tuple[str, int, float, float]] = []  # label, leaves, seconds, seconds in garbage collection
    for n, tree in trees.items():
        assert len(jax.tree.leaves(tree)) == n
        assert len(plan.resolve(tree, MESH).leaves) == n  # also a warm-up (regex cache, imports)
        rows.append(("params", n, *median_time(lambda tree=tree: plan.resolve(tree, MESH), args.repeats)))
    results = {n: seconds for _, n, seconds, _ in rows}

    largest = sizes[-1]
    params = trees[largest]
    opt_state = jax.eval_shape(optax.adam(1e-3).init, params)
    mirror = lambda: plan.resolve(opt_state, MESH, params=params)
    mirrored = mirror()
    moment = mirrored.specs[0].mu["params"]["embed"]["embedding"]
    assert moment == plan.specs(params, MESH)["params"]["embed"]["embedding"], "moments must mirror their parameter"
    rows.append(("adam state, params=", len(jax.tree.leaves(opt_state)), *median_time(mirror, args.repeats)))

    for k, (label, n, seconds, in_gc) in enumerate(rows):
        grow = more = ""
        if k:  # against the row above: linear growth when the two ratios match
            grow, more = f"{seconds / rows[k - 1][2]:.2f}", f"{n / rows[k - 1][1]:.2f}"
        table.add_row(label, f"{n:,}", f"{seconds:.4f}", f"{in_gc:.4f}", f"{seconds / n * 1e6:.1f}", grow, more)
    console.print(table)

    verdict = []
    at_goal = results.get(GOAL_LEAVES)
    if at_goal is not None:
        verdict.append(f"{GOAL_LEAVES:,} leaves: {at_goal:.3f} s (goal < {GOAL_S} s)")
    superlinear = False
    if len(sizes) > 1:
        a, b = sizes[-2], sizes[-1]
        ratio = results[b] / results[a]
        superlinear = ratio > 1.5 * b / a
        verdict.append(f"growth {b:,}/{a:,}: time x{ratio:.2f} for leaves x{b / a:.2f}")
    verdict.append(f"mirroring {rows[-1][1]:,} optimizer leaves: {rows[-1][2]:.3f} s")
    console.print("; ".join(verdict))
    if args.profile or superlinear or (at_goal is not None and at_goal > GOAL_S):
        console.print(f"cProfile of plan.resolve at {largest:,} leaves, GC off (by own time):")
        console.print(profile(lambda: plan.resolve(params, MESH)), markup=False, highlight=False)


if __name__ == "__main__":
    main()
