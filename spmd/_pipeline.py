"""Runs any valid pipeline schedule inside one SPMD program.

The model's stacked layers are cut into ``p·v`` consecutive stages and stored as one array per parameter laid
out ``[stage device, chunk, layer, ...]``, the leading dimension split over the pipeline mesh axis, so each
device holds only its own chunks (stages may hold different numbers of layers: shorter ones are padded and
never computed). A ``shard_map`` over that axis alone (the other mesh axes stay automatic, so data, FSDP and
tensor parallelism compose unchanged) walks the schedule's ticks in a ``lax.scan``: each tick every device
picks its action from a per-device table with ``lax.switch`` (idle, F, B, W, BW), then all devices exchange
activations and input gradients with their ring neighbours by ``lax.ppermute``.

What a microbatch-chunk needs between its actions lives in a slot (from the arrival of its input to the end of
its last backward; see :mod:`spmd._ticks`), assigned ahead of time from the schedule, so a device's buffers hold
exactly its peak of held microbatches. No action runs a forward again: F keeps each layer's residuals, B computes
only the input gradient (sent back at once) and keeps what the weight gradient reads, W computes only the weight
gradient (deferrable, so zero-bubble schedules really defer it), each about one forward's work (see
:mod:`spmd._residuals`). A remat policy in the plan trades that memory for recomputation; an offload policy's
residuals wait in host-memory slots between F and the backward (PipeOffload).
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
from spmd._chunk import Chunk
from spmd._context import constrain
from spmd._executor import Executor, Summary, Task
from spmd._format import format_bytes
from spmd._hlo import matmul_flops
from spmd._layout import StateLayout, stored_abstract
from spmd._positions import DataPositions
from spmd._remat import Remat
from spmd._residuals import LayerVjp, zeros
from spmd._resolve import PlanWarning
from spmd._rules import PlanError
from spmd._schedule import ScheduleError, simulate, simulate_lockstep
from spmd._ticks import BW, CODES, FIELDS, IDLE, B, F, Placement, TickProgram, W, split_layers, tick_program
from spmd._tree import is_box, leaves_with_paths
from spmd.costmodel import (
    HOST_TRANSFER,
    Contribution,
    Traffic,
    Workload,
    activation_bytes,
    data_parallel_traffic,
    flops_per_device,
    pipeline_gathered_bytes,
    pipeline_traffic,
)

if TYPE_CHECKING:
    from spmd._specs import PipelineSpec

__all__ = ["Pipeline", "StagedModel", "TickProgram", "pipeline_executor", "split_layers", "tick_program"]

# Named scopes found again in the compiled program, where the work of each branch is weighed by its use.
TICK_SCOPE = "spmd_pipeline_tick"  # the tick's switch over idle, F, B, W, BW
HEAD_SCOPE = "spmd_pipeline_head"  # F's loss and its gradient, on the last stage only
EMBED_SCOPE = "spmd_pipeline_embed"  # the embedding's gradient, on the first stage only
DEPTH_SCOPE = "spmd_pipeline_depth"  # the switch over stage depths, where stages hold different numbers of layers


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


# ------------------------------------------------------------------------------------------------ executor
class _Device(NamedTuple):
    """What every tick of one device's program reads: its chunks' weights, the replicated outer parameters,
    the microbatches, one :class:`~spmd._chunk.Chunk` per stage depth, and how to lay out slots."""

    weights: Any
    outer: Any
    micro: Any
    chunks: list[Chunk]
    lay_out: Callable[[jax.Array], jax.Array]
    replicate: Callable[[Any], Any]


class _Slots(NamedTuple):
    """A device's slots (``[slot, ...]`` each): stage inputs, output gradients, what F keeps for the
    backward, and what B hands to W."""

    inputs: jax.Array
    grads: jax.Array
    kept: tuple[jax.Array, ...]
    carried: tuple[jax.Array, ...]

    @classmethod
    def empty(cls, n: int, x: jax.Array, chunk: Chunk, split: bool, lay_out: Callable) -> _Slots:
        """``n`` empty slots for stage inputs like ``x`` and for what ``chunk`` keeps (offloaded parts on the
        host), and for what B hands to W where the schedule splits the backward (``split``)."""
        return cls(
            lay_out(jnp.zeros((n, *x.shape), x.dtype)),
            lay_out(jnp.zeros((n, *x.shape), x.dtype)),
            tuple(zeros(k.update(shape=(n, *k.shape))) for k in chunk.kept),
            tuple(jnp.zeros((n, *c.shape), c.dtype) for c in chunk.carried) if split else (),
        )


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
        self,
        staged: StagedModel,
        spec: PipelineSpec,
        mesh: Mesh,
        layers: int,
        data_axes: Sequence[str] | None = None,
        remat: Remat = Remat(),  # noqa: B008 - frozen, shared safely
    ) -> None:
        if spec.axis not in mesh.shape:
            raise ScheduleError(f"pipeline: the mesh has no axis {spec.axis!r} ({dict(mesh.shape)})")
        if mesh.shape[spec.axis] != spec.schedule.stages:
            raise ScheduleError(
                f"pipeline: schedule {spec.schedule.name} is for {spec.schedule.stages} stages but mesh axis "
                f"{spec.axis!r} has {mesh.shape[spec.axis]} devices"
            )
        self.staged, self.spec, self.mesh, self.data_axes = staged, spec, mesh, tuple(data_axes or ())
        self.remat = remat  # each layer's, inside every chunk: what F keeps and B or W recompute
        counts = split_layers(layers, spec.schedule.total_stages, spec.layers_per_stage)
        self.placement = Placement(spec.schedule, counts)
        # With uneven data shares each data position runs its own schedule; the figures are the busiest's.
        self.schedule = spec.busiest
        self.program = tick_program(self.schedule, self.placement)
        self.positions = DataPositions.of(spec, mesh, self.placement, data_axes)

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
        """Runs the schedule once and returns ``[tick, device]`` the action code each device's switch took
        (``[tick, data position, device]`` where data positions run their own schedules)."""
        _, _, codes = jax.jit(self._run)(params, batch)
        codes = np.asarray(codes)
        return codes.transpose(2, 0, 1) if self.positions else codes.T

    @property
    def loss_scale(self) -> int:
        """What each microbatch's mean loss is divided by: the number of microbatches of the whole batch (each
        device's loss is then its share of the mean, summed over the stages and the data axes)."""
        if self.positions:
            return sum(self.positions.counts)
        return self.spec.schedule.microbatches * math.prod(self.mesh.shape[a] for a in self.data_axes)

    @property
    def branch_weights(self) -> dict[str, tuple[float, ...]]:
        """How often each branch of the program's switches runs, per device: the tick's (idle, F, B, W, BW; the
        same on every device of a position, since each runs every microbatch of each of its chunks once; where
        data positions run their own schedules, the busiest position's, padded as executed), the
        loss's and the embedding's (on one stage of ``p·v``) and the stage depths' (by their share of stages).

        >>> import spmd, strategies
        >>> mesh = spmd.make_mesh({"stage": 2, "data": -1})
        >>> plan = strategies.pipeline("1f1b", stages=2, microbatches=4, layers_per_stage=(3, 1))
        >>> weights = Pipeline(None, plan.execution, mesh, layers=4).branch_weights
        >>> weights[TICK_SCOPE], weights[HEAD_SCOPE], weights[DEPTH_SCOPE]  # 4 F and 4 BW in 10 ticks
        ((0.2, 0.4, 0.0, 0.0, 0.4), (0.5, 0.5), (0.5, 0.5))
        """
        kinds = (self.positions.busiest() if self.positions else self.program.table)[:, 0, 0]
        stages = self.spec.schedule.total_stages
        one_stage = (1 - 1 / stages, 1 / stages)  # a cond's branches: (false, true)
        depths = tuple(self.placement.counts.count(k) / stages for k in self.placement.branches)
        return {
            TICK_SCOPE: tuple(float(np.mean(kinds == code)) for code in (IDLE, F, B, W, BW)),
            HEAD_SCOPE: one_stage,
            EMBED_SCOPE: one_stage,
            DEPTH_SCOPE: depths,
        }

    def branch_flops(self, hlo_text: str) -> dict[str, float]:
        """Compiled matmul FLOPs of one run of each tick branch (``F``, ``B``, ``W``, ``BW``) of a chunk without
        the loss or the embedding, read from this pipeline's compiled step (``step.compile(batch).as_text()``):
        the program counted with each branch taken once per tick, less the program with none taken, over the
        ticks. What shows that no action computes a forward again: B and W about one F each, BW about two."""
        weights = {**self.branch_weights, HEAD_SCOPE: (1, 0), EMBED_SCOPE: (1, 0)}

        def program(branch: int | None) -> float:
            taken = tuple(float(code == branch) for code in (IDLE, F, B, W, BW))
            return matmul_flops(hlo_text, branch_weights={**weights, TICK_SCOPE: taken})

        none = program(None)
        return {kind: (program(code) - none) / (self.positions or self.program).ticks for kind, code in CODES.items()}

    def _microbatches(self, batch: Any) -> Any:
        if self.positions:
            return self.positions.microbatches(batch)
        return _even_microbatches(batch, self.spec.schedule.microbatches)

    def activation(self, params: Any, batch: Any) -> jax.ShapeDtypeStruct:
        """One device's stage input (a kept slot, a message between stages) for this batch."""
        first = self.positions.first if self.positions else functools.partial(jax.tree.map, lambda x: x[0])
        x = jax.eval_shape(lambda p, b: self.staged.embed(p, first(self._microbatches(b))), params, batch)
        shards = math.prod(self.mesh.shape[a] for a in self.data_axes)
        return jax.ShapeDtypeStruct((x.shape[0] // shards, *x.shape[1:]), x.dtype)

    def weight_uses(self, weight_grad_share: float = 1.0) -> tuple[float, float]:
        """Per step, how many times a device uses its chunks' weights and makes their gradients, in whole
        stacks of its chunks: F, B and BW use them once each, W only the ``weight_grad_share`` of their bytes its
        own equations read (a matmul's weight gradient needs its input and output cotangent, not the weight:
        ``LayerVjp.weight_grad_weight_share``), and every W or BW makes a gradient. What FSDP gathers and
        reduces inside the stages.

        >>> import spmd, strategies
        >>> mesh = spmd.make_mesh({"stage": 2, "data": -1})
        >>> plan = strategies.pipeline("zb-h1", stages=2, microbatches=4)
        >>> Pipeline(None, plan.execution, mesh, layers=4).weight_uses(0.25)  # 4 F, 4 B, 4 W reading a quarter
        (9.0, 4.0)
        """
        s = self.schedule
        kinds = [a.kind for a in s.actions[0]]  # every device runs each microbatch of each of its chunks once
        uses = len(kinds) - kinds.count("W") * (1 - weight_grad_share)
        grads = kinds.count("W") + kinds.count("BW")
        return uses / s.virtual, grads / s.virtual

    def figures(self) -> dict[str, Any]:
        """The schedule's figures: simulated with unit op costs (F = B = W, what the executor's actions cost: no
        action runs a forward again), asynchronously and in lock-step as the executor runs it, in ticks. Where the
        data positions run their own schedules, the busiest one's, with each position's microbatches."""
        s = self.schedule
        timeline, lockstep = simulate(s), simulate_lockstep(s)
        return {
            "schedule": s.name,
            "stages": s.stages,
            "microbatches": s.microbatches,
            "rank_microbatches": list(self.spec.rank_microbatches or ()) or None,
            "virtual": s.virtual,
            "layers_per_stage": list(self.placement.counts),
            "bubble_fraction": float(timeline.bubble_fraction),
            "makespan": float(timeline.makespan),
            "lockstep_bubble_fraction": float(lockstep.bubble_fraction),
            "lockstep_makespan": float(lockstep.makespan),
            "peak_inflight": list(timeline.peak_inflight),
            "peak_held": list(timeline.peak_held),
            "ticks": (self.positions or self.program).ticks,  # as executed: the longest position's
            "slots": (self.positions or self.program).slots,
        }

    def _run(self, params: Any, batch: Any) -> tuple[jax.Array, Any, jax.Array]:
        axis, data_axes = self.spec.axis, self.data_axes
        micro = self._microbatches(batch)
        stacked = _get(params, self.staged.layers_key)
        outer = _set(params, self.staged.layers_key, None)
        x_abstract = self.activation(params, batch)
        # Data positions with their own schedules take their own microbatches, and tell their codes apart.
        ranks = self.positions.axis if self.positions else None
        batch_spec = PartitionSpec(ranks) if ranks else PartitionSpec(None, data_axes or None)
        codes_spec = PartitionSpec(ranks, axis) if ranks else PartitionSpec(axis)
        run = jax.shard_map(
            functools.partial(self._body, x_abstract=x_abstract),
            mesh=self.mesh,
            in_specs=(PartitionSpec(axis), PartitionSpec(), batch_spec, PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(axis), PartitionSpec(), codes_spec),
            axis_names={axis, *data_axes},
            check_vma=False,
        )
        table = self.positions.table() if self.positions else self.program.table
        loss, grad_layers, grad_outer, codes = run(stacked, outer, micro, jnp.asarray(table))
        return loss, _set(grad_outer, self.staged.layers_key, grad_layers), codes

    def chunks(self, weights: Any, x: Any) -> list[Chunk]:
        """One :class:`~spmd._chunk.Chunk` per distinct stage depth, for a device's ``[chunk, layer, ...]``
        weights and a stage input ``x`` (arrays or abstract), under the plan's remat policy."""
        layer = self.remat.wrap(self.staged.layer) if self.remat else self.staged.layer
        # A traced slice keeps the weights' types (their sharding on explicit axes); shapes do for the estimate.
        one = jax.tree.map(
            lambda a: a[0, 0] if isinstance(a, jax.Array) else jax.ShapeDtypeStruct(a.shape[2:], a.dtype), weights
        )
        split = LayerVjp(layer, one, x)
        return [Chunk(split, count, self.placement.longest) for count in self.placement.branches]

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
        weights = jax.tree.map(lambda a: a[0], stacked)  # this device's [chunk, layer, ...]
        if self.positions:  # this data position's microbatches and schedule
            micro, table = self.positions.own(micro, table)
        x = jnp.zeros(x_abstract.shape, x_abstract.dtype)
        device = _Device(
            weights=weights,
            outer=replicate(outer),
            micro=micro,
            chunks=self.chunks(weights, x),  # one per distinct stage depth: a shallower stage computes less
            lay_out=lay_out,
            replicate=replicate,
        )
        n = (self.positions or self.program).slots + 1  # the last slot is spare: what no slot keeps goes there
        # B hands values to W only in schedules that split the backward.
        split = any(a.kind == "W" for row in self.schedule.actions for a in row)
        slots = _Slots.empty(n, x, device.chunks[0], split, lay_out)
        zeros_like = functools.partial(jax.tree.map, jnp.zeros_like)
        init = (slots, zeros_like(device.weights), replicate(zeros_like(outer)), jnp.zeros((), jnp.float32))
        rows = table[:, jax.lax.axis_index(axis)]
        (_, grad_w, grad_outer, loss), codes = jax.lax.scan(functools.partial(_tick, self, device), init, rows)
        # The loss lives on the last stage, the embedding's gradient on the first, the head's on the last; each
        # data shard holds its own rows' share of all three.
        loss, grad_outer = jax.lax.psum((loss, grad_outer), axis)
        if data_axes:  # one reduction of everything, as data parallelism makes
            loss, grad_outer, grad_w = jax.lax.psum((loss, grad_outer, grad_w), data_axes)
        codes = codes[None, None] if self.positions else codes[None]  # [data position,] stage device, tick
        return loss, jax.tree.map(lambda g: g[None], grad_w), grad_outer, codes


class _Tick:
    """The five branches of one tick of one device (idle, F, B, W, BW), each returning what the tick sends, what
    its slot is to keep (F's residuals, B's values for W), the gradient and loss sums, and its code. Slots are
    read inside the branch that reads them, so only that branch holds a copy."""

    def __init__(self, engine: Pipeline, device: _Device, carry: tuple, field: dict[str, jax.Array]) -> None:
        self.engine, self.device, self.field = engine, device, field
        self.slots, self.grad_w, self.grad_outer, self.loss = carry
        self.slot, self.chunk = field["slot"], field["chunk"]
        self.batch = jax.tree.map(
            lambda x: jax.lax.dynamic_index_in_dim(x, field["microbatch"], 0, False), device.micro
        )
        self.w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.chunk, 0, False), device.weights)
        self.split = bool(self.slots.carried)  # B hands values to W: the schedule runs W
        shapes = (self.slots.inputs.shape[1:], self.slots.inputs.dtype)
        self.nothing = (jnp.zeros(*shapes), tuple(map(zeros, device.chunks[0].kept)), _zeros_like(self._carried_shapes))

    @property
    def _carried_shapes(self) -> tuple:
        return self.device.chunks[0].carried if self.split else ()

    def _read(self, buffers: Any) -> Any:
        return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, self.slot, 0, False), buffers)

    def _by_depth(self, name: str, *args: Any) -> Any:
        return _by_depth(self.device.chunks, self.field["branch"], name, *args)

    def _add(self, grads: Any, d: Any) -> Any:
        return jax.tree.map(jnp.add, grads, self.device.replicate(d))

    def idle(self) -> tuple:
        return (*self.nothing, self.grad_w, self.grad_outer, self.loss, IDLE)

    def forward(self) -> tuple:
        staged, outer, batch, last = self.engine.staged, self.device.outer, self.batch, self.field["last"]
        x = jnp.where(self.field["first"], staged.embed(outer, batch), self._read(self.slots.inputs))
        y, kept = self._by_depth("forward", self.w, x)
        scale = self.engine.loss_scale

        def head(outer: Any, y: jax.Array) -> tuple:
            # On the last stage F also makes the loss's gradient: its output gradient, kept for its own B.
            loss, grads = jax.value_and_grad(lambda o, y: staged.loss(o, y, batch) / scale, (0, 1))(outer, y)
            return loss.astype(jnp.float32), *grads

        def no_head(outer: Any, y: jax.Array) -> tuple:
            return jnp.zeros((), jnp.float32), _zeros_like(outer), jnp.zeros_like(y)

        with jax.named_scope(HEAD_SCOPE):
            loss, d_outer, dy = jax.lax.cond(last, head, no_head, outer, y)
        grad_outer = self._add(self.grad_outer, d_outer)
        return jnp.where(last, dy, y), kept, self.nothing[2], self.grad_w, grad_outer, self.loss + loss, F

    def input_grad(self) -> tuple:
        dx, carried = self._by_depth("input_grad", self.w, self._read(self.slots.kept), self._read(self.slots.grads))
        handed = carried if self.split else ()
        return dx, self.nothing[1], handed, self.grad_w, self._embedding(dx), self.loss, B

    def weight_grad(self) -> tuple:
        if not self.split:  # never taken: the schedule runs no W
            return self.idle()
        dw = self._by_depth("weight_grad", self.w, self._read(self.slots.kept), self._read(self.slots.carried))
        return (*self.nothing, self._accumulate(dw), self.grad_outer, self.loss, W)

    def both(self) -> tuple:
        kept = self._read(self.slots.kept)
        dx, carried = self._by_depth("input_grad", self.w, kept, self._read(self.slots.grads))
        dw = self._by_depth("weight_grad", self.w, kept, carried)
        return dx, *self.nothing[1:], self._accumulate(dw), self._embedding(dx), self.loss, BW

    def _embedding(self, dx: jax.Array) -> Any:
        """The outer gradients plus, on the first stage, the embedding's: its input gradient is ``dx``."""
        staged, batch = self.engine.staged, self.batch

        def embed_grad(outer: Any, dx: jax.Array) -> Any:
            return jax.vjp(lambda o: staged.embed(o, batch), outer)[1](dx)[0]

        with jax.named_scope(EMBED_SCOPE):
            d_outer = jax.lax.cond(self.field["first"], embed_grad, lambda o, _: _zeros_like(o), self.device.outer, dx)
        return self._add(self.grad_outer, d_outer)

    def _accumulate(self, dw: Any) -> Any:
        return jax.tree.map(lambda acc, g: acc.at[self.chunk].add(g), self.grad_w, dw)


def _tick(engine: Pipeline, device: _Device, carry: tuple, row: jax.Array) -> tuple:
    """One tick of one device: its action (a switch over idle, F, B, W, BW), what its slot keeps, then the
    ring exchanges."""
    field = dict(zip(FIELDS, (row[i] for i in range(len(FIELDS))), strict=True))
    tick, kind, slot, p = _Tick(engine, device, carry, field), field["kind"], field["slot"], engine.spec.schedule.stages
    with jax.named_scope(TICK_SCOPE):  # lets the collective inventory weigh the branches by their use
        msg, kept, carried, grad_w, grad_outer, loss, code = jax.lax.switch(
            kind, [tick.idle, tick.forward, tick.input_grad, tick.weight_grad, tick.both]
        )
    slots = tick.slots._replace(
        kept=tuple(_store(b, jnp.where(kind == F, slot, -1), v) for b, v in zip(tick.slots.kept, kept, strict=True)),
        carried=tuple(
            _store(b, jnp.where(kind == B, slot, -1), v) for b, v in zip(tick.slots.carried, carried, strict=True)
        ),
    )
    # Every device joins both exchanges every tick (collectives stay outside the switch); a receiver keeps
    # what arrives only where the table expects it.
    up = jax.lax.ppermute(msg, engine.spec.axis, [(i, (i + 1) % p) for i in range(p)])
    # On two stages both rings are the same pair: one exchange serves both.
    down = up if p == 2 else jax.lax.ppermute(msg, engine.spec.axis, [(i, (i - 1) % p) for i in range(p)])
    arrived = {"up": up, "down": down, "self": msg}
    inputs, grads = slots.inputs, slots.grads
    for route, value in arrived.items():
        at, is_grad = field[f"{route}_slot"], field[f"{route}_grad"]
        inputs = _store(inputs, jnp.where(is_grad, -1, at), value)
        grads = _store(grads, jnp.where(is_grad, at, -1), value)
    slots = slots._replace(inputs=device.lay_out(inputs), grads=device.lay_out(grads))
    return (slots, grad_w, grad_outer, loss), code


def _even_microbatches(batch: Any, m: int) -> Any:
    """``[microbatch, rows, ...]``: row ``r = i·m + k`` goes to microbatch ``k``, so each device's batch shard
    splits locally, with no exchange."""

    def split(x: jax.Array) -> jax.Array:
        if x.shape[0] % m:
            raise ScheduleError(
                f"pipeline: batch of {x.shape[0]} rows cannot be split into {m} microbatches; make the batch "
                f"a multiple of {m}"
            )
        return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def _by_depth(chunks: list[Chunk], branch: jax.Array, name: str, *args: Any) -> Any:
    """``chunk.name(*args)`` for the chunk of this stage's depth (a switch when stages differ in depth)."""
    fns = [getattr(c, name) for c in chunks]
    if len(fns) == 1:
        return fns[0](*args)
    with jax.named_scope(DEPTH_SCOPE):
        return jax.lax.switch(branch, fns, *args)


def _zeros_like(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """Writes ``value`` into ``buffer[slot]``, or into the buffer's last row, kept spare, when ``slot < 0``: one
    update in place either way, with no copy of the slot to choose between the old value and the new."""
    spare = buffer.shape[0] - 1
    return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), jnp.where(slot >= 0, slot, spare), 0)


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
            "pass staged=model.staged (the built-in GPTs have one; cut your own with "
            "spmd.pipeline.staged_from_parts, or write a spmd.pipeline.StagedModel)"
        )
    layers = _layers(task.params, task.staged)
    stacked = Pipeline(task.staged, spec, task.mesh, layers).stack(task.params)
    with warnings.catch_warnings():  # the training step resolves the same layout again, and warns there
        warnings.simplefilter("ignore", PlanWarning)
        split = task.plan.resolve(stacked, task.mesh).leaves
    data_axes = _manual_axes(task.plan, split, task.mesh)
    engine = Pipeline(task.staged, spec, task.mesh, layers, data_axes=data_axes, remat=task.plan.remat)
    return Executor(
        engine.value_and_grad,
        # Data positions with their own schedules take their own rows of the whole batch.
        splits_batch=spec.data_schedules is None,
        to_stored=engine.stack,
        to_model=engine.unstack,
        costs=functools.partial(_costs, engine, task.plan),
        summary=functools.partial(_summary, engine, task.plan),
        branch_weights=engine.branch_weights,
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
    """Bytes of one stage input on one device: data axes the program does not run manual over (batch axes that
    split parameters, FSDP's; the context axis) split the activations further, as the model lays them out."""
    message = engine.activation(stored_abstract(layout.params), batch)
    auto = math.prod(engine.mesh.shape[a] for a in plan.data_axes if a not in engine.data_axes)
    return math.prod(message.shape) * np.dtype(message.dtype).itemsize // auto


def _deepest_chunk(engine: Pipeline, layout: StateLayout, batch: Any) -> Chunk:
    params = stored_abstract(layout.params)
    weights = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), _get(params, engine.staged.layers_key))
    return engine.chunks(weights, engine.activation(params, batch))[-1]


def _slot_bytes(
    engine: Pipeline, plan: Any, layout: StateLayout, batch: Any, workload: Workload | None = None
) -> tuple[dict[str, int], int]:
    """Bytes of one slot on one device, by what it holds: the stage input and the output gradient (one message
    each), what F keeps for the backward and what B hands to W (schedules that split the backward); and what
    one chunk's backward makes of both, kept or not. Data axes the program does not run manual over (FSDP's,
    the context axis) split them as they split the messages; model axes (tensor) split them as they split the
    layers' activations in the cost model (given the ``workload``)."""
    chunk = _deepest_chunk(engine, layout, batch)
    auto = math.prod(engine.mesh.shape[a] for a in plan.data_axes if a not in engine.data_axes)
    if workload is not None:
        auto /= _model_axes_share(engine, plan, layout, workload)
    message = _message_bytes(engine, plan, layout, batch)
    split = any(a.kind == "W" for row in engine.schedule.actions for a in row)
    # Offloaded residuals (an offload remat policy's) live in host memory between F and the backward, which
    # brings them back to the device while it runs.
    offloaded = chunk.offloaded_bytes
    return {
        "inputs": message,
        "grads": message,
        "kept": int(chunk.kept_bytes / auto),
        "carried": int(chunk.carried_bytes / auto) if split else 0,
        "offloaded": int(offloaded / auto),
        "offloaded_weight_grad": int(chunk.offloaded_weight_grad_bytes / auto) if split else 0,
    }, int((chunk.kept_bytes + offloaded + chunk.carried_bytes) / auto)


def _model_axes_share(engine: Pipeline, plan: Any, layout: StateLayout, workload: Workload) -> float:
    """The share of the stacked layers' activations a device holds under the mesh's model axes (tensor), by the
    cost model: its per-matmul estimate with them over the estimate with those axes of size 1."""
    prefix = "/".join(engine.staged.layers_key) + "/"
    rows = [r for r in layout.params.leaves if r.path.startswith(prefix)]
    sizes, plain = dict(engine.mesh.shape), dataclasses.replace(plan, remat=Remat())
    alone = {a: n if a in plan.data_axes or a == engine.spec.axis else 1 for a, n in sizes.items()}
    whole = activation_bytes(rows, plain, alone, workload)
    return activation_bytes(rows, plain, sizes, workload) / whole if whole else 1.0


def _costs(engine: Pipeline, plan: Any, layout: StateLayout, batch: Any, workload: Workload) -> Contribution:
    """FSDP inside the stages gathers per action; every tick sends a stage input and an input gradient; the
    parameters outside the stacked layers reduce over the stages once. Memory: the slots (see
    :func:`_slot_bytes`) and one tick's working set; offloaded residuals on the host, moved per tick (see
    :func:`_host_transfers`). Work: the layers' split over the stages, the head's on the last stage alone."""
    sizes, schedule = dict(engine.mesh.shape), engine.schedule
    message = _message_bytes(engine, plan, layout, batch)
    prefix = "/".join(engine.staged.layers_key) + "/"
    rows = layout.params.leaves
    outer = sum(r.bytes_per_device for r in rows if not r.path.startswith(prefix))
    share = _deepest_chunk(engine, layout, batch).split.weight_grad_weight_share
    traffic = data_parallel_traffic(layout, plan, sizes, stage_uses=engine.weight_uses(share))
    executed = engine.positions or engine.program  # the longest data position's ticks, the most slots
    traffic += pipeline_traffic(executed.ticks, message, outer, engine.spec.axis, sizes)
    slot, backward = _slot_bytes(engine, plan, layout, batch, workload)
    # While a tick runs: the switch's outputs (F's residuals, B's values for W) and a branch's copy of what it
    # reads of its slot, about twice what a chunk's backward uses; and the chunk's FSDP-gathered layers.
    working = 2 * backward + pipeline_gathered_bytes(layout.params.leaves, plan, sizes) / schedule.virtual
    on_device = sum(slot[k] for k in ("inputs", "grads", "kept", "carried"))
    kept = (executed.slots + 1) * on_device + int(working)  # the spare slot too
    # The executor runs in lock-step: each tick lasts as long as its dearest action (F, B and W cost alike).
    lockstep = simulate_lockstep(schedule)
    bubble = float(lockstep.makespan / max(lockstep.busy))
    note = "slots: stage inputs, gradients, residuals; one tick's working set"
    # The stacked layers' work is split over the stages; the head's runs on the last stage only.
    layers = flops_per_device([r for r in rows if r.path.startswith(prefix)], plan, sizes, workload)
    head = flops_per_device([r for r in rows if not r.path.startswith(prefix)], plan, sizes, workload)
    counts = engine.spec.rank_microbatches
    if counts:  # the compiled program's work is the busiest data position's: its microbatches of one size
        busiest = max(counts) * len(counts) / sum(counts)
        layers, head = layers * busiest, head * busiest
    return Contribution(
        tuple(traffic),
        kept,
        note,
        compute_factor=bubble,
        flops=layers + head / sizes[engine.spec.axis],
        host_activation_bytes=(executed.slots + 1) * slot["offloaded"],
        host_traffic=_host_transfers(schedule, slot),
    )


def _host_transfers(schedule: Any, slot: dict[str, int]) -> tuple[Traffic, ...]:
    """Per step, one device's moves of offloaded residuals, one per tick that moves them: each F sends its
    chunk's to the host; each B and BW reads them back, and each W what it reads itself."""
    if not slot["offloaded"]:
        return ()
    kinds = [a.kind for a in schedule.actions[0]]  # every device runs as many of each
    moved = (kinds.count("F") + kinds.count("B") + kinds.count("BW")) * slot["offloaded"]
    moved += kinds.count("W") * slot["offloaded_weight_grad"]
    count = len(kinds) - (kinds.count("W") if not slot["offloaded_weight_grad"] else 0)
    return (Traffic(HOST_TRANSFER, (), moved, moved, count),)


def _summary(engine: Pipeline, plan: Any, layout: StateLayout, batch: Any) -> Summary:
    slot, _ = _slot_bytes(engine, plan, layout, batch)
    pl = {**engine.figures(), "slot_bytes": slot["inputs"], "slot_parts": slot}
    # Data positions with their own schedules: the figures are the busiest's.
    counts = pl["rank_microbatches"]
    micro = (
        f"microbatches per data position {counts} (figures: the busiest's)"
        if counts
        else f"{pl['microbatches']} microbatches"
    )
    text = (
        f"pipeline: {pl['schedule']} on {pl['stages']} stages × {pl['virtual']} chunk(s), "
        f"{micro}, layers per stage {pl['layers_per_stage']}; simulated bubble "
        f"{pl['bubble_fraction']:.3f} (lock-step, as executed: {pl['lockstep_bubble_fraction']:.3f}), peak in "
        f"flight {pl['peak_inflight']}, held until W {pl['peak_held']}; "
        f"executed in {pl['ticks']} ticks with {pl['slots']} input slots of "
        f"{format_bytes(pl['slot_bytes'])} per device"
    )
    return Summary("pipeline", pl, text)
