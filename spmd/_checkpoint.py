"""Checkpoints with orbax: the training state and the plan, saved asynchronously and atomically, restored onto
whatever mesh and plan the run has now.

A checkpoint holds the training state in the model's own layout (parameters as the model has them, each optimizer
moment shaped like its parameter, the step; see :class:`ModelLayout`) and a JSON record of what made it:
the state's paths and shapes, the plan and the mesh. Restoring builds the targets from the *current* training
step, with the shardings of its own layout, so orbax reads each array straight onto the new mesh, and the step
lays it out as its plan stores it: saved under ``fsdp=8``, resumed under ``data=2,tensor=4`` or as a pipeline.
Orbax writes a step to a temporary directory and renames it when complete, so a save killed halfway leaves the
previous checkpoint as the latest.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmd._layout import pad, stored_abstract, unpad
from spmd._tree import unbox

if TYPE_CHECKING:
    from spmd._train import TrainState, TrainStep

__all__ = ["CheckpointError", "Checkpoints", "ModelLayout"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message says why and what to do.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     try:
    ...         Checkpoints(d).restore({})
    ...     except CheckpointError as e:
    ...         print(str(e).split(";")[0].split(" in ")[0])
    --resume: no checkpoint
    """


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


class ModelLayout:
    """A training step's state in the model's own layout and back: parameters as the model has them and each
    optimizer moment shaped like its parameter, whatever the plan stores (block padding sliced off, pipeline
    stages unstacked, owned parts put together). What checkpoints hold, so that any plan resumes from any
    other's. The conversions are the executor's ``to_model`` / ``to_stored`` (and ``from_trained`` /
    ``trained`` for moments of what the optimizer updates), jitted once.

    >>> import spmd, optax, jax
    >>> params = {"w": jax.ShapeDtypeStruct((8, 8), "float32")}
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> step = spmd.TrainStep(lambda p, b: 0.0, optax.adam(0.1), spmd.Plan(), mesh, params=params)
    >>> ModelLayout(step).is_identity  # a plain plan stores the model's layout: nothing to convert
    True
    """

    def __init__(self, step: TrainStep) -> None:
        self.step = step

    @property
    def is_identity(self) -> bool:
        """Whether the step stores every array in the model's own layout already."""
        padded = self.step.layout.params.padded or self.step.layout.trained.padded
        return self.step.executor.keeps_model_layout and not padded

    def to_model(self, state: TrainState) -> TrainState:
        """The state in the model's own layout."""
        return state if self.is_identity else self._conversions[0](state)

    def from_model(self, state: TrainState) -> TrainState:
        """The inverse of :meth:`to_model`: the state as the step's plan stores it, in its shardings."""
        return state if self.is_identity else self._conversions[1](state)

    def abstract(self) -> TrainState:
        """ShapeDtypeStructs (with shardings) of :meth:`to_model`'s result: targets to restore into."""
        return self.step.abstract_state() if self.is_identity else self._conversions[2]

    @functools.cached_property
    def _conversions(self) -> tuple[Callable, Callable, Any]:
        from spmd._train import TrainState

        step = self.step
        ex, layout = step.executor, step.layout

        def model_params(tree: Any) -> Any:
            return ex.to_model(unpad(tree, layout.params))

        def model_moments(tree: Any) -> Any:
            return ex.to_model(ex.from_trained(unpad(tree, layout.trained)))

        def stored_params(tree: Any) -> Any:
            return pad(unbox(ex.to_stored(tree)), layout.params)

        def stored_moments(tree: Any) -> Any:
            return pad(unbox(ex.to_trained(unbox(ex.to_stored(tree)))), layout.trained)

        def convert(state: TrainState, like: Any, params: Callable, moments: Callable) -> TrainState:
            return TrainState(state.step, params(state.params), _map_like(moments, state.opt_state, like))

        trained = stored_abstract(layout.trained)  # moments mirror what the optimizer updates
        to_model = jax.jit(lambda s: convert(s, trained, model_params, model_moments))
        compiled = to_model.lower(step.abstract_state()).compile()
        target = jax.tree.map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(to_model, step.abstract_state()),
            compiled.output_shardings,
        )
        from_model = jax.jit(
            lambda s: convert(s, target.params, stored_params, stored_moments), out_shardings=step.shardings
        )
        return compiled, from_model, target


def _map_like(f: Callable[[Any], Any], tree: Any, like: Any) -> Any:
    """Applies ``f`` to every subtree of ``tree`` with the structure and shapes of ``like`` (an optimizer
    state's moments mirror the parameters), leaving the rest (counts, schedules) as it is."""
    structure, shapes = jax.tree.structure(like), [np.shape(x) for x in jax.tree.leaves(like)]

    def mirrors(node: Any) -> bool:
        return jax.tree.structure(node) == structure and [np.shape(x) for x in jax.tree.leaves(node)] == shapes

    return jax.tree.map(lambda node: f(node) if mirrors(node) else node, tree, is_leaf=mirrors)


class Checkpoints:
    """Saves and restores a training state in ``directory`` (kept: the ``keep`` latest), with a JSON record.

    >>> import tempfile, numpy as np
    >>> with tempfile.TemporaryDirectory() as d:
    ...     ck = Checkpoints(d, asynchronous=False)
    ...     ck.save(3, {"w": np.arange(4.0)}, {"model": "toy"})
    ...     step, state, record = ck.restore({"w": jax.ShapeDtypeStruct((4,), "float64")})
    ...     ck.close()
    >>> step, state["w"].tolist(), record["model"]
    (3, [0.0, 1.0, 2.0, 3.0], 'toy')
    """

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
        ``ModelLayout(step).abstract()``), and its record. Raises :class:`CheckpointError` when there is nothing
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
