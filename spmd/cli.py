"""The ``spmd`` command: plan, run and demo a partitioning plan on a built-in or user model.

User mistakes exit with status 2 and one line on stderr; set SPMD_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn

from spmd._profile import parse_bytes

DEMO = {"model": "gpt-tiny", "mesh": "data=2,fsdp=2,tensor=2", "strategy": "dp+fsdp+tp", "steps": 20}
HARDWARE_KINDS = ("tpu-v5e", "tpu-v5p", "h100", "h200", "a100", "cpu")  # spmd.costmodel.HARDWARE's keys


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    top = _Parser(prog="spmd", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p: argparse.ArgumentParser, *, demo: bool = False) -> None:
        p.add_argument("--devices", type=int, help="emulate N CPU devices (default: the accelerators, else 8 CPUs)")
        p.add_argument(
            "--distributed",
            action="store_true",
            help="join a multi-process job from the cluster's environment (automatic under srun, mpirun, TPU pods)",
        )
        p.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and of the data")
        p.add_argument("--batch-size", type=int, default=32, help="global batch size (sequences)")
        p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (eps 1e-6)")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
        if demo:
            return
        p.add_argument("--model", default="gpt-tiny", help="built-in name, or package.module:factory")
        p.add_argument("--mesh", default="data=-1", help="axis=size pairs, e.g. data=2,fsdp=2,tensor=2")
        p.add_argument("--dcn", help="how many processes/slices each axis spans, e.g. data=2 (the rest is within one)")
        p.add_argument("--strategy", default="dp", help="registry names joined by '+', e.g. dp+fsdp+tp")
        p.add_argument("--layers", type=int, help="override the model's number of layers")
        p.add_argument("--block", type=int, help="align FSDP shards to whole blocks of this many rows (veScale)")
        p.add_argument(
            "--device-kind", help=f"cost model device: {', '.join(HARDWARE_KINDS)} (default: the devices present)"
        )
        p.add_argument(
            "--axis-bandwidth", help="per-axis link bandwidth in GB/s per device, e.g. tensor=450,tensor2=50"
        )
        p.add_argument("--memory-per-device", help="memory budget per device, e.g. 16GiB (osdp, suggest)")
        pipeline_flags(p)
        p.add_argument("--coverage", type=float, default=0.5, help="sdp: share of the model each worker owns (1/P)")
        p.add_argument("--granularity", default="block", help="sdp: block (whole layers) or neuron (units, heads)")
        p.add_argument("--masking", default="forward", help="sdp: forward (run only the subnetwork) or backward")
        from spmd import _cli_hetero

        _cli_hetero.add_flags(p)

    def pipeline_flags(p: argparse.ArgumentParser, *, table: bool = False) -> None:
        schedules = "gpipe, 1f1b, interleaved, bfs, zb-h1, zb-h2"
        p.add_argument("--schedule", default="1f1b", help=f"pipeline schedule: {schedules}, or a .json/.csv table")
        p.add_argument("--microbatches", type=int, help="microbatches per step (pp; default twice the stages)")
        p.add_argument("--virtual", type=int, default=1, help="chunks per device (interleaved, bfs)")
        if table:
            return
        p.add_argument("--layers-per-stage", help="layers of each global stage, e.g. 3,3,1,1 (default even)")

    plan = sub.add_parser("plan", help="show how a plan lays out a model, and what the compiler makes of it")
    common(plan)
    run = sub.add_parser("run", help="train with a plan (and --check it against one device)")
    common(run)
    run.add_argument("--steps", type=int, default=10, help="training steps")
    run.add_argument("--check", action="store_true", help="also train on one device and compare")
    run.add_argument("--checkpoint-dir", help="save the training state here (orbax; async, atomic)")
    run.add_argument("--checkpoint-every", type=int, help="save every K steps (default: at the end)")
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, on this mesh/plan")
    compare = sub.add_parser("compare", help="several strategies side by side: memory, traffic, step time")
    common(compare)
    compare.add_argument("--strategies", default="dp,zero1,zero2,zero3", help="comma-separated --strategy values")
    compare.add_argument("--timed-steps", type=int, default=3, help="steps timed per strategy (median reported)")
    compare.add_argument("--plot", help="write a bar chart of memory and traffic to this PNG file")
    suggest = sub.add_parser("suggest", help="rank meshes and strategies by the cost model; confirm by compiling")
    common(suggest)
    suggest.add_argument("--confirm", type=int, default=3, help="compile this many of the best plans that fit")
    suggest.add_argument("--max-tensor", type=int, default=8, help="largest tensor-parallel axis to try")
    suggest.add_argument("--top", type=int, default=15, help="rows of the ranked table to print")
    launch = sub.add_parser("launch", help="run a command as several JAX processes on this host (jax.distributed)")
    launch.add_argument("--processes", type=int, default=2, help="processes to start")
    launch.add_argument("--devices-per-process", type=int, default=4, help="CPU devices each process has")
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- spmd run ...")
    schedule = sub.add_parser("schedule", help="simulate a pipeline schedule: Gantt chart, bubble, memory")
    pipeline_flags(schedule, table=True)
    schedule.add_argument("--stages", type=int, default=4, help="pipeline devices (p)")
    schedule.add_argument("--costs", help="op times F,B,W[,comm] of a whole stage (default 1,1,1,0)")
    schedule.add_argument("--json", action="store_true", help="print one JSON object instead of the chart")
    schedule.add_argument("--plot", help="write a Gantt chart PNG to this file")
    profile = sub.add_parser("profile", help="measure the present devices: matmul speed, all-reduce bandwidth")
    profile.add_argument("--devices", type=int, help="emulate N CPU devices (default: the accelerators)")
    profile.add_argument("--size", type=int, default=1024, help="matmul size")
    profile.add_argument("--out", help="also write the profile to this JSON file (for --device-profile)")
    demo = sub.add_parser("demo", help="the main job: gpt-tiny on data=2 × fsdp=2 × tensor=2, checked")
    common(demo, demo=True)
    demo.add_argument("--steps", type=int, default=DEMO["steps"])
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spmd`` command."""
    try:
        args = _parser().parse_args(argv)
        _check_args(args)
        if args.command == "schedule":  # a simulation: no devices
            from spmd import _cli_schedule

            return _cli_schedule.schedule(args)
        if args.command == "launch":
            from spmd import _launch

            command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            return _launch.launch(command, processes=args.processes, devices_per_process=args.devices_per_process)
        if _start_devices(args) > 0:
            # Only the first process speaks: the others run the same program with their standard output (the
            # libraries' too) sent nowhere; errors still show.
            sys.stdout.flush()
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        elif _multi_process():
            # The first process's standard output carries only the results: what libraries write to the
            # descriptor themselves (gloo announces each connection) goes to standard error.
            sys.stdout.flush()
            sys.stdout = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
            os.dup2(sys.stderr.fileno(), 1)
        return _command(args)
    except Exception as e:  # noqa: BLE001 - every user mistake becomes one line; SPMD_DEBUG shows the rest
        if os.environ.get("SPMD_DEBUG") or not _is_user_error(e):
            raise
        message = " ".join(str(e).split())
        print(f"spmd: error: {message}", file=sys.stderr)
        return 2


def _command(args: argparse.Namespace) -> int:
    """Runs a command that needs the devices (started by then)."""
    if args.command == "profile":
        from spmd import _cli_hetero

        return _cli_hetero.profile_command(args)
    if args.command in ("compare", "suggest"):
        from spmd import _cli_compare

        return getattr(_cli_compare, args.command)(args)
    return {"plan": _plan, "run": _run, "demo": _demo}[args.command](args)


def _is_user_error(e: Exception) -> bool:
    from spmd._plan import PlanError

    return isinstance(e, (UsageError, PlanError, ValueError, RuntimeError, ImportError))


def _check_args(args: argparse.Namespace) -> None:
    positive = (
        "steps",
        "batch_size",
        "devices",
        "layers",
        "timed_steps",
        "block",
        "confirm",
        "max_tensor",
        "top",
        "size",
        "microbatch",
        "processes",
        "devices_per_process",
        "checkpoint_every",
    )
    for name in (*positive, "microbatches", "virtual", "stages"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if getattr(args, "layers_per_stage", None) is not None:
        try:
            args.layers_per_stage = tuple(int(x) for x in args.layers_per_stage.split(","))
        except ValueError:
            raise UsageError(
                f"--layers-per-stage {args.layers_per_stage!r}: give one count per global stage, e.g. 3,3,1,1"
            ) from None
    if args.command in ("schedule", "profile", "launch"):
        return
    if getattr(args, "resume", False) and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir: the directory to resume from")
    if getattr(args, "resume", False) and args.check:
        raise UsageError("--check compares a run from its first step with one device; it cannot follow --resume")
    if args.lr <= 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    if getattr(args, "memory_per_device", None) is not None:
        args.memory_per_device = parse_bytes(args.memory_per_device, "--memory-per-device")
    elif args.command == "suggest":
        raise UsageError("suggest needs --memory-per-device (e.g. 16GiB): the budget each plan must fit")
    if getattr(args, "axis_bandwidth", None) is not None:
        args.axis_bandwidth = _parse_bandwidth(args.axis_bandwidth)


def _parse_bandwidth(text: str) -> dict[str, float]:
    out = {}
    for item in text.split(","):
        axis, _, value = item.partition("=")
        try:
            gbps = float(value)
        except ValueError:
            gbps = -1.0
        if not axis.strip() or gbps <= 0:
            raise UsageError(f"--axis-bandwidth {text!r}: give axis=GB/s pairs, e.g. tensor=450,tensor2=50")
        out[axis.strip()] = gbps * 1e9
    return out


def _start_devices(args: argparse.Namespace) -> int:
    """Starts JAX's devices: this process's share of a multi-process job (under ``spmd launch``, or with
    ``--distributed`` on a cluster), else ``--devices`` emulated CPU devices or the accelerators. Returns this
    process's index."""
    import jax

    import spmd
    from spmd import _launch

    devices = getattr(args, "devices", None)
    started = spmd._devices.backend_started()
    if not started and _launch.initialize(cluster=getattr(args, "distributed", False)):
        if devices is not None:
            raise UsageError("--devices: in a multi-process run each process has the devices its launcher gives it")
        return jax.process_index()
    if devices is not None:
        if not started:
            jax.config.update("jax_platforms", "cpu")  # an explicit count means emulated CPU devices
        spmd.emulate_devices(devices)
    elif not started:
        spmd.emulate_devices(8)  # only the CPU platform listens; accelerators are used as they are
    return jax.process_index()


def _multi_process() -> bool:
    import jax

    return jax.process_count() > 1


# ------------------------------------------------------------------------------------------------- pieces
def _setup(
    args: argparse.Namespace,
    *,
    model_name: str | None = None,
    mesh_text: str | None = None,
    strategy: str | None = None,
) -> tuple:
    """(model, mesh, plan, device profile or None) from the command line; strategies the cost model chooses get
    their context here, and a device profile makes the plan uneven (see spmd._cli_hetero)."""
    import jax

    import spmd
    import strategies
    from spmd import models

    axes = spmd.parse_mesh(mesh_text or args.mesh)
    dcn = spmd.parse_mesh(args.dcn) if getattr(args, "dcn", None) else None
    mesh = spmd.make_mesh(axes, dcn=dcn)
    strategy = strategy or args.strategy
    names = set(strategy.split("+"))
    overrides = {"layers": args.layers} if getattr(args, "layers", None) else {}
    model_name = model_name or args.model
    model = models.get(model_name, **overrides)
    context = None
    if names & set(strategies.CHOSEN):
        params = jax.eval_shape(model.init, jax.random.key(args.seed))
        context = strategies.Context(
            params, _workload(model, args), _hardware(args), _optimizer(args), getattr(args, "memory_per_device", None)
        )
    options = (
        strategies.PipelineOptions(_schedule_arg(args.schedule), args.microbatches, args.virtual, args.layers_per_stage)
        if hasattr(args, "schedule")
        else None
    )
    subnet = (
        strategies.SubnetOptions(args.coverage, args.granularity, args.masking, args.seed)
        if hasattr(args, "coverage")
        else None
    )
    plan = strategies.from_names(
        strategy, dict(mesh.shape), context=context, pipeline_options=options, subnet_options=subnet
    )
    if plan.pipeline and model.staged is None:
        raise UsageError(
            f"model {model.name!r} cannot be pipelined: pp needs the model cut into stages (models.Model.staged; "
            f"the built-in GPTs gpt-tiny, gpt-small and their -nnx twins have one)"
        )
    from spmd import _cli_hetero

    profile = _cli_hetero.profile_from_args(args, mesh.size)
    if profile is not None:
        mesh, plan, profile = _cli_hetero.apply(args, model, mesh, plan, profile)
    if getattr(args, "block", None):
        plan = plan.with_block(args.block)
    if plan.remat and model_name in models.BUILTIN:  # user factories need not know the option
        model = models.get(model_name, **overrides, remat=True)
    return model, mesh, plan, profile


def _schedule_arg(value: str) -> Any:
    """A schedule name, or a table loaded from a .json/.csv file."""
    if value.endswith((".json", ".csv")):
        from spmd._schedule import Schedule

        if not os.path.exists(value):
            raise UsageError(f"--schedule {value!r}: no such file")
        return Schedule.load(value)
    return value


def _workload(model: Any, args: argparse.Namespace) -> Any:
    from spmd import costmodel

    return costmodel.Workload(batch=args.batch_size, seq_len=model.config.seq_len)


def _hardware(args: argparse.Namespace, profile: Any = None, axes: Any = ()) -> Any:
    """The cost model's device: --device-kind, else the kind of the devices present; the link bandwidths a device
    profile declares for the mesh ``axes`` on top, and --axis-bandwidth over those."""
    import jax

    from spmd import costmodel

    kind = getattr(args, "device_kind", None)
    if kind:
        hw = costmodel.hardware(kind)
    else:
        device = jax.devices()[0]
        hw = costmodel.detect(device.device_kind, device.platform)
    bandwidth = (profile.link_bandwidth(list(axes)) if profile is not None else {}) | dict(
        getattr(args, "axis_bandwidth", None) or {}
    )
    return hw.with_axis_bandwidth(bandwidth) if bandwidth else hw


def _optimizer(args: argparse.Namespace) -> Any:
    import optax

    # eps=1e-6 rather than 1e-8: with 1e-8, Adam turns reduction-order noise in near-zero gradients into
    # parameter differences near 1e-4 after 20 steps, and --check could no longer tell noise from a bug.
    return optax.adam(args.lr, eps=1e-6)


def _trainer(model: Any, plan: Any, mesh: Any, args: argparse.Namespace) -> Any:
    import spmd
    from spmd import models

    staged = model.staged if plan.pipeline else None
    narrow = None
    if plan.subnet is not None and plan.subnet.masking == "forward":
        models.narrowed(model, {})  # says which models cannot be narrowed, before anything is compiled
        narrow = lambda kept: models.loss_fn(models.narrowed(model, kept))  # noqa: E731
    return spmd.train_step(models.loss_fn(model), _optimizer(args), plan, mesh, staged=staged, narrow=narrow)


def _batch(model: Any, seed: int, step: int, batch_size: int) -> dict[str, Any]:
    from spmd import data

    return data.batch(seed, step, batch_size, model.config.seq_len, model.config.vocab)


def _train(
    model: Any, plan: Any, mesh: Any, args: argparse.Namespace, *, label: str, quiet: bool, before: Any = None
) -> tuple:
    """Trains up to step ``args.steps`` (from a checkpoint with ``--resume``, saving with ``--checkpoint-dir``);
    returns (the losses of the steps run, final params on the host, the step object).

    ``before(step)`` runs after the step is compiled and before training (the demo prints its report there).
    """
    import jax
    from rich.progress import Progress

    step = _trainer(model, plan, mesh, args)
    checkpoints = _checkpoints(args)
    start = 0
    if getattr(args, "resume", False):
        step.prepare(jax.eval_shape(model.init, jax.random.key(args.seed)))
        # Checkpoints hold the model's own layout, so any plan can resume from any other's.
        start, state, _ = checkpoints.restore(step.model_layout_abstract())
        state = step.from_model_layout(state)
        if start >= args.steps:
            raise UsageError(f"--resume: the checkpoint is at step {start}; --steps {args.steps} asks for none more")
    else:
        state = step.init(model.init, jax.random.key(args.seed))
    step.compile(_batch(model, args.seed, 0, args.batch_size))
    if before is not None:
        before(step)
    every = getattr(args, "checkpoint_every", None) or args.steps
    record = {"model": model.name, "plan": plan.describe(), "mesh": dict(mesh.shape)}
    losses = []
    with Progress(transient=True, disable=quiet, console=_console(stderr=True)) as bar:
        task = bar.add_task(label, total=args.steps - start)
        for i in range(start, args.steps):
            state, loss = step(state, _batch(model, args.seed, i, args.batch_size))
            losses.append(float(loss))
            bar.update(task, advance=1, description=f"{label} loss {losses[-1]:.3f}")
            if checkpoints is not None and ((i + 1) % every == 0 or i + 1 == args.steps):
                checkpoints.save(i + 1, step.to_model_layout(state), record)
    if checkpoints is not None:
        checkpoints.close()
    return losses, _on_host(step.params_of(state)), step


def _checkpoints(args: argparse.Namespace) -> Any:
    directory = getattr(args, "checkpoint_dir", None)
    if directory is None:
        return None
    from spmd._checkpoint import Checkpoints

    if getattr(args, "resume", False) and not os.path.isdir(directory):
        raise UsageError(f"--resume: checkpoint directory {directory!r} does not exist")
    return Checkpoints(directory)


def _on_host(tree: Any) -> Any:
    """Full numpy arrays of a tree; arrays spread over several processes are gathered (all of them must call)."""
    import jax
    import numpy as np

    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def _reference(model: Any, args: argparse.Namespace, quiet: bool) -> tuple:
    """The same training on a single device (of this process), from the same initial parameters and data."""
    import jax

    import spmd

    one = spmd.make_mesh({"data": 1}, devices=jax.local_devices()[:1])
    return _train(model, spmd.Plan(), one, args, label="one device", quiet=quiet)


def _max_abs_diff(losses: list[float], ref: list[float], params: Any, ref_params: Any) -> float:
    import jax
    import numpy as np

    diffs = [abs(a - b) for a, b in zip(losses, ref, strict=True)]
    diffs += [
        float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
    ]
    return max(diffs)


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal rich assumes 80 columns, too narrow for parameter paths; COLUMNS still wins.
    width = None if stream.isatty() or "COLUMNS" in os.environ else 120
    return Console(stderr=stderr, width=width)


# ------------------------------------------------------------------------------------------------- commands
def _plan(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    import spmd
    from spmd import _cli_hetero

    model, mesh, plan, profile = _setup(args)
    step = _trainer(model, plan, mesh, args)
    step.prepare(jax.eval_shape(model.init, jax.random.key(args.seed)))
    batch = {"tokens": jax.ShapeDtypeStruct((args.batch_size, model.config.seq_len), jnp.int32)}
    rep = spmd.report(step, batch, hardware=_hardware(args, profile, mesh.axis_names))
    hetero = _cli_hetero.summary(args, step, rep, profile) if profile is not None else {}
    if args.json:
        print(json.dumps({"model": model.name, **rep.to_dict(), **hetero}))
    else:
        _console().print(rep)
        if hetero:
            _console().print(_cli_hetero.text(hetero))
    return 0


def _run(args: argparse.Namespace) -> int:
    import jax

    from spmd import costmodel

    model, mesh, plan, profile = _setup(args)
    losses, params, step = _train(model, plan, mesh, args, label=args.strategy, quiet=args.json)
    out: dict[str, Any] = {
        "model": model.name,
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "strategy": args.strategy,
        "plan": plan.describe(),
        "losses": losses,
        "per_device_bytes": costmodel.model_state_bytes(step.layout),
    }
    if plan.uneven is not None:
        out["batch_shares"] = list(plan.uneven.shares)
    if plan.pipeline is not None:
        out["layers_per_stage"] = list(plan.pipeline.layers_per_stage or ())
    if args.checkpoint_dir:
        out["checkpoint_step"] = args.steps
    if args.check and jax.process_index() == 0:  # one device of the first process is the reference
        ref, ref_params, _ = _reference(model, args, quiet=args.json)
        out["reference_losses"] = ref
        out["max_abs_diff"] = _max_abs_diff(losses, ref, params, ref_params)
    if args.json:
        print(json.dumps(out))
    else:
        console = _console()
        console.print(f"losses: {' '.join(f'{x:.4f}' for x in losses)}")
        if "max_abs_diff" in out:
            console.print(f"one device: {' '.join(f'{x:.4f}' for x in out['reference_losses'])}")
            console.print(f"max |difference| over losses and parameters: {out['max_abs_diff']:.2e}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    import jax

    import spmd
    from spmd import data

    model, mesh, plan, _ = _setup(args, model_name=DEMO["model"], mesh_text=DEMO["mesh"], strategy=DEMO["strategy"])
    console = _console()
    platform = jax.devices()[0].platform
    console.rule(f"spmd demo: {model.name} on {mesh.size} {platform} devices, strategy {DEMO['strategy']}")
    reports = []

    def show(step: Any) -> None:
        reports.append(spmd.report(step, _batch(model, args.seed, 0, args.batch_size), hardware=_hardware(args)))
        if not args.json:
            console.print(reports[0])

    losses, params, _ = _train(model, plan, mesh, args, label=DEMO["strategy"], quiet=args.json, before=show)
    rep = reports[0]
    ref, ref_params, _ = _reference(model, args, quiet=args.json)
    diff = _max_abs_diff(losses, ref, params, ref_params)
    best = data.entropy_rate(args.seed, model.config.vocab)
    if args.json:
        print(json.dumps({**rep.to_dict(), "losses": losses, "reference_losses": ref, "max_abs_diff": diff}))
        return 0 if diff <= 1e-4 else 1
    console.rule("summary")
    console.print(_summary(rep, losses, diff, best))
    return 0 if diff <= 1e-4 else 1


def _summary(rep: Any, losses: list[float], diff: float, best: float) -> Any:
    from rich.table import Table

    from spmd import format_bytes as mb

    table = Table(show_header=False, box=None, padding=(0, 1))
    groups: dict[str, list[int]] = {}
    for row in rep.params:
        axes = [a for e in row.spec if e for a in ((e,) if isinstance(e, str) else e)]
        groups.setdefault(" × ".join(sorted(axes)) or "replicated", []).append(row.bytes)
    total = sum(map(sum, groups.values()))
    how = "; ".join(
        f"{k}: {len(v)} arrays, {sum(v) / total:.0%} of bytes"
        for k, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    )
    table.add_row("[bold]sharded how", how)
    pd = rep.per_device_bytes
    cm = rep.compiled_memory
    table.add_row(
        "[bold]memory/device",
        f"model state {mb(pd['total'])} (params {mb(pd['params'])}, grads {mb(pd['grads'])}, "
        f"optimizer {mb(pd['optimizer'])}); compiled: arguments {mb(cm.get('argument_bytes'))}, "
        f"temporaries {mb(cm.get('temp_bytes'))}",
    )
    comms = ", ".join(f"{c.count}× {c.kind} over {'+'.join(c.axes) or '-'}" for c in rep.collectives) or "none"
    table.add_row("[bold]collectives", comms)
    table.add_row("[bold]loss", f"{sparkline(losses)}  {losses[0]:.3f} → {losses[-1]:.3f} (chain entropy {best:.3f})")
    verdict = "[green]matches" if diff <= 1e-4 else "[red]DIFFERS FROM"
    table.add_row("[bold]check", f"{verdict}[/] the single-device run: max |difference| {diff:.1e} (tolerance 1e-4)")
    return table


def sparkline(values: list[float]) -> str:
    """A loss curve as one line of text.

    >>> sparkline([3.0, 2.0, 1.0])
    '█▅▁'
    """
    blocks = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(blocks[round((v - lo) / span * (len(blocks) - 1))] for v in values)


if __name__ == "__main__":
    sys.exit(main())
