"""Training from the command line: the loop ``run`` and ``demo`` share (checkpoints, progress), the
single-device reference ``--check`` compares with, and the comparison."""

from __future__ import annotations

import argparse
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

__all__ = ["Trained", "max_abs_diff", "reference", "train"]


class Trained(NamedTuple):
    """What a run leaves: the losses of the steps it ran, the final parameters on the host, the step."""

    losses: list[float]
    params: Any
    step: spmd.TrainStep | None


def train(
    s: Setup,
    args: argparse.Namespace,
    *,
    label: str,
    quiet: bool,
    before: Callable[[spmd.TrainStep], None] | None = None,
) -> Trained:
    """Trains up to step ``args.steps`` (from a checkpoint with ``--resume``, saving with ``--checkpoint-dir``).
    ``before(step)`` runs once the step is compiled, before training (the demo prints its report there)."""
    step = s.step()
    checkpoints = _checkpoints(args)
    layout = spmd.ModelLayout(step)
    start = 0
    if getattr(args, "resume", False):
        # Checkpoints hold the model's own layout, so any plan can resume from any other's.
        start, state, _ = checkpoints.restore(layout.abstract())
        state = layout.from_model(state)
        if start >= args.steps:
            raise UsageError(f"--resume: the checkpoint is at step {start}; --steps {args.steps} asks for none more")
    else:
        state = step.init(s.model.init, jax.random.key(s.seed))
    step.compile(s.batch(0))
    if before is not None:
        before(step)
    every = getattr(args, "checkpoint_every", None) or args.steps
    record = {"model": s.model.name, "plan": s.plan.describe(), "mesh": dict(s.mesh.shape)}
    losses = []
    with Progress(transient=True, disable=quiet, console=console(stderr=True)) as bar:
        task = bar.add_task(label, total=args.steps - start)
        for i in range(start, args.steps):
            state, loss = step(state, s.batch(i))
            losses.append(float(loss))
            bar.update(task, advance=1, description=f"{label} loss {losses[-1]:.3f}")
            if checkpoints is not None and ((i + 1) % every == 0 or i + 1 == args.steps):
                checkpoints.save(i + 1, layout.to_model(state), record)
    if checkpoints is not None:
        checkpoints.close()
    return Trained(losses, _on_host(step.params_of(state)), step)


def _checkpoints(args: argparse.Namespace) -> spmd.Checkpoints | None:
    directory = getattr(args, "checkpoint_dir", None)
    if directory is None:
        return None
    if getattr(args, "resume", False) and not os.path.isdir(directory):
        raise UsageError(f"--resume: checkpoint directory {directory!r} does not exist")
    return spmd.Checkpoints(directory)


def _on_host(tree: Any) -> Any:
    """Full numpy arrays of a tree; arrays spread over several processes are gathered (all of them must call)."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def reference(s: Setup, args: argparse.Namespace, quiet: bool) -> Trained:
    """The same training on a single device (of this process), from the same initial parameters and data."""
    one = spmd.make_mesh({"data": 1}, devices=jax.local_devices()[:1])
    plain = Setup(s.model, s.params, one, spmd.Plan(), s.optimizer, s.hardware, None, s.batch_size, s.seed)
    # The reference saves nothing: the run's checkpoints are the run's.
    alone = argparse.Namespace(**{**vars(args), "checkpoint_dir": None, "resume": False})
    return train(plain, alone, label="one device", quiet=quiet)


def max_abs_diff(run: Trained, ref: Trained) -> float:
    """The largest difference between two runs' losses and final parameters.

    >>> a = Trained([1.0, 0.5], {"w": np.ones(2)}, None)
    >>> max_abs_diff(a, Trained([1.0, 0.4], {"w": np.ones(2)}, None))
    0.09999999999999998
    """
    diffs = [abs(a - b) for a, b in zip(run.losses, ref.losses, strict=True)]
    pairs = zip(jax.tree.leaves(run.params), jax.tree.leaves(ref.params), strict=True)
    return max(diffs + [float(np.max(np.abs(a - b))) for a, b in pairs])
