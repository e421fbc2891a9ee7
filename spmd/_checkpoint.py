"""Checkpoints with orbax: the training state and the plan, saved asynchronously and atomically, restored onto
whatever mesh and plan the run has now.

A checkpoint holds the training state in the model's own layout (parameters as the model has them, each optimizer
moment shaped like its parameter, the step; see ``TrainStep.to_model_layout``) and a JSON record of what made it:
the state's paths and shapes, the plan and the mesh. Restoring builds the targets from the *current* training
step, with the shardings of its own layout, so orbax reads each array straight onto the new mesh, and the step
lays it out as its plan stores it: saved under ``fsdp=8``, resumed under ``data=2,tensor=4`` or as a pipeline.
Orbax writes a step to a temporary directory and renames it when complete, so a save killed halfway leaves the
previous checkpoint as the latest.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import jax
import numpy as np

__all__ = ["CheckpointError", "Checkpoints"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message says why and what to do."""


def _let_pending_reads_finish(seconds: float = 2.0) -> None:
    """After a failed restore, orbax has closed its event loop while the reads of the other arrays are still in
    flight; each one that completes tries to schedule a callback on the closed loop and prints a traceback. Wait
    for them with standard error silenced, so the error that matters is the only thing the user sees."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            time.sleep(seconds)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _paths(tree: Any) -> dict[str, list[int]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): list(np.shape(x)) for path, x in flat}


class Checkpoints:
    """Saves and restores a :class:`spmd.TrainStep`'s state in ``directory`` (kept: the ``keep`` latest)."""

    def __init__(self, directory: str, *, keep: int = 2, asynchronous: bool = True) -> None:
        import orbax.checkpoint as ocp

        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=asynchronous, cleanup_tmp_directories=True
        )
        self._ocp = ocp
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, record: dict[str, Any]) -> None:
        """Starts saving ``state`` as ``step`` (returns while orbax writes in the background)."""
        ocp = self._ocp
        record = {**record, "state": _paths(state)}
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record))
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, target: Any) -> tuple[int, Any, dict[str, Any]]:
        """The latest step, its state read into ``target``'s shapes and shardings (ShapeDtypeStructs, e.g.
        ``TrainStep.model_layout_abstract()``), and its record. Raises :class:`CheckpointError` when there is nothing
        to resume, when it was saved from another model, or when it cannot be read."""
        try:
            return self._restore(target)
        except CheckpointError:
            self.manager.close()  # its background threads would otherwise outlive the error
            raise

    def _restore(self, target: Any) -> tuple[int, Any, dict[str, Any]]:
        ocp = self._ocp
        step = self.latest()
        if step is None:
            raise CheckpointError(
                f"--resume: no checkpoint in {self.directory}; run without --resume first (with --checkpoint-dir)"
            )
        try:
            record = self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
        except Exception as e:  # noqa: BLE001 - any failure to read the record means the checkpoint is unusable
            raise CheckpointError(
                f"--resume: checkpoint step {step} in {self.directory} cannot be read ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}); it is corrupt or incomplete: delete that step's directory to "
                f"resume from an earlier one"
            ) from None
        self._check_same_model(record, target, step)
        try:
            state = ocp.args.Composite(state=ocp.args.StandardRestore(target))
            restored = self.manager.restore(step, args=state)["state"]
        except Exception as e:  # noqa: BLE001
            _let_pending_reads_finish()
            raise CheckpointError(
                f"--resume: the state of checkpoint step {step} in {self.directory} cannot be read "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); it is corrupt: delete that step's "
                f"directory to resume from an earlier one"
            ) from None
        return step, restored, record

    def _check_same_model(self, record: dict[str, Any], target: Any, step: int) -> None:
        saved, now = record.get("state", {}), _paths(target)
        for path in [*saved, *(p for p in now if p not in saved)]:  # in the state's order: parameters first
            if saved.get(path) != now.get(path):
                was = "absent" if path not in saved else f"shape {tuple(saved[path])}"
                is_ = "absent" if path not in now else f"shape {tuple(now[path])}"
                raise CheckpointError(
                    f"--resume: checkpoint step {step} in {self.directory} was saved from another model or optimizer: "
                    f"state{path} is {was} there but {is_} here (saved: {record.get('model')}, "
                    f"{record.get('plan')}); resume with the same model and optimizer, or use a new --checkpoint-dir"
                )

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
