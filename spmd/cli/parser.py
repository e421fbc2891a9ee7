"""The command line's grammar: one parser with a subcommand each, and the checks argparse cannot make.

Lists of choices come from where they are defined: the cost model's hardware table, the schedule registry,
subnetwork data parallelism's granularities and maskings.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from typing import NoReturn

import strategies
from spmd._context_parallel import METHODS
from spmd._mesh import MAX_EMULATED_DEVICES
from spmd._offload import OFFLOADABLE
from spmd._remat import FORMS, NAMES, Remat
from spmd._rules import PlanError
from spmd.costmodel import HARDWARE
from spmd.devices import parse_bytes
from spmd.execution import GRANULARITIES, MASKINGS

__all__ = [
    "DEMO", "MAX_DEVICES", "PRECISIONS", "UsageError", "check", "explicit", "parse", "parse_bandwidth", "parse_offload",
    "parser", "remat_arg",
]  # fmt: skip

PRECISIONS = ("fp32", "bf16")  # --precision; bf16 is strategies.mixed_precision's default policy
DEMO = {"model": "gpt-tiny", "mesh": "data=2,fsdp=2,tensor=2", "strategy": "dp+fsdp+tp", "steps": 20}
_POSITIVE = (
    "steps", "batch_size", "devices", "layers", "timed_steps", "block", "confirm", "max_tensor", "top", "size",
    "microbatch", "processes", "devices_per_process", "checkpoint_every", "microbatches", "virtual", "stages",
    "accumulate", "seq_len", "max_context", "max_stages",
)  # fmt: skip
MAX_SEED = 2**32 - 1  # jax.random.key and numpy's generators take 32-bit seeds
MAX_DEVICES = MAX_EMULATED_DEVICES  # emulated CPU devices: beyond, a program takes minutes to build
# Flags that apply only where a part of the plan reads them: (flags, the strategy that does, what to say).
_STRATEGY_FLAGS = (
    (("coverage", "granularity", "masking"), "sdp", "subnetwork data parallelism"),
    (("schedule", "microbatches", "virtual", "layers_per_stage"), "pp", "pipeline parallelism"),
    (("cp_method", "no_load_balance", "cp_shard_params"), "cp", "context parallelism"),
)


CP_METHODS = METHODS  # strategies.context_parallel's methods


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
        if name != "suggest":  # suggest ranks plans of its own
            sub.choices[name].add_argument(
                "--accumulate", type=int, default=1, help="microbatches per step, gradients reduced once (default 1)"
            )
    for name in ("plan", "run", "compare"):
        sub.choices[name].add_argument(
            "--precision",
            choices=PRECISIONS,
            default="fp32",
            help="fp32, or bf16: compute and gathers in bfloat16, float32 master weights, optimizer and reductions",
        )
    sub.choices["suggest"].add_argument(
        "--precision",
        choices=(*PRECISIONS, "any"),
        default="fp32",
        help="the precisions to search: fp32, bf16, or any (both: bf16 changes the numerics, so it is asked for)",
    )
    _run_flags(sub.choices["run"])
    _compare_flags(sub.choices["compare"], sub.choices["suggest"])
    launch = sub.add_parser("launch", help="run a command as several JAX processes on this host (jax.distributed)")
    launch.add_argument("--processes", type=int, default=2, help="processes to start")
    launch.add_argument("--devices-per-process", type=int, default=4, help="CPU devices each process has")
    launch.add_argument("--timeout", type=float, help="seconds the whole job may run (default: no limit); then 124")
    launch.add_argument(
        "--exit-grace", type=float, default=60.0, help="seconds the others may run after one exits 0; then 124"
    )
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
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (eps 1e-5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The model, the mesh, the strategy and its options, the devices' properties."""
    _job_flags(p)
    p.add_argument("--model", default="gpt-tiny", help="built-in name, or package.module:factory")
    p.add_argument("--mesh", default="data=-1", help="axis=size pairs, e.g. data=2,fsdp=2,tensor=2")
    p.add_argument("--dcn", help="how many processes/slices each axis spans, e.g. data=2 (the rest is within one)")
    p.add_argument(
        "--axis-types",
        choices=("auto", "explicit"),
        default="explicit",
        help="the mesh's axis types: explicit (JAX's default: arrays carry their sharding in their type) or auto",
    )
    p.add_argument("--strategy", default="dp", help="registry names joined by '+', e.g. dp+fsdp+tp")
    p.add_argument("--layers", type=int, help="override the model's number of layers")
    p.add_argument("--seq-len", type=int, help="sequence length of the built-in models' batches (positions extend)")
    p.add_argument(
        "--cp-method", choices=CP_METHODS, default="allgather", help="cp: how attention sees the whole sequence"
    )
    p.add_argument(
        "--no-load-balance", action="store_true", help="cp: keep the sequence in order (no head-tail layout)"
    )
    p.add_argument(
        "--cp-shard-params", action="store_true", help="cp: split the parameters over the context axis too (FSDP)"
    )
    p.add_argument("--block", type=int, help="align FSDP shards to whole blocks of this many rows (veScale)")
    p.add_argument(
        "--offload",
        help=f"keep in host memory: {', '.join(OFFLOADABLE)} (ZeRO-Offload) and/or activations (the layers' matmul "
        "outputs, kept for the backward pass: the remat policy offload:...)",
    )
    p.add_argument("--remat", help=f"remat policy of the layers, overriding the strategy's: {FORMS}")
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
    p.add_argument("--virtual", type=int, help="chunks per device (interleaved, bfs; zb-v has 2; default 1)")


def _run_flags(run: argparse.ArgumentParser) -> None:
    run.add_argument("--steps", type=int, default=10, help="training steps")
    run.add_argument("--check", action="store_true", help="also train on one device and compare")
    run.add_argument("--checkpoint-dir", help="save the training state here (orbax; async, atomic)")
    run.add_argument("--checkpoint-every", type=int, help="save every K steps (default: at the end)")
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, on this mesh/plan")
    run.add_argument("--overwrite", action="store_true", help="delete the checkpoints --checkpoint-dir holds first")
    run.add_argument(
        "--on-nan",
        choices=("stop", "skip"),
        default="stop",
        help="a non-finite loss stops the run (default), or its update is skipped (10 in a row stop it)",
    )


def _compare_flags(compare: argparse.ArgumentParser, suggest: argparse.ArgumentParser) -> None:
    compare.add_argument("--strategies", default="dp,zero1,zero2,zero3", help="comma-separated --strategy values")
    compare.add_argument("--timed-steps", type=int, default=3, help="steps timed per strategy (median reported)")
    compare.add_argument("--plot", help="write a bar chart of memory and traffic to this PNG file")
    suggest.add_argument("--confirm", type=int, default=3, help="compile this many of the best plans that fit")
    suggest.add_argument("--max-tensor", type=int, default=8, help="largest tensor-parallel axis to try")
    suggest.add_argument("--max-context", type=int, default=8, help="largest context axis (cp) to try; 1: none")
    suggest.add_argument(
        "--max-stages", type=int, default=8, help="largest pipeline (pp) stage axis to try; 1: no pipelines"
    )
    suggest.add_argument(
        "--schedules", default="1f1b,zb-h1", help="pipeline schedules to try, each with 2 and 4 microbatches a stage"
    )
    suggest.add_argument("--top", type=int, default=15, help="rows of the ranked table to print")


def _schedule_flags(schedule: argparse.ArgumentParser) -> None:
    _pipeline_flags(schedule)
    schedule.add_argument("--stages", type=int, default=4, help="pipeline devices (p)")
    schedule.add_argument("--costs", help="op times F,B,W[,comm] of a whole stage (default 1,1,1,0)")
    schedule.add_argument("--json", action="store_true", help="print one JSON object instead of the chart")
    schedule.add_argument("--plot", help="write a Gantt chart PNG to this file")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line parsed and checked (see :func:`check`), with the flags it names in ``args.given``.

    >>> sorted(parse(["plan", "--mesh", "data=8", "--seed", "1"]).given)
    ['mesh', 'seed']
    """
    args = parser().parse_args(argv)
    args.given = explicit(argv)
    check(args)
    return args


def explicit(argv: Sequence[str] | None) -> set[str]:
    """The options a command line names itself (whatever their values), as argparse destinations: the same
    grammar with every default removed.

    >>> sorted(explicit(["run", "--steps", "10", "--check"]))
    ['check', 'steps']
    """
    top = parser()
    for sub in top._subparsers._group_actions[0].choices.values():  # noqa: SLF001 - argparse keeps them here
        for action in sub._actions:  # noqa: SLF001
            action.default = argparse.SUPPRESS
    return set(vars(top.parse_args(argv))) - {"command"}


def check(args: argparse.Namespace) -> None:
    """Checks what argparse cannot and turns text values into their types (sizes, bandwidths, counts).

    >>> args = parser().parse_args(["plan", "--memory-per-device", "1KiB", "--layers-per-stage", "3,1"])
    >>> check(args); args.memory_per_device, args.layers_per_stage
    (1024, (3, 1))
    """
    _check_numbers(args)
    for flag in ("plot", "out"):
        if getattr(args, flag, None):
            _check_writable(getattr(args, flag), f"--{flag}")
    if args.command in ("schedule", "profile", "launch"):
        return
    if getattr(args, "resume", False) and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir: the directory to resume from")
    if getattr(args, "resume", False) and args.check:
        raise UsageError("--check compares a run from its first step with one device; it cannot follow --resume")
    if getattr(args, "resume", False) and args.overwrite:
        raise UsageError("--resume continues the checkpoints that --overwrite would delete: give one of them")
    for flag in ("checkpoint_every", "overwrite"):
        if getattr(args, flag, None) and not args.checkpoint_dir:
            raise UsageError(f"--{flag.replace('_', '-')} applies to checkpoints: give --checkpoint-dir too")
    if getattr(args, "memory_per_device", None) is not None:
        args.memory_per_device = parse_bytes(args.memory_per_device, "--memory-per-device")
    elif args.command == "suggest":
        raise UsageError("suggest needs --memory-per-device (e.g. 16GiB): the budget each plan must fit")
    if args.command == "suggest":
        args.schedules = schedules_arg(args.schedules)
    if getattr(args, "axis_bandwidth", None) is not None:
        args.axis_bandwidth = parse_bandwidth(args.axis_bandwidth)
    if getattr(args, "offload", None) is not None:
        args.offload = parse_offload(args.offload)
    if getattr(args, "remat", None) is not None:
        args.remat = remat_arg(args.remat)
    _check_applies(args, getattr(args, "given", set()))


def schedules_arg(text: str) -> tuple[str, ...]:
    """The pipeline schedules suggest's ``--schedules`` names (named ones: a table fixes its stages and
    microbatches), or a usage error naming those there are.

    >>> schedules_arg("1f1b, zb-h1")
    ('1f1b', 'zb-h1')
    """
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in strategies.SCHEDULES]
    if unknown or not names:
        raise UsageError(
            f"--schedules {text!r}: {'unknown schedule ' + repr(unknown[0]) if unknown else 'no schedule named'}; "
            f"name some of {', '.join(strategies.SCHEDULES)}, joined with commas"
        )
    return names


def remat_arg(value: str) -> Remat:
    """The ``--remat`` policy, or a usage error naming the valid forms and the activations the built-in models tag.

    >>> remat_arg("names:mlp_hidden").names
    ('mlp_hidden',)
    """
    try:
        return Remat.of(value)
    except PlanError:
        raise UsageError(f"--remat {value!r}: give {FORMS} (the built-in models tag {','.join(NAMES)})") from None


def _check_numbers(args: argparse.Namespace) -> None:
    for name in _POSITIVE:
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if getattr(args, "devices", None) is not None and args.devices > MAX_DEVICES:
        raise UsageError(
            f"--devices {args.devices}: at most {MAX_DEVICES} emulated CPU devices on one host; plan a larger "
            f"mesh with spmd suggest's cost model, or run on that many devices"
        )
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed must be an integer from 0 to {MAX_SEED}, got {seed}")
    lr = getattr(args, "lr", None)
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise UsageError(f"--lr must be a positive finite number, got {lr}")
    coverage = getattr(args, "coverage", None)
    if coverage is not None and not 0 < coverage <= 1:
        raise UsageError(f"--coverage must be in (0, 1], got {coverage}")
    if getattr(args, "layers_per_stage", None) is not None:
        try:
            args.layers_per_stage = tuple(int(x) for x in args.layers_per_stage.split(","))
        except ValueError:
            raise UsageError(
                f"--layers-per-stage {args.layers_per_stage!r}: give one count per global stage, e.g. 3,3,1,1"
            ) from None


def _check_applies(args: argparse.Namespace, given: set[str]) -> None:
    """Flags that the chosen command or strategy would ignore are errors, not silently dropped."""
    if "offload" in given and args.command == "suggest":
        raise UsageError("--offload does not apply to suggest, which ranks plans without it; remove the flag")
    ignored = {
        "schedule": "it searches the schedules of --schedules (e.g. --schedules zb-h1)",
        "microbatches": "it tries 2 and 4 microbatches a stage",
        "virtual": "it searches schedules of one chunk per device",
        "layers_per_stage": "a device profile gives the stages layers by their speeds",
        "coverage": "it does not search subnetworks (sdp)",
        "granularity": "it does not search subnetworks (sdp)",
        "masking": "it does not search subnetworks (sdp)",
    }
    for flag in (f for f in ignored if f in given and args.command == "suggest"):
        raise UsageError(f"--{flag.replace('_', '-')} does not apply to suggest: {ignored[flag]}; remove the flag")
    if "strategy" in given and args.command in ("compare", "suggest"):
        instead = "give the strategies to compare with --strategies" if args.command == "compare" else "it ranks them"
        raise UsageError(f"--strategy does not apply to {args.command}: {instead}")
    specs = args.strategies.split(",") if args.command == "compare" else [getattr(args, "strategy", "")]
    names = {name for spec in specs for name in spec.split("+")}
    if args.command != "suggest":
        for flags, strategy, what in _STRATEGY_FLAGS:
            for flag in flags:
                if flag in given and strategy not in names:
                    raise UsageError(
                        f"--{flag.replace('_', '-')} applies to {what}, which --strategy does not include "
                        f"({strategy}); add {strategy} or remove the flag"
                    )
    if str(getattr(args, "schedule", "")).endswith((".json", ".csv")):
        for flag in ("microbatches", "virtual"):
            if flag in given:
                raise UsageError(f"--{flag}: the schedule table {args.schedule} fixes it; remove the flag")
    profiled = {"device_speeds", "device_memory", "device_profile"} & given
    for flag in ("even", "microbatch"):
        if flag in given and not profiled:
            raise UsageError(
                f"--{flag} applies to uneven devices: give --device-speeds or --device-profile, or remove it"
            )
    bandwidth = getattr(args, "axis_bandwidth", None) or {}
    axes = [item.partition("=")[0].strip() for item in str(getattr(args, "mesh", "")).split(",")]
    absent = [axis for axis in bandwidth if axis not in axes]
    if absent and (args.command != "suggest" or "mesh" in given):  # suggest's own meshes name their axes
        raise UsageError(f"--axis-bandwidth names {absent[0]!r}, which the mesh {args.mesh} has not; use its axes")


def parse_offload(text: str) -> tuple[str, ...]:
    """``--offload``'s comma-separated parts of the training state kept in host memory.

    >>> parse_offload("optimizer,activations")
    ('optimizer', 'activations')
    """
    parts = tuple(part.strip() for part in text.split(","))
    unknown = [part for part in parts if part not in (*OFFLOADABLE, "activations")]
    if unknown or not text.strip():
        raise UsageError(
            f"--offload {text!r}: cannot offload {unknown[0] if unknown else 'nothing'!r}; "
            f"choose from {', '.join(OFFLOADABLE)}, activations (e.g. --offload optimizer,activations)"
        )
    return tuple(dict.fromkeys(parts))


def _check_writable(path: str, flag: str) -> None:
    """Output files are checked before any work: one that cannot be written would lose it."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror}); choose a writable place") from None
    if not existed:
        os.remove(path)


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
