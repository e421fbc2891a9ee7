"""Training from the command line: the loop ``run`` and ``demo`` share (checkpoints, progress), the
single-device reference ``--check`` compares with, and the comparison."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from rich.progress import Progress

import spmd
from spmd.cli.common import console
from spmd.cli.parser import UsageError
from spmd.cli.setup import Setup
from spmd.execution import SimulatedSubnets, SubnetSpec

__all__ = ["BF16_ROUNDOFF", "Trained", "bf16_check", "max_abs_diff", "reference", "train"]


class Trained(NamedTuple):
    """What a run leaves: the losses of the steps it ran, the final parameters on the host, the step, and the
    steps whose update was skipped (a non-finite loss under ``--on-nan skip``)."""

    losses: list[float]
    params: Any
    step: spmd.TrainStep | None
    skipped: tuple[int, ...] = ()


def train(
    s: Setup,
    args: argparse.Namespace,
    *,
    label: str,
    quiet: bool,
    before: Callable[[spmd.TrainStep], None] | None = None,
) -> Trained:
    """Trains up to step ``args.steps`` (from a checkpoint with ``--resume``, saving with ``--checkpoint-dir``).
    ``before(step)`` runs once the step is compiled, before training (the demo prints its report there).
    A non-finite loss stops the run (or, with ``--on-nan skip``, its update is skipped)."""
    step = s.step()
    checkpoints = _checkpoints(args, _run_record(s))
    try:
        saver = _Saver(checkpoints, spmd.ModelLayout(step), _run_record(s), args)
        trained = _loop(s, args, step, saver, label=label, quiet=quiet, before=before)
    except BaseException:
        if checkpoints is not None:
            with contextlib.suppress(Exception):  # the error on its way out is the one to report
                checkpoints.close()
        raise
    if checkpoints is not None:
        checkpoints.close()  # the saves in flight complete: every step saved is whole
    return trained


def _loop(
    s: Setup,
    args: argparse.Namespace,
    step: spmd.TrainStep,
    saver: _Saver,
    *,
    label: str,
    quiet: bool,
    before: Callable[[spmd.TrainStep], None] | None,
) -> Trained:
    _check_fits(s, step.compile(s.abstract_batch()), hasattr(args, "strategy"))  # before any array is made
    layout = saver.layout
    start = 0
    if getattr(args, "resume", False):
        # Checkpoints hold the model's own layout, so any plan can resume from any other's.
        start, state, _ = saver.checkpoints.restore(layout.abstract())
        state = layout.from_model(state)
        saver.saved = start
        if start >= args.steps:
            raise UsageError(f"--resume: the checkpoint is at step {start}; --steps {args.steps} asks for none more")
    else:
        state = step.init(s.model.init, jax.random.key(s.seed))
    if before is not None:
        before(step)
    guard = _Guard(getattr(args, "on_nan", "stop"), saver)
    losses = []
    with Progress(transient=True, disable=quiet, console=console(stderr=True)) as bar:
        task = bar.add_task(label, total=args.steps - start)
        for i in range(start, args.steps):
            state, loss = step(state, s.batch(i))
            losses.append(float(loss))
            guard.check(i + 1, losses[-1])
            bar.update(task, advance=1, description=f"{label} loss {losses[-1]:.3f}")
            saver.after(i + 1, state)
    return Trained(losses, _on_host(step.params_of(state)), step, tuple(guard.skipped))


def _check_fits(s: Setup, compiled: jax.stages.Compiled, strategy_flag: bool) -> None:
    """Refuses a step whose compiled memory (arguments, temporaries) does not fit in what each device has free,
    with the batch made on the host beside it: better than being killed for memory with no message."""
    from spmd._report import memory_of

    need = memory_of(compiled).get("peak_bytes")
    free = spmd.devices.free_memory(s.mesh.devices.flat[0])
    if need is None or free is None:
        return
    host_batch = s.batch_size * s.model.config.seq_len * 4  # int32 tokens, on the host before placement
    if s.mesh.devices.flat[0].platform == "cpu":
        need += host_batch // max(1, len(jax.local_devices()))
    if need > free:
        raise UsageError(
            f"--batch-size {s.batch_size}: the step needs {spmd.format_bytes(need)} per device and "
            f"{s.mesh.devices.flat[0].platform} devices have {spmd.format_bytes(free)} free; use a smaller "
            f"--batch-size" + (" or a --strategy that splits more (fsdp, zero3, tp)" if strategy_flag else "")
        )


# A run skipping non-finite steps stops after this many in a row: by then the data is not the cause.
MAX_SKIPPED_IN_A_ROW = 10


class _Saver:
    """The run's saves: every ``--checkpoint-every`` steps and at the last, in the model's layout. With
    ``--overwrite``, the old checkpoints are deleted only at the first save, once this run has a step to put in
    their place: a run refused or stopped before that leaves them as they were."""

    def __init__(
        self, checkpoints: spmd.Checkpoints | None, layout: spmd.ModelLayout, record: dict, args: argparse.Namespace
    ) -> None:
        self.checkpoints, self.layout, self.record = checkpoints, layout, record
        self.every, self.last = getattr(args, "checkpoint_every", None) or args.steps, args.steps
        self.replace = checkpoints is not None and getattr(args, "overwrite", False)
        self.saved: int | None = None  # the latest step this run saved (or resumed from)

    def after(self, step: int, state: spmd.TrainState) -> None:
        if self.checkpoints is None or (step % self.every and step != self.last):
            return
        if self.replace:
            self.checkpoints.clear()
            self.replace = False
        self.checkpoints.save(step, self.layout.to_model(state), self.record)
        self.saved = step

    def last_words(self) -> str:
        """Where a stopped run can be continued from: its last checkpoint, once the saves in flight are done."""
        if self.saved is None:
            return "no checkpoint was saved"
        try:
            self.checkpoints.wait()
        except spmd.CheckpointError as e:
            return f"and {e}"
        return f"the last checkpoint is step {self.saved} in {self.checkpoints.directory} (--resume continues it)"


class _Guard:
    """What a run does about a non-finite loss: stop (naming the step and the last checkpoint saved), or count
    it as skipped (the step kept the state as it was) and stop after :data:`MAX_SKIPPED_IN_A_ROW` in a row."""

    def __init__(self, policy: str, saver: _Saver) -> None:
        self.policy, self.saver = policy, saver
        self.skipped: list[int] = []

    def check(self, step: int, loss: float) -> None:
        if math.isfinite(loss):
            return
        self.skipped.append(step)
        in_a_row = len(self.skipped) >= MAX_SKIPPED_IN_A_ROW and self.skipped[-MAX_SKIPPED_IN_A_ROW] == (
            step - MAX_SKIPPED_IN_A_ROW + 1
        )
        if self.policy == "skip" and not in_a_row:
            return
        row = f", {MAX_SKIPPED_IN_A_ROW} steps in a row" if self.policy == "skip" else ""
        advice = "" if self.policy == "skip" else ", or pass --on-nan skip to skip such steps"
        raise RuntimeError(
            f"step {step}: the loss is {loss}{row}; the run stops and saves nothing more; "
            f"{self.saver.last_words()}; lower --lr{advice}"
        )


def _run_record(s: Setup) -> dict[str, Any]:
    """What identifies a run in its checkpoints: the model, the data (seed, batch size), the plan and mesh."""
    return {
        "model": s.model.name,
        "seed": s.seed,
        "batch_size": s.batch_size,
        "plan": s.plan.describe(),
        "mesh": dict(s.mesh.shape),
    }


def _describe_run(record: dict[str, Any]) -> str:
    mesh = ",".join(f"{axis}={size}" for axis, size in (record.get("mesh") or {}).items())
    return (
        f"{record.get('model')}, {record.get('plan')} on {mesh}, seed {record.get('seed')}, "
        f"batch {record.get('batch_size')}"
    )


def _checkpoints(args: argparse.Namespace, run: dict[str, Any]) -> spmd.Checkpoints | None:
    """The run's checkpoint directory, opened (and locked). A directory holding checkpoints is another run's
    unless ``--resume`` continues it (with the same model and data) or ``--overwrite`` deletes them: saving
    after them would skip every step up to theirs."""
    directory = getattr(args, "checkpoint_dir", None)
    if directory is None:
        return None
    resume = getattr(args, "resume", False)
    if resume and not os.path.isdir(directory):
        raise UsageError(
            f"--resume: checkpoint directory {directory!r} does not exist; give the --checkpoint-dir the run "
            f"saved into, or run without --resume"
        )
    checkpoints = spmd.Checkpoints(directory)
    try:
        latest = checkpoints.latest()
        foreign = checkpoints.not_checkpoints()
        if foreign:
            raise UsageError(
                f"--checkpoint-dir {directory} holds {foreign[0]}, named like a saved step but not one; move it "
                f"out of the directory, or choose another --checkpoint-dir"
            )
        if latest is not None and getattr(args, "overwrite", False):
            pass  # deleted at this run's first save (_Saver)
        elif latest is not None and not resume:
            raise UsageError(
                f"--checkpoint-dir {directory} already holds checkpoints up to step {latest} of a run "
                f"({_describe_run(checkpoints.record(latest))}); this run ({_describe_run(run)}) would not "
                f"save over them: continue it with --resume, choose a new --checkpoint-dir, or pass --overwrite "
                f"to delete them"
            )
        elif latest is not None:
            _check_same_run(checkpoints.record(latest), run, latest, directory)
    except Exception:
        checkpoints.close()
        raise
    return checkpoints


def _check_same_run(saved: dict[str, Any], run: dict[str, Any], step: int, directory: str) -> None:
    """Resuming continues the saved run: the same model and the same data stream (the plan and mesh may
    change). Checkpoints saved before these were recorded are taken as they are."""
    for key, flag in (("model", "--model"), ("seed", "--seed"), ("batch_size", "--batch-size")):
        if key in saved and saved[key] != run[key]:
            raise UsageError(
                f"--resume: checkpoint step {step} in {directory} was saved by a run with {flag} {saved[key]}, "
                f"this run has {flag} {run[key]}; resume with {flag} {saved[key]}, or start a new run in another "
                f"--checkpoint-dir"
            )


def _on_host(tree: Any) -> Any:
    """Full numpy arrays of a tree; arrays spread over several processes are gathered (all of them must call)."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def reference(s: Setup, args: argparse.Namespace, quiet: bool) -> Trained:
    """The same training on a single device (of this process), from the same initial parameters and data."""
    # The run's axis names, each of one device: a model's own PartitionSpec constraints name them.
    explicit = jax.sharding.AxisType.Explicit in s.mesh.axis_types
    one = spmd.make_mesh({a: 1 for a in s.mesh.axis_names}, devices=jax.local_devices()[:1], explicit=explicit)
    # The same non-finite policy too, and the same precision policy: bf16 is compared with bf16.
    # Subnetworks are another algorithm than plain training: the reference runs it, its workers simulated.
    spec = s.plan.execution
    execution = SimulatedSubnets(spec, s.mesh.shape[spec.axis]) if isinstance(spec, SubnetSpec) else None
    plan = spmd.Plan(precision=s.plan.precision, execution=execution)
    plain = dataclasses.replace(s, mesh=one, plan=plan, profile=None)
    # The reference saves nothing: the run's checkpoints are the run's.
    alone = argparse.Namespace(**{**vars(args), "checkpoint_dir": None, "resume": False, "overwrite": False})
    return train(plain, alone, label="one device", quiet=quiet)


def max_abs_diff(run: Trained, ref: Trained) -> float:
    """The largest difference between two runs' losses and final parameters; two non-finite losses at one step
    (both runs skipped it) agree, one alone differs infinitely.

    >>> a = Trained([1.0, 0.5], {"w": np.ones(2)}, None)
    >>> max_abs_diff(a, Trained([1.0, 0.4], {"w": np.ones(2)}, None))
    0.09999999999999998
    >>> max_abs_diff(Trained([float("nan")], {}, None), Trained([float("nan")], {}, None))
    0.0
    >>> max_abs_diff(Trained([float("nan")], {}, None), Trained([1.0], {}, None))
    inf
    """
    diffs = [_loss_diff(a, b) for a, b in zip(run.losses, ref.losses, strict=True)]
    pairs = zip(jax.tree.leaves(run.params), jax.tree.leaves(ref.params), strict=True)
    return max(diffs + [float(np.max(np.abs(a - b))) for a, b in pairs])


def _loss_diff(a: float, b: float) -> float:
    if math.isfinite(a) and math.isfinite(b):
        return abs(a - b)
    return 0.0 if not math.isfinite(a) and not math.isfinite(b) else math.inf


# bfloat16's unit roundoff: half its machine epsilon (2^-7, 8 significant bits), the largest relative error of one
# rounding to bf16.
BF16_ROUNDOFF = 2.0**-8


def bf16_check(run: Trained, ref: Trained, lr: float) -> dict[str, Any]:
    """``--check`` under ``--precision bf16``: a sharded bf16 run against the one-device bf16 run. Both compute
    in bf16 and round their partial sums in different orders, so they cannot agree to fp32's 1e-4. The loss is
    an fp32 mean over every token of cross-entropies of bf16 logits: independent roundings, each at most one
    unit roundoff u = 2^-8 relative, average out, so the losses must agree within u relative at every step (a
    wrong reduction or layout moves them by far more; gpt-tiny dp+fsdp measures about 0.02u). Adam moves each
    parameter by about ``lr`` a step whatever its gradient's size (the update is m/sqrt(v)): a near-zero
    gradient whose sign rounding flips puts the runs up to 2·lr apart per step, so parameters are held to
    2·lr·steps, and the losses are the sharp test.

    >>> a = Trained([6.0, 5.5], {"w": np.zeros(2)}, None)
    >>> bf16_check(a, Trained([6.001, 5.5], {"w": np.full(2, 1e-3)}, None), lr=1e-3)["passed"]
    True
    """
    losses = [abs(a - b) / abs(b) if math.isfinite(a) and math.isfinite(b) else _loss_diff(a, b)
              for a, b in zip(run.losses, ref.losses, strict=True)]  # fmt: skip
    pairs = zip(jax.tree.leaves(run.params), jax.tree.leaves(ref.params), strict=True)
    params = max([float(np.max(np.abs(a - b))) for a, b in pairs], default=0.0)
    out = {
        "loss_rel_diff": max(losses, default=0.0),
        "loss_rel_tolerance": BF16_ROUNDOFF,
        "param_abs_diff": params,
        "param_tolerance": 2 * lr * len(run.losses),
    }
    return out | {"passed": out["loss_rel_diff"] <= BF16_ROUNDOFF and params <= out["param_tolerance"]}
