"""The command line's grammar: one parser with a subcommand each, and the checks argparse cannot make.

Lists of choices come from where they are defined: the cost model's hardware table, the schedule registry,
subnetwork data parallelism's granularities and maskings.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

import strategies
from spmd.costmodel import HARDWARE
from spmd.devices import parse_bytes
from spmd.execution import GRANULARITIES, MASKINGS

__all__ = ["DEMO", "UsageError", "check", "parse_bandwidth", "parser"]

DEMO = {"model": "gpt-tiny", "mesh": "data=2,fsdp=2,tensor=2", "strategy": "dp+fsdp+tp", "steps": 20}
_POSITIVE = (
    "steps", "batch_size", "devices", "layers", "timed_steps", "block", "confirm", "max_tensor", "top", "size",
    "microbatch", "processes", "devices_per_process", "checkpoint_every", "microbatches", "virtual", "stages",
)  # fmt: skip


class UsageError(Exception):
    """A mistake in the command line: reported in one line, exit status 2.

    >>> try:
    ...     parser().parse_args(["plan", "--frobnicate"])
    ... except UsageError as e:
    ...     print(e)
    unrecognized arguments: --frobnicate
    """


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    """The ``spmd`` command's parser.

    >>> parser().parse_args(["plan", "--mesh", "data=8"]).strategy
    'dp'
    """
    top = _Parser(prog="spmd", description="plan, run and demo a partitioning plan on a built-in or user model")
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, text in (
        ("plan", "show how a plan lays out a model, and what the compiler makes of it"),
        ("run", "train with a plan (and --check it against one device)"),
        ("compare", "several strategies side by side: memory, traffic, step time"),
        ("suggest", "rank meshes and strategies by the cost model; confirm by compiling"),
    ):
        _model_flags(sub.add_parser(name, help=text))
    _run_flags(sub.choices["run"])
    _compare_flags(sub.choices["compare"], sub.choices["suggest"])
    launch = sub.add_parser("launch", help="run a command as several JAX processes on this host (jax.distributed)")
    launch.add_argument("--processes", type=int, default=2, help="processes to start")
    launch.add_argument("--devices-per-process", type=int, default=4, help="CPU devices each process has")
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- spmd run ...")
    _schedule_flags(sub.add_parser("schedule", help="simulate a pipeline schedule: Gantt chart, bubble, memory"))
    profile = sub.add_parser("profile", help="measure the present devices: matmul speed, all-reduce bandwidth")
    profile.add_argument("--devices", type=int, help="emulate N CPU devices (default: the accelerators)")
    profile.add_argument("--size", type=int, default=1024, help="matmul size")
    profile.add_argument("--out", help="also write the profile to this JSON file (for --device-profile)")
    demo = sub.add_parser("demo", help="the main job: gpt-tiny on data=2 × fsdp=2 × tensor=2, checked")
    _job_flags(demo)
    demo.add_argument("--steps", type=int, default=DEMO["steps"])
    return top


def _job_flags(p: argparse.ArgumentParser) -> None:
    """What every command that builds a training step takes."""
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


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The model, the mesh, the strategy and its options, the devices' properties."""
    _job_flags(p)
    p.add_argument("--model", default="gpt-tiny", help="built-in name, or package.module:factory")
    p.add_argument("--mesh", default="data=-1", help="axis=size pairs, e.g. data=2,fsdp=2,tensor=2")
    p.add_argument("--dcn", help="how many processes/slices each axis spans, e.g. data=2 (the rest is within one)")
    p.add_argument("--strategy", default="dp", help="registry names joined by '+', e.g. dp+fsdp+tp")
    p.add_argument("--layers", type=int, help="override the model's number of layers")
    p.add_argument("--block", type=int, help="align FSDP shards to whole blocks of this many rows (veScale)")
    p.add_argument("--device-kind", help=f"cost model device: {', '.join(HARDWARE)} (default: the devices present)")
    p.add_argument("--axis-bandwidth", help="per-axis link bandwidth in GB/s per device, e.g. tensor=450,tensor2=50")
    p.add_argument("--memory-per-device", help="memory budget per device, e.g. 16GiB (osdp, suggest)")
    _pipeline_flags(p)
    p.add_argument("--layers-per-stage", help="layers of each global stage, e.g. 3,3,1,1 (default even)")
    p.add_argument("--coverage", type=float, default=0.5, help="sdp: share of the model each worker owns (1/P)")
    p.add_argument(
        "--granularity", default="block", help=f"sdp: {' or '.join(GRANULARITIES)} (whole layers; units, heads)"
    )
    p.add_argument(
        "--masking", default="forward", help=f"sdp: {' or '.join(MASKINGS)} (run only the subnetwork, or all)"
    )
    p.add_argument("--device-speeds", help="relative speed of each device in mesh order, e.g. 3,3,1,1,1,1,2,2")
    p.add_argument("--device-memory", help="memory of each device (or one for all), e.g. 16GiB,16GiB,8GiB,...")
    p.add_argument("--device-profile", help="a JSON device profile (spmd profile writes one)")
    p.add_argument("--even", action="store_true", help="ignore the profile's speeds: the homogeneous split")
    p.add_argument("--microbatch", type=int, default=1, help="uneven shares are multiples of this many examples")


def _pipeline_flags(p: argparse.ArgumentParser) -> None:
    schedules = ", ".join(strategies.SCHEDULES)
    p.add_argument("--schedule", default="1f1b", help=f"pipeline schedule: {schedules}, or a .json/.csv table")
    p.add_argument("--microbatches", type=int, help="microbatches per step (pp; default twice the stages)")
    p.add_argument("--virtual", type=int, default=1, help="chunks per device (interleaved, bfs)")


def _run_flags(run: argparse.ArgumentParser) -> None:
    run.add_argument("--steps", type=int, default=10, help="training steps")
    run.add_argument("--check", action="store_true", help="also train on one device and compare")
    run.add_argument("--checkpoint-dir", help="save the training state here (orbax; async, atomic)")
    run.add_argument("--checkpoint-every", type=int, help="save every K steps (default: at the end)")
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, on this mesh/plan")


def _compare_flags(compare: argparse.ArgumentParser, suggest: argparse.ArgumentParser) -> None:
    compare.add_argument("--strategies", default="dp,zero1,zero2,zero3", help="comma-separated --strategy values")
    compare.add_argument("--timed-steps", type=int, default=3, help="steps timed per strategy (median reported)")
    compare.add_argument("--plot", help="write a bar chart of memory and traffic to this PNG file")
    suggest.add_argument("--confirm", type=int, default=3, help="compile this many of the best plans that fit")
    suggest.add_argument("--max-tensor", type=int, default=8, help="largest tensor-parallel axis to try")
    suggest.add_argument("--top", type=int, default=15, help="rows of the ranked table to print")


def _schedule_flags(schedule: argparse.ArgumentParser) -> None:
    _pipeline_flags(schedule)
    schedule.add_argument("--stages", type=int, default=4, help="pipeline devices (p)")
    schedule.add_argument("--costs", help="op times F,B,W[,comm] of a whole stage (default 1,1,1,0)")
    schedule.add_argument("--json", action="store_true", help="print one JSON object instead of the chart")
    schedule.add_argument("--plot", help="write a Gantt chart PNG to this file")


def check(args: argparse.Namespace) -> None:
    """Checks what argparse cannot and turns text values into their types (sizes, bandwidths, counts).

    >>> args = parser().parse_args(["plan", "--memory-per-device", "1KiB", "--layers-per-stage", "3,1"])
    >>> check(args); args.memory_per_device, args.layers_per_stage
    (1024, (3, 1))
    """
    for name in _POSITIVE:
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
        args.axis_bandwidth = parse_bandwidth(args.axis_bandwidth)


def parse_bandwidth(text: str) -> dict[str, float]:
    """``--axis-bandwidth`` values: GB/s per axis, in bytes per second.

    >>> parse_bandwidth("tensor=450,tensor2=50")
    {'tensor': 450000000000.0, 'tensor2': 50000000000.0}
    """
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
