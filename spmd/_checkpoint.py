"""Checkpoints with orbax: the training state and the plan, saved asynchronously and atomically, restored onto
whatever mesh and plan the run has now.

A checkpoint holds the training state in the model's own layout (parameters as the model has them, each optimizer
moment shaped like its parameter, the step; see :class:`ModelLayout`) and a JSON record of what made it:
the state's paths and shapes, the plan and the mesh. Restoring builds the targets from the *current* training
step, with the shardings of its own layout, so orbax reads each array straight onto the new mesh, and the step
lays it out as its plan stores it: saved under ``fsdp=8``, resumed under ``data=2,tensor=4`` or as a pipeline.
Orbax writes a step to a temporary directory and renames it when complete, so a save killed halfway leaves the
previous checkpoint as the latest.

Nothing is lost or loaded silently wrong: the directory is locked while a run holds it open (a second writer is
refused at once; the lock dies with its process, so a killed run leaves none behind); every saved array's
checksum goes into the record and restore verifies it, naming a corrupt array and the previous step to resume
from instead; a state holding NaN or inf is never saved.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd._layout import pad, stored_abstract, unpad
from spmd._mesh import retyped
from spmd._tree import unbox

if TYPE_CHECKING:
    from spmd._train import TrainState, TrainStep

__all__ = ["CheckpointError", "Checkpoints", "ModelLayout", "digests"]

_LOCK = ".spmd-lock"  # in the checkpoint directory; orbax reads only the steps' directories
_COMMITTED = "_CHECKPOINT_METADATA"  # what orbax writes into each step it saved


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
    """After a failed restore or save, orbax has closed its event loop while the reads or writes of the other
    arrays are still in flight; each one that completes tries to schedule a callback on the closed loop and
    prints a traceback. Wait for them with standard error silenced, so the error that matters is the only thing
    the user sees."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            time.sleep(seconds)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@jax.jit
def _digest_arrays(tree: Any) -> tuple[list[jax.Array], list[jax.Array]]:
    def digest(x: jax.Array) -> jax.Array:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if jnp.iscomplexobj(x):
            x = jnp.stack([x.real, x.imag], axis=-1)
        if x.dtype != jnp.bool_ and jax.dtypes.itemsize_bits(x.dtype) < 8:
            x = x.astype(jnp.int8 if jnp.issubdtype(x.dtype, jnp.integer) else jnp.float32)  # int4, float4: exact
        if x.dtype == jnp.bool_:
            words = x.astype(jnp.uint32)
        elif x.dtype.itemsize >= 4:  # 64-bit values become pairs of words
            words = jax.lax.bitcast_convert_type(x, jnp.uint32)
        else:
            words = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
        # A sum and a position-weighted sum of the bits (Fletcher's idea), wrapping modulo 2**32: exact integer
        # arithmetic, so the result is the same whatever the order of the reduction and the array's sharding.
        position = jnp.arange(1, words.size + 1, dtype=jnp.uint32).reshape(words.shape)
        return jnp.stack([words.sum(dtype=jnp.uint32), (words * position).sum(dtype=jnp.uint32)])

    def bad(x: jax.Array) -> jax.Array:  # (holds NaN, holds inf)
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.zeros(2, bool)
        return jnp.stack([jnp.any(jnp.isnan(x)), jnp.any(jnp.isinf(x))])

    leaves = [_on_device(jnp.asarray(x)) for x in jax.tree.leaves(tree)]
    return [digest(x) for x in leaves], [bad(x) for x in leaves]


def _on_device(x: jax.Array) -> jax.Array:
    """An offloaded array (in host memory) moved to the device for arithmetic, which runs in one memory space."""
    return jax.device_put(x, jax.memory.Space.Device) if jax.typeof(x).memory_space == jax.memory.Space.Host else x


def digests(tree: Any) -> tuple[dict[str, str], list[str]]:
    """A checksum of every array of ``tree`` by path (computed where the arrays are, without gathering them;
    the same for any sharding of the same values), and the paths of the arrays that must not be saved: those
    holding NaN, and parameters (paths starting ``.params``, as a TrainState's) holding inf. An optimizer state
    may hold inf on purpose (a best value not yet seen).

    >>> nan, inf = np.array([np.nan], np.float32), np.array([np.inf], np.float32)
    >>> sums, bad = digests({"w": np.arange(4.0, dtype=np.float32), "v": nan, "best": inf})
    >>> sorted(sums), bad
    (["['best']", "['v']", "['w']"], ["['v']"])
    >>> digests({"w": np.arange(4.0, dtype=np.float32) + 1})[0]["['w']"] == sums["['w']"]  # another value
    False
    """
    sums, flags = jax.device_get(_digest_arrays(tree))
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    text = {path: f"{int(s[0]):08x}{int(s[1]):08x}" for path, s in zip(paths, sums, strict=True)}
    bad = [p for p, (nan, inf) in zip(paths, flags, strict=True) if nan or (inf and p.startswith(".params"))]
    return text, bad


def _lock(directory: str) -> int:
    """Creates ``directory`` if needed and takes its lock (an flock, released when the process ends however
    it ends); returns the lock's descriptor. Raises :class:`CheckpointError` when the directory cannot be
    written, or when another process holds it."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise CheckpointError(
            f"--checkpoint-dir {directory}: cannot write there ({e.strerror}); choose a writable directory"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        if holder.startswith(f"process {os.getpid()} "):
            holder = "a Checkpoints of this very process, not yet closed"
        raise CheckpointError(
            f"--checkpoint-dir {directory} is in use by another run ({holder}); wait for it to end, or choose "
            f"another --checkpoint-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
    return fd


def _first_line(e: Exception) -> str:
    """An exception in a few words: the first line, without TensorStore's pointer to its details."""
    text = (str(e).splitlines() or [""])[0].split(". See full")[0]
    return f"{type(e).__name__}: {text[:200]}"


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(path), x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


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
    >>> step = spmd.TrainStep(lambda p, b: 0.0, optax.adam(0.1), spmd.Plan(batch_axes=("data",)), mesh, params=params)
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
        # The conversions index whole arrays, which Explicit axes would ask to annotate one by one.
        return state if self.is_identity else self.step.on_auto_axes(self._conversions[0], state)

    def from_model(self, state: TrainState) -> TrainState:
        """The inverse of :meth:`to_model`: the state as the step's plan stores it, in its shardings."""
        return state if self.is_identity else self.step.on_auto_axes(self._conversions[1], state)

    def abstract(self) -> TrainState:
        """ShapeDtypeStructs (with shardings) of :meth:`to_model`'s result: targets to restore into."""
        return self.step.abstract_state() if self.is_identity else retyped(self._conversions[2], self.step.mesh)

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
        stored = retyped(step.abstract_state(), step.traced_mesh)
        compiled = to_model.lower(stored).compile()
        target = jax.tree.map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(to_model, stored),
            compiled.output_shardings,
        )
        from_model = jax.jit(
            lambda s: convert(s, target.params, stored_params, stored_moments),
            out_shardings=retyped(step.shardings, step.traced_mesh),
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
    The directory is locked from construction to :meth:`close` (only the first process of a multi-process
    job takes the lock, as it is the one that commits the saves).

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
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"--checkpoint-dir {directory}: it is a file, not a directory; choose a directory")
        self._lock = _lock(self.directory) if jax.process_index() == 0 else None
        try:
            if self._lock is not None:
                # Holding the lock, no other run is writing here: the temporary directory of a step left
                # unfinished (a save killed, or failed for lack of space) is garbage, and its space is needed.
                # Orbax's own cleanup_tmp_directories leaves these (measured with orbax-checkpoint 0.12.8).
                for name in os.listdir(self.directory):
                    if ".orbax-checkpoint-tmp" in name:
                        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            options = ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=asynchronous, cleanup_tmp_directories=True
            )
            self._ocp = ocp
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except BaseException:
            self._release()
            raise

    def save(self, step: int, state: Any, record: dict[str, Any]) -> None:
        """Starts saving ``state`` as ``step`` (returns while orbax writes in the background), with the
        checksum of every array in the record. Raises :class:`CheckpointError`, saving nothing, when an array
        holds NaN or inf, or when ``step`` is not after the latest saved step (orbax would skip it)."""
        ocp = self._ocp
        latest = self.latest()
        if latest is not None and step <= latest:
            raise CheckpointError(
                f"checkpoint step {step}: {self.directory} already holds step {latest}; saving would not replace "
                f"it: resume from it, or save into another directory"
            )
        sums, nonfinite = digests(state)
        if nonfinite:
            kept = f"step {latest} stays the latest" if latest is not None else "nothing was saved"
            raise CheckpointError(
                f"checkpoint step {step} not saved: state{nonfinite[0]} holds NaN or inf ({len(nonfinite)} "
                f"array(s) in all); {kept}; lower the learning rate, or skip such steps (--on-nan skip)"
            )
        dtypes = {path: str(np.dtype(_dtype(x))) for path, x in _leaves(state)}
        record = {**record, "state": _paths(state), "dtypes": dtypes, "checksums": sums}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record))
        self._saving(lambda: self.manager.save(step, args=args))

    def wait(self) -> None:
        """Waits for the saves in flight; raises :class:`CheckpointError` if one failed."""
        self._saving(self.manager.wait_until_finished)

    def _saving(self, action: Callable[[], Any]) -> Any:
        """Runs an orbax call that completes saves (a failure in the background surfaces at the next call),
        turning a failure into one line: what failed, and which step is the latest whole one."""
        try:
            return action()
        except Exception as e:  # noqa: BLE001 - orbax raises what its storage layer raised
            _let_pending_reads_finish()
            cause = (str(e).splitlines() or [type(e).__name__])[0].rsplit(": ", 1)[-1][:200]
            latest = self.manager.latest_step()
            kept = f"step {latest} is the latest whole checkpoint" if latest is not None else "none is whole"
            raise CheckpointError(
                f"saving a checkpoint into {self.directory} failed ({cause}); {kept}; make room there (or fix what "
                f"the cause names) and --resume, or start again in another --checkpoint-dir"
            ) from None

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def record(self, step: int) -> dict[str, Any]:
        """The JSON record saved with ``step`` (what made it: model, plan, mesh, the run's settings, the
        state's paths, shapes and checksums)."""
        try:
            args = self._ocp.args.Composite(record=self._ocp.args.JsonRestore())
            return self.manager.restore(step, args=args)["record"]
        except Exception as e:  # noqa: BLE001 - any failure to read the record means the checkpoint is unusable
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} cannot be read ("
                f"{_first_line(e)}); it is corrupt or incomplete: "
                f"{self._instead(step)}"
            ) from None

    def not_checkpoints(self) -> list[str]:
        """Directories named like steps that orbax did not save (someone else's, in the same directory)."""
        paths = [os.path.join(self.directory, str(step)) for step in self.steps()]
        return [path for path in paths if not os.path.exists(os.path.join(path, _COMMITTED))]

    def clear(self) -> None:
        """Deletes every saved step (what ``--overwrite`` asks for). A directory named like a step that orbax
        did not write is not a checkpoint: it is named in an error, and nothing is deleted."""
        self.manager.wait_until_finished()
        foreign = self.not_checkpoints()
        if foreign:
            raise CheckpointError(
                f"--overwrite: {foreign[0]} is not a checkpoint; it stays, and so do the checkpoints: move it out "
                f"of {self.directory}, or use another --checkpoint-dir"
            )
        for step in self.steps():
            self.manager.delete(step)

    def restore(self, target: Any) -> tuple[int, Any, dict[str, Any]]:
        """The latest step, its state read into ``target``'s shapes and shardings (ShapeDtypeStructs, e.g.
        ``ModelLayout(step).abstract()``), and its record. Raises :class:`CheckpointError` when there is nothing
        to resume, when it was saved from another model, or when it cannot be read or fails its checksums."""
        try:
            return self._restore(target)
        except CheckpointError:
            self.close()  # its background threads would otherwise outlive the error
            raise

    def _restore(self, target: Any) -> tuple[int, Any, dict[str, Any]]:
        ocp = self._ocp
        step = self.latest()
        if step is None:
            raise CheckpointError(
                f"--resume: no checkpoint in {self.directory}; run without --resume first (with --checkpoint-dir)"
            )
        record = self.record(step)
        self._check_same_model(record, target, step)
        try:
            state = ocp.args.Composite(state=ocp.args.StandardRestore(target))
            restored = self.manager.restore(step, args=state)["state"]
        except Exception as e:  # noqa: BLE001
            _let_pending_reads_finish()
            raise CheckpointError(
                f"--resume: the state of checkpoint step {step} in {self.directory} cannot be read "
                f"({_first_line(e)}); it is corrupt: "
                f"{self._instead(step)}"
            ) from None
        saved = record.get("checksums")
        if saved is not None:  # checkpoints written before checksums were recorded have none to verify
            now, _ = digests(restored)
            bad = [path for path in saved if now.get(path) != saved[path]]
            if bad:
                raise CheckpointError(
                    f"--resume: checkpoint step {step} in {self.directory} is corrupt: state{bad[0]} does not "
                    f"match the checksum it was saved with ({len(bad)} array(s) in all); {self._instead(step)}"
                )
        return step, restored, record

    def _instead(self, step: int) -> str:
        """What to do about a step that cannot be used: resume from the one before it, if there is one."""
        path = os.path.join(self.directory, str(step))
        earlier = [s for s in self.steps() if s < step]
        if earlier:
            return f"move {path} aside to resume from step {earlier[-1]}"
        return f"no earlier step is kept: move {path} aside and start again"

    def _check_same_model(self, record: dict[str, Any], target: Any, step: int) -> None:
        saved, now = record.get("state", {}), _paths(target)
        for path, x in _leaves(target):  # checkpoints saved before dtypes were recorded have none to compare
            was = record.get("dtypes", {}).get(path)
            if was is not None and was != str(np.dtype(_dtype(x))):
                raise CheckpointError(
                    f"--resume: checkpoint step {step} in {self.directory} holds state{path} as {was}, and this "
                    f"run wants {np.dtype(_dtype(x))}; resume with the precision it was saved in"
                )
        for path in [*saved, *(p for p in now if p not in saved)]:  # in the state's order: parameters first
            if saved.get(path) != now.get(path):
                was = "absent" if path not in saved else f"shape {tuple(saved[path])}"
                is_ = "absent" if path not in now else f"shape {tuple(now[path])}"
                raise CheckpointError(
                    f"--resume: checkpoint step {step} in {self.directory} was saved from another model or optimizer: "
                    f"state{path} is {was} there but {is_} here (saved: {record.get('model')}, "
                    f"{record.get('plan')}); resume with the same model and optimizer, or use a new --checkpoint-dir"
                )

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Waits for the saves in flight, then releases the directory (whether or not a save failed: the
        failure is raised as :class:`CheckpointError`)."""
        try:
            self.wait()
        finally:
            with contextlib.suppress(Exception):  # a failed save's error was raised by wait()
                self.manager.close()
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None
