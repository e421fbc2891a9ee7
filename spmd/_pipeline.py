"""Runs any valid pipeline schedule inside one SPMD program.

The model's stacked layers are cut into ``p·v`` consecutive stages and stored as one array per parameter laid
out ``[stage device, chunk, layer, ...]``, the leading dimension split over the pipeline mesh axis, so each
device holds only its own chunks (stages may hold different numbers of layers: shorter ones are padded and
never computed). A ``shard_map`` over that axis alone (the other mesh axes stay automatic, so data, FSDP and
tensor parallelism compose unchanged) walks the schedule's ticks in a ``lax.scan``: each tick every device
picks its action from a per-device table with ``lax.switch`` (idle, F, B, W, BW), then all devices exchange
activations and input gradients with their ring neighbours by ``lax.ppermute``.

Stage inputs are kept in slots (a slot lives from the arrival of a microbatch's input or input gradient to
the end of its W), assigned ahead of time from the schedule, so a device's buffers hold exactly its peak of
held microbatches. F computes forward; B and W recompute the chunk's forward from the kept input and take two
separate gradients — to the input (sent back at once) and to the weights (deferrable), so zero-bubble
schedules really defer the weight gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd import axes as names
from spmd._context import constrain
from spmd._executor import Executor, Summary, Task
from spmd._format import format_bytes
from spmd._layout import StateLayout, stored_abstract
from spmd._resolve import PlanWarning
from spmd._rules import PlanError
from spmd._schedule import Action, Costs, Schedule, ScheduleError, simulate
from spmd._tree import is_box, leaves_with_paths
from spmd.costmodel import Contribution, Workload, data_parallel_traffic, pipeline_tick_bytes, pipeline_traffic

if TYPE_CHECKING:
    from spmd._specs import PipelineSpec

__all__ = ["Pipeline", "StagedModel", "TickProgram", "pipeline_executor", "split_layers", "tick_program"]

# Action codes of the tick table and of the switch's branches.
IDLE, F, B, W, BW = range(5)
TICK_SCOPE = "spmd_pipeline_tick"  # named scope of the tick switch, found again in the compiled program
CODES = {"F": F, "B": B, "W": W, "BW": BW}
FIELDS = ("kind", "microbatch", "chunk", "slot", "first", "last", "branch", "recv_forward", "recv_backward")


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """A model cut for pipelining: what runs before its stacked layers, one layer, and the head with the loss.

    - ``embed(params, microbatch) -> x``: the first stage's input (``params`` is the whole tree; the stacked
      layers in it are not to be used);
    - ``layer(layer_params, x) -> x``: one of the stacked layers (one slice of every leaf under ``layers_key``);
    - ``loss(params, x, microbatch) -> scalar``: the mean loss of a microbatch from the last layer's output;
    - ``layers_key``: the path of the stacked layers in the parameter tree (leading dimension = layer);
    - ``activation_names``: logical names of ``x``'s dimensions (e.g. ``("batch", "seq", "embed")``), which lay
      out the kept stage inputs as the model lays out its activations.

    >>> from spmd import models
    >>> staged = models.get("gpt-tiny", layers=2).staged  # the built-in GPT, cut for pipelining
    >>> staged.layers_key, staged.activation_names
    (('params', 'layers'), ('batch', 'seq', 'embed'))
    """

    embed: Callable[[Any, Any], jax.Array]
    layer: Callable[[Any, jax.Array], jax.Array]
    loss: Callable[[Any, jax.Array, Any], jax.Array]
    layers_key: tuple[str, ...] = ("params", names.LAYERS)
    activation_names: tuple[str | None, ...] | None = None


def _get(tree: Any, keys: Sequence[str]) -> Any:
    for k in keys:
        tree = tree[k]
    return tree


def _set(tree: Any, keys: Sequence[str], value: Any) -> Any:
    if not keys:
        return value
    return {**tree, keys[0]: _set(tree[keys[0]], keys[1:], value)}


# ------------------------------------------------------------------------------------------ layer placement
def split_layers(layers: int, stages: int, counts: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per global stage: ``counts`` checked, or an even split.

    >>> split_layers(8, 4), split_layers(8, 4, (3, 3, 1, 1))
    ((2, 2, 2, 2), (3, 3, 1, 1))
    """
    if counts is None:
        if layers % stages:
            raise ScheduleError(
                f"pipeline: {layers} layers do not split evenly over {stages} stages; change the number of "
                f"layers (e.g. --layers {stages * max(1, round(layers / stages))}) or give layers per stage"
            )
        return (layers // stages,) * stages
    counts = tuple(int(c) for c in counts)
    if len(counts) != stages or any(c < 0 for c in counts) or sum(counts) != layers:
        raise ScheduleError(
            f"pipeline: layers per stage {list(counts)} must be {stages} non-negative counts summing to the "
            f"model's {layers} layers"
        )
    return counts


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which of the model's layers each (device, chunk) holds, padded to the longest stage."""

    schedule: Schedule
    counts: tuple[int, ...]  # per global stage

    @property
    def longest(self) -> int:
        return max(max(self.counts), 1)

    @functools.cached_property
    def index(self) -> np.ndarray:
        """``[p, v, longest]`` layer indices; -1 marks padding."""
        s = self.schedule
        starts = np.concatenate([[0], np.cumsum(self.counts)])
        out = np.full((s.stages, s.virtual, self.longest), -1, np.int64)
        for d in range(s.stages):
            for c in range(s.virtual):
                g = s.stage_of(d, c)
                out[d, c, : self.counts[g]] = np.arange(starts[g], starts[g + 1])
        return out

    def stack(self, x: jax.Array) -> jax.Array:
        """``[layers, ...]`` -> ``[p, v, longest, ...]`` with zeros in the padding."""
        idx = self.index
        taken = jnp.take(x, np.maximum(idx, 0).reshape(-1), axis=0).reshape(*idx.shape, *x.shape[1:])
        mask = (idx >= 0).reshape(*idx.shape, *([1] * (x.ndim - 1)))
        return jnp.where(mask, taken, jnp.zeros((), x.dtype))

    def unstack(self, x: jax.Array) -> jax.Array:
        """The inverse of :meth:`stack`."""
        flat = self.index.reshape(-1)
        order = np.argsort(np.where(flat < 0, len(flat), flat), kind="stable")[: int(sum(self.counts))]
        return jnp.take(x.reshape(-1, *x.shape[3:]), order, axis=0)

    @functools.cached_property
    def branches(self) -> tuple[int, ...]:
        """The distinct layer counts of the stages: one switch branch each."""
        return tuple(sorted(set(self.counts)))


# ---------------------------------------------------------------------------------------------- tick table
@dataclasses.dataclass(frozen=True)
class TickProgram:
    """The schedule compiled to ticks: ``table[tick, device]`` holds the :data:`FIELDS`; ``slots`` is the
    number of stage-input slots each device needs.

    >>> import strategies
    >>> s = strategies.pipeline_schedule("gpipe", stages=2, microbatches=2)
    >>> tick_program(s, Placement(s, (1, 1))).actions()  # [tick][device]
    [['F0', None], ['F1', 'F0'], [None, 'F1'], [None, 'BW0'], ['BW0', 'BW1'], ['BW1', None]]
    """

    table: np.ndarray
    slots: int

    @property
    def ticks(self) -> int:
        return self.table.shape[0]

    def actions(self) -> list[list[str | None]]:
        """The table as ``[tick][device]`` action strings (``"F3"``, ``"B3.1"``) or None, like the simulator's."""
        names = {v: k for k, v in CODES.items()}
        return [
            [
                None if row[0] == IDLE else f"{names[int(row[0])]}{row[1]}" + (f".{row[2]}" if row[2] else "")
                for row in tick
            ]
            for tick in self.table
        ]


def tick_program(schedule: Schedule, placement: Placement) -> TickProgram:
    """Each action runs in the tick the simulator gives it at unit cost; a result sent in tick ``t`` is stored
    by its receiver at the end of ``t``. Slots are assigned by interval colouring (optimal: the number of slots
    is the peak of held inputs).

    >>> import strategies
    >>> s = strategies.pipeline_schedule("1f1b", stages=4, microbatches=8)
    >>> program = tick_program(s, Placement(s, (1, 1, 1, 1)))  # one layer per stage
    >>> program.ticks, program.slots, simulate(s).peak_inflight  # device 0 holds 4 stage inputs at most
    (22, 4, (4, 3, 2, 1))
    """
    v = schedule.virtual  # a chunk's op costs 1/v of a stage's: scale so that every op takes one tick
    timeline = simulate(schedule, Costs(F=v, B=v, W=v, BW=v))
    table = timeline.ticks()
    p, last_stage = schedule.stages, schedule.total_stages - 1
    tick_of = {(d, a): t for t, row in enumerate(table) for d, a in enumerate(row) if a is not None}
    grad_kind = {
        (schedule.stage_of(d, a.chunk), a.microbatch): a.kind
        for d, row in enumerate(schedule.actions)
        for a in row
        if a.kind in ("B", "BW")
    }
    out = np.zeros((len(table), p, len(FIELDS)), np.int32)
    out[..., FIELDS.index("recv_forward")] = -1
    out[..., FIELDS.index("recv_backward")] = -1
    slots = 1
    for d, row in enumerate(schedule.actions):
        # (acquire tick, release tick, key, arrivals) per microbatch-chunk held on this device.
        held = []
        for a in row:
            if a.kind not in ("W", "BW"):
                continue
            s, mb = schedule.stage_of(d, a.chunk), a.microbatch
            arrivals = []
            if s > 0:
                src, chunk = schedule.where(s - 1)
                arrivals.append((tick_of[src, Action("F", mb, chunk)], "recv_forward"))
            if s < last_stage:
                src, chunk = schedule.where(s + 1)
                arrivals.append((tick_of[src, Action(grad_kind[s + 1, mb], mb, chunk)], "recv_backward"))
            if arrivals:
                held.append((min(t for t, _ in arrivals), tick_of[d, a], (mb, a.chunk), arrivals))
        slot_of: dict[tuple[int, int], int] = {}
        free: list[tuple[int, int]] = []  # (release tick, slot)
        count = 0
        for acquire, release, key, arrivals in sorted(held):
            reusable = [f for f in free if f[0] <= acquire]
            if reusable:
                free.remove(min(reusable))
                slot = min(reusable)[1]
            else:
                slot, count = count, count + 1
            free.append((release, slot))
            slot_of[key] = slot
            for t, field in arrivals:
                out[t, d, FIELDS.index(field)] = slot
        slots = max(slots, count)
        for a in row:
            t, s = tick_of[d, a], schedule.stage_of(d, a.chunk)
            out[t, d, :7] = (
                CODES[a.kind],
                a.microbatch,
                a.chunk,
                slot_of.get((a.microbatch, a.chunk), 0),
                s == 0,
                s == last_stage,
                placement.branches.index(placement.counts[s]),
            )
    return TickProgram(out, slots)


# ------------------------------------------------------------------------------------------------ executor
class _Device(NamedTuple):
    """What every tick of one device's program reads: its chunks' weights, the replicated outer parameters,
    the microbatches, one layer-stack function per stage depth, and how to lay out kept stage inputs."""

    weights: Any
    outer: Any
    micro: Any
    depths: list[Callable]
    lay_out: Callable[[jax.Array], jax.Array]
    replicate: Callable[[Any], Any]
    shards: int


class Pipeline:
    """The engine for one model, pipeline spec and mesh: restacks parameters, and gives the loss and the
    gradients of a batch computed by running the schedule (``value_and_grad``).

    ``data_axes``: batch axes that split no parameter. The program is manual over them too, so each device
    sums its own microbatches' weight gradients and they are reduced once, after the last tick, rather than by
    XLA at every W.

    >>> import spmd, strategies
    >>> mesh = spmd.make_mesh({"stage": 2, "data": -1})
    >>> engine = Pipeline(None, strategies.pipeline("1f1b", stages=2, microbatches=4).execution, mesh, layers=4)
    >>> engine.placement.counts, engine.program.ticks
    ((2, 2), 10)
    """

    def __init__(
        self, staged: StagedModel, spec: PipelineSpec, mesh: Mesh, layers: int, data_axes: Sequence[str] = ()
    ) -> None:
        if spec.axis not in mesh.shape:
            raise ScheduleError(f"pipeline: the mesh has no axis {spec.axis!r} ({dict(mesh.shape)})")
        if mesh.shape[spec.axis] != spec.schedule.stages:
            raise ScheduleError(
                f"pipeline: schedule {spec.schedule.name} is for {spec.schedule.stages} stages but mesh axis "
                f"{spec.axis!r} has {mesh.shape[spec.axis]} devices"
            )
        self.staged, self.spec, self.mesh, self.data_axes = staged, spec, mesh, tuple(data_axes)
        counts = split_layers(layers, spec.schedule.total_stages, spec.layers_per_stage)
        self.placement = Placement(spec.schedule, counts)
        self.program = tick_program(spec.schedule, self.placement)

    # -- parameter layout ---------------------------------------------------------------------------------
    def stack(self, params: Any) -> Any:
        """The model's parameters (boxed, plain or abstract) with the stacked layers laid out per stage."""
        stacking = (names.STAGE, names.CHUNK)

        def one(x: Any) -> Any:
            if is_box(x):
                value = one_value(x.value)
                return x.replace(value=value, names=stacking + tuple(x.names))
            return nn.LogicallyPartitioned(one_value(x), stacking + (names.LAYERS,) + (None,) * (np.ndim(x) - 1))

        def one_value(v: Any) -> Any:
            if isinstance(v, jax.ShapeDtypeStruct):
                return jax.eval_shape(self.placement.stack, v)
            return self.placement.stack(v)

        layers = jax.tree.map(one, _get(params, self.staged.layers_key), is_leaf=is_box)
        return _set(params, self.staged.layers_key, layers)

    def unstack(self, params: Any) -> Any:
        """The inverse of :meth:`stack` on plain arrays: the model's own layout."""
        layers = jax.tree.map(self.placement.unstack, _get(params, self.staged.layers_key))
        return _set(params, self.staged.layers_key, layers)

    # -- the step -----------------------------------------------------------------------------------------
    def value_and_grad(self, params: Any, batch: Any) -> tuple[jax.Array, Any]:
        """Loss and gradients of ``batch`` (split into the schedule's microbatches), params as stacked."""
        loss, grads, _ = self._run(params, batch)
        return loss, grads

    def executed(self, params: Any, batch: Any) -> np.ndarray:
        """Runs the schedule once and returns ``[tick, device]`` the action code each device's switch took."""
        _, _, codes = jax.jit(self._run)(params, batch)
        return np.asarray(codes).T

    @property
    def branch_weights(self) -> tuple[float, ...]:
        """The share of ticks in which a device takes each branch of the tick switch (idle, F, B, W, BW): the
        same on every device, since each runs every microbatch of each of its chunks once."""
        kinds = self.program.table[:, 0, 0]
        return tuple(float(np.mean(kinds == code)) for code in (IDLE, F, B, W, BW))

    def _microbatches(self, batch: Any) -> Any:
        m = self.spec.schedule.microbatches

        def split(x: jax.Array) -> jax.Array:
            if x.shape[0] % m:
                raise ScheduleError(
                    f"pipeline: batch of {x.shape[0]} rows cannot be split into {m} microbatches; make the batch "
                    f"a multiple of {m}"
                )
            # Row r = i·m + k goes to microbatch k: each device's batch shard splits locally, with no exchange.
            return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)

        return jax.tree.map(split, batch)

    def activation(self, params: Any, batch: Any) -> jax.ShapeDtypeStruct:
        """One device's stage input (a kept slot, a message between stages) for this batch."""
        first = lambda batch: jax.tree.map(lambda x: x[0], self._microbatches(batch))  # noqa: E731
        x = jax.eval_shape(lambda p, b: self.staged.embed(p, first(b)), params, batch)
        shards = math.prod(self.mesh.shape[a] for a in self.data_axes)
        return jax.ShapeDtypeStruct((x.shape[0] // shards, *x.shape[1:]), x.dtype)

    def weight_uses(self) -> tuple[float, float]:
        """Per step, how many times a device uses its chunks' weights and makes their gradients, in whole
        stacks of its chunks: every F uses them once, every B, W or BW twice (it recomputes the chunk's forward,
        then differentiates it), and every W or BW makes a gradient. What FSDP gathers and reduces inside the
        stages.

        >>> import spmd, strategies
        >>> mesh = spmd.make_mesh({"stage": 2, "data": -1})
        >>> plan = strategies.pipeline("zb-h1", stages=2, microbatches=4)
        >>> Pipeline(None, plan.execution, mesh, layers=4).weight_uses()  # 4 F, 4 B, 4 W
        (20.0, 4.0)
        """
        s = self.spec.schedule
        actions = s.actions[0]  # every device runs each microbatch of each of its chunks once
        uses = sum(1 if a.kind == "F" else 2 for a in actions)
        grads = sum(a.kind in ("W", "BW") for a in actions)
        return uses / s.virtual, grads / s.virtual

    def figures(self) -> dict[str, Any]:
        """The schedule's figures: simulated with unit op costs, and as the executor runs it."""
        s = self.spec.schedule
        timeline = simulate(s)
        return {
            "schedule": s.name,
            "stages": s.stages,
            "microbatches": s.microbatches,
            "virtual": s.virtual,
            "layers_per_stage": list(self.placement.counts),
            "bubble_fraction": float(timeline.bubble_fraction),
            "peak_inflight": list(timeline.peak_inflight),
            "peak_held": list(timeline.peak_held),
            "ticks": self.program.ticks,
            "slots": self.program.slots,
        }

    def _run(self, params: Any, batch: Any) -> tuple[jax.Array, Any, jax.Array]:
        axis, data_axes = self.spec.axis, self.data_axes
        micro = self._microbatches(batch)
        stacked = _get(params, self.staged.layers_key)
        outer = _set(params, self.staged.layers_key, None)
        x_abstract = self.activation(params, batch)
        batch_spec = PartitionSpec(None, data_axes or None)
        run = jax.shard_map(
            functools.partial(self._body, x_abstract=x_abstract),
            mesh=self.mesh,
            in_specs=(PartitionSpec(axis), PartitionSpec(), batch_spec, PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(axis), PartitionSpec(), PartitionSpec(axis)),
            axis_names={axis, *data_axes},
            check_vma=False,
        )
        loss, grad_layers, grad_outer, codes = run(stacked, outer, micro, jnp.asarray(self.program.table))
        return loss, _set(grad_outer, self.staged.layers_key, grad_layers), codes

    def _body(self, stacked: Any, outer: Any, micro: Any, table: jax.Array, *, x_abstract: Any) -> tuple:
        axis, data_axes = self.spec.axis, self.data_axes
        # The embedding and the head run inside the switch's branches, on one stage's devices only. A collective
        # there that spans every stage (XLA writes each collective-permute for all devices) would wait forever
        # for the devices in other branches, so they are gathered whole here, once, and the kept stage inputs
        # take the activations' own layout: inside a branch only the layers' collectives remain, each within
        # one stage's devices.
        whole = NamedSharding(jax.sharding.get_abstract_mesh(), PartitionSpec())
        replicate = lambda tree: jax.lax.with_sharding_constraint(tree, whole)  # noqa: E731
        logical = self.staged.activation_names
        lay_out = (lambda x: constrain(x, (None, *logical))) if logical else (lambda x: x)  # noqa: E731
        device = _Device(
            weights=jax.tree.map(lambda a: a[0], stacked),  # this device's [chunk, layer, ...]
            outer=replicate(outer),
            micro=micro,
            # One branch per distinct stage depth, so a shallower stage really computes less.
            depths=[functools.partial(self._layers, count=k) for k in self.placement.branches],
            lay_out=lay_out,
            replicate=replicate,
            # Each device's loss is the mean over its own rows: the mean over all is their mean over data_axes.
            shards=math.prod(self.mesh.shape[a] for a in data_axes),
        )
        slots = lay_out(jnp.zeros((self.program.slots, *x_abstract.shape), x_abstract.dtype))
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        init = (slots, slots, zeros(device.weights), replicate(zeros(outer)), jnp.zeros((), jnp.float32))
        rows = table[:, jax.lax.axis_index(axis)]
        (_, _, grad_w, grad_outer, loss), codes = jax.lax.scan(functools.partial(self._tick, device), init, rows)
        # The loss lives on the last stage, the embedding's gradient on the first, the head's on the last; each
        # data shard holds its own rows' share of all three.
        loss, grad_outer = jax.lax.psum((loss, grad_outer), axis)
        if data_axes:  # one reduction of everything, as data parallelism makes
            loss, grad_outer, grad_w = jax.lax.psum((loss, grad_outer, grad_w), data_axes)
        return loss, jax.tree.map(lambda g: g[None], grad_w), grad_outer, codes[None]

    def _tick(self, device: _Device, carry: tuple, row: jax.Array) -> tuple:
        """One tick of one device: its action (a switch over idle, F, B, W, BW), then both ring exchanges."""
        staged, p, m = self.staged, self.spec.schedule.stages, self.spec.schedule.microbatches
        inputs, grads_in, grad_w, grad_outer, loss = carry
        kind, mb, chunk, slot, first, last, branch, recv_f, recv_b = (row[i] for i in range(len(FIELDS)))
        batch = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, mb, 0, keepdims=False), device.micro)
        w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, chunk, 0, keepdims=False), device.weights)
        x_in, g_out, outer = inputs[slot], grads_in[slot], device.outer

        def forward(w: Any, outer: Any, x_in: jax.Array) -> jax.Array:
            x = jnp.where(first, staged.embed(outer, batch), x_in)
            depths = device.depths
            return depths[0](w, x) if len(depths) == 1 else jax.lax.switch(branch, depths, w, x)

        def head(outer: Any, y: jax.Array) -> jax.Array:
            return staged.loss(outer, y, batch) / (m * device.shards)

        def objective(w: Any, outer: Any, x_in: jax.Array) -> jax.Array:
            # The backward of a stage is the gradient of this scalar: the microbatch's share of the loss on the
            # last stage, else the output paired with the output gradient the next stage sent.
            y = forward(w, outer, x_in)
            return jax.lax.cond(last, head, lambda _, y: jnp.vdot(y, g_out).astype(jnp.float32), outer, y)

        def accumulate(dw: Any) -> Any:
            return jax.tree.map(lambda acc, g: acc.at[chunk].add(g), grad_w, dw)

        zeros = jnp.zeros_like(x_in)
        no_loss = lambda *_: jnp.zeros((), jnp.float32)  # noqa: E731

        def idle() -> tuple:
            return zeros, zeros, grad_w, grad_outer, loss, IDLE

        def fwd() -> tuple:
            y = forward(w, outer, x_in)
            return y, zeros, grad_w, grad_outer, loss + jax.lax.cond(last, head, no_loss, outer, y), F

        def input_grad() -> tuple:
            return zeros, jax.grad(objective, argnums=2)(w, outer, x_in), grad_w, grad_outer, loss, B

        def weight_grad() -> tuple:
            dw, douter = jax.grad(objective, argnums=(0, 1))(w, outer, x_in)
            return zeros, zeros, accumulate(dw), _add(grad_outer, device.replicate(douter)), loss, W

        def both() -> tuple:
            dw, douter, dx = jax.grad(objective, argnums=(0, 1, 2))(w, outer, x_in)
            return zeros, dx, accumulate(dw), _add(grad_outer, device.replicate(douter)), loss, BW

        with jax.named_scope(TICK_SCOPE):  # lets the collective inventory weigh the branches by their use
            send_f, send_b, grad_w, grad_outer, loss, code = jax.lax.switch(
                kind, [idle, fwd, input_grad, weight_grad, both]
            )
        # Every device joins both exchanges every tick (collectives stay outside the switch); a receiver keeps
        # what arrives only where the table expects it.
        got_f = jax.lax.ppermute(send_f, self.spec.axis, [(i, (i + 1) % p) for i in range(p)])
        got_b = jax.lax.ppermute(send_b, self.spec.axis, [(i, (i - 1) % p) for i in range(p)])
        inputs = device.lay_out(_store(inputs, recv_f, got_f))
        grads_in = device.lay_out(_store(grads_in, recv_b, got_b))
        return (inputs, grads_in, grad_w, grad_outer, loss), code

    def _layers(self, w: Any, x: jax.Array, *, count: int) -> jax.Array:
        if count == 0:
            return x
        step = lambda x, layer: (self.staged.layer(layer, x), None)  # noqa: E731
        x, _ = jax.lax.scan(step, x, jax.tree.map(lambda a: a[:count], w))
        return x


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """Writes ``value`` into ``buffer[slot]`` when ``slot >= 0``."""
    i = jnp.maximum(slot, 0)
    return buffer.at[i].set(jnp.where(slot >= 0, value, buffer[i]))


# ------------------------------------------------------------------------------------------------ the seam
def pipeline_executor(spec: PipelineSpec, task: Task) -> Executor:
    """The executor of a pipeline plan: stored layers ``[stage, chunk, layer, ...]``, the schedule run in one
    program, and the pipeline's exchanges, kept stage inputs and schedule figures for the cost model and the
    report. The program runs manual over the batch axes that split no parameter (see :class:`Pipeline`).

    >>> import spmd, strategies, jax
    >>> from spmd import models
    >>> model = models.get("gpt-tiny", layers=4)
    >>> plan = strategies.pipeline("1f1b", stages=2, microbatches=4) + strategies.data_parallel()
    >>> params = jax.eval_shape(model.init, jax.random.key(0))
    >>> mesh = spmd.make_mesh({"stage": 2, "data": -1})
    >>> ex = pipeline_executor(plan.execution, spmd.execution.Task(None, plan, mesh, params, staged=model.staged))
    >>> ex.engine.data_axes, ex.to_stored(params)["params"]["layers"]["mlp"]["wi"]["kernel"].value.shape
    (('data',), (2, 1, 2, 64, 256))
    """
    if task.staged is None:
        raise PlanError(
            f"the plan runs a pipeline ({spec.describe()}), which needs the model cut into stages: "
            f"pass staged=model.staged (the built-in GPTs have one; see spmd.pipeline.StagedModel for your own)"
        )
    layers = _layers(task.params, task.staged)
    stacked = Pipeline(task.staged, spec, task.mesh, layers).stack(task.params)
    with warnings.catch_warnings():  # the training step resolves the same layout again, and warns there
        warnings.simplefilter("ignore", PlanWarning)
        split = task.plan.resolve(stacked, task.mesh).leaves
    engine = Pipeline(task.staged, spec, task.mesh, layers, data_axes=_manual_axes(task.plan, split, task.mesh))
    return Executor(
        engine.value_and_grad,
        to_stored=engine.stack,
        to_model=engine.unstack,
        costs=functools.partial(_costs, engine, task.plan),
        summary=functools.partial(_summary, engine, task.plan),
        branch_weights={TICK_SCOPE: engine.branch_weights},
        engine=engine,
    )


def _manual_axes(plan: Any, rows: Sequence[Any], mesh: Mesh) -> tuple[str, ...]:
    """Batch axes that split no parameter: a pipeline runs manual over them and reduces once per step."""
    split = {a for r in rows for a in r.axes}
    return tuple(a for a in plan.batch_axes if a not in split and mesh.shape[a] > 1)


def _layers(params: Any, staged: StagedModel) -> int:
    """The number of stacked layers: the leading dimension of the arrays under ``staged.layers_key``."""
    try:
        sub = functools.reduce(lambda tree, k: tree[k], staged.layers_key, params)
    except (KeyError, TypeError):
        raise PlanError(f"pipeline: no stacked layers at {'/'.join(staged.layers_key)} in the parameters") from None
    leaves, _ = leaves_with_paths(sub)
    sizes = {leaf.shape[0] if leaf.shape else 0 for leaf in leaves}
    if len(sizes) != 1 or 0 in sizes:
        raise PlanError(f"pipeline: the arrays at {'/'.join(staged.layers_key)} must share a leading layer dimension")
    return sizes.pop()


def _message_bytes(engine: Pipeline, plan: Any, layout: StateLayout, batch: Any) -> int:
    """Bytes of one stage input on one device: batch axes the program does not run manual over (those that split
    parameters: FSDP) split the activations further, as the model lays them out."""
    message = engine.activation(stored_abstract(layout.params), batch)
    auto = math.prod(engine.mesh.shape[a] for a in plan.batch_axes if a not in engine.data_axes)
    return math.prod(message.shape) * np.dtype(message.dtype).itemsize // auto


def _costs(engine: Pipeline, plan: Any, layout: StateLayout, batch: Any, workload: Workload) -> Contribution:
    """FSDP inside the stages gathers per action; every tick sends a stage input and an input gradient; the
    parameters outside the stacked layers reduce over the stages once; the slots keep stage inputs and their
    gradients while one tick's working set is live."""
    sizes, schedule = dict(engine.mesh.shape), engine.spec.schedule
    message = _message_bytes(engine, plan, layout, batch)
    prefix = "/".join(engine.staged.layers_key) + "/"
    outer = sum(r.bytes_per_device for r in layout.params.leaves if not r.path.startswith(prefix))
    traffic = data_parallel_traffic(layout, plan, sizes, stage_uses=engine.weight_uses())
    traffic += pipeline_traffic(engine.program.ticks, message, outer, engine.spec.axis, sizes)
    micro = dataclasses.replace(workload, batch=workload.batch // schedule.microbatches)
    tick = pipeline_tick_bytes(layout.params.leaves, plan, sizes, micro, schedule.virtual)
    kept = 2 * engine.program.slots * message + int(tick)
    return Contribution(tuple(traffic), kept, "stage inputs kept, one tick's working set")


def _summary(engine: Pipeline, plan: Any, layout: StateLayout, batch: Any) -> Summary:
    pl = {**engine.figures(), "slot_bytes": _message_bytes(engine, plan, layout, batch)}
    text = (
        f"pipeline: {pl['schedule']} on {pl['stages']} stages × {pl['virtual']} chunk(s), "
        f"{pl['microbatches']} microbatches, layers per stage {pl['layers_per_stage']}; simulated bubble "
        f"{pl['bubble_fraction']:.3f}, peak in flight {pl['peak_inflight']}, held until W {pl['peak_held']}; "
        f"executed in {pl['ticks']} ticks with {pl['slots']} input slots of "
        f"{format_bytes(pl['slot_bytes'])} per device"
    )
    return Summary("pipeline", pl, text)
