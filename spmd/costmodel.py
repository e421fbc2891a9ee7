"""The analytic cost model: what a plan's layouts imply, per device and per step, before anything is compiled.

Pure functions of the training state's layout (abstract shapes, dtypes and the plan's specs), the mesh sizes,
the :class:`Workload` (tokens per step) and, for times, a :class:`Hardware` description.

Collective traffic uses ring formulas per device: all-reduce 2(N−1)/N·S, all-gather, reduce-scatter and
all-to-all (N−1)/N·S of the full buffer S.

Everything is read from the layouts — which dimension of which weight is split over which mesh axis, and
whether that axis is a batch axis — never from which plan part made the split or what the model calls it.

- The data-parallel family (DP, ZeRO-1/2/3, FSDP, HSDP): gradient reductions, the gathers of parameters split
  over a batch axis (twice with layer rematerialisation or in stacked layers: forward and backward) and
  ZeRO-1/2's all-gathers of updated parameter shards.
- Activations, read off every weight that acts as a matmul (:func:`matmuls`, which finds them by their shapes
  and roles, whatever their dimensions are called): a split of its input (contraction)
  dimension over model axes all-reduces its output in the forward pass; a split of its output dimension
  all-reduces its input gradient in the backward pass. That is Megatron's column/row pair (one all-reduce per
  block each way), ATP's 2-D tensor parallelism, and sequence parallelism, where each such all-reduce becomes a
  reduce-scatter and an all-gather and the weights the sequence shards share reduce their gradients over it.
  Experts split over an axis send their tokens there and back by all-to-all.
- Gradient accumulation (``plan.accumulate`` = K): one microbatch's activations kept at a time (1/K), the
  gradient reductions once per step, the FSDP gathers and reduce-scatters once per microbatch, and a float32
  accumulated gradient in the parameters' layout.
- Compute: 2·tokens·in·out FLOPs per matmul forward, twice that backward, once more where the plan's remat policy
  recomputes it (``full``: every matmul of a layer; ``dots``: none; ``names``/``offload``: those whose outputs
  are not named), plus attention's score and value products; split over the devices that share the work.
- Activations kept per policy: every layer's (no remat); each layer's input and one layer live (``full``); those
  plus the matmul outputs (``dots``) or the named ones (``names``); with ``offload`` the named ones go to host
  memory, counted apart (:func:`host_activation_bytes`).

>>> import jax, optax, spmd
>>> from spmd import costmodel
>>> params, workload = {"w": jax.ShapeDtypeStruct((256, 256), "float32")}, costmodel.Workload(batch=8, seq_len=16)
>>> e = costmodel.estimate(spmd.Plan(batch_axes=("data",)), params, {"data": 8}, workload, optimizer=optax.sgd(0.1),
...                        hardware=costmodel.HARDWARE["h100"])
>>> [(t.kind, t.traffic_bytes) for t in e.traffic]  # the 256 KiB gradient's ring all-reduce: 2 · 7/8 of it
[('all-reduce', 458752.0)]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from spmd import axes as A
from spmd._context_parallel import attention_share, exchanges
from spmd._hardware import HARDWARE, Hardware, detect, hardware
from spmd._layout import LeafLayout, StateLayout, resolve_state
from spmd._matmuls import Matmul, attention_parents, matmuls, stacked
from spmd._matmuls import dim_axes as _dim_axes
from spmd._matmuls import spec_axes as _axes
from spmd._rules import PlanError, assign_by_rules

if TYPE_CHECKING:
    from spmd._plan import Plan
    from spmd._precision import Precision

__all__ = [
    "HARDWARE",
    "HOST_TRANSFER",
    "TOLERANCE",
    "Hardware",
    "Contribution",
    "Estimate",
    "Matmul",
    "StepTime",
    "Traffic",
    "Workload",
    "accumulator_bytes",
    "activation_bytes",
    "host_activation_bytes",
    "activation_traffic",
    "compare",
    "data_parallel_traffic",
    "detect",
    "estimate",
    "estimate_layout",
    "flops_per_device",
    "gathered_axes",
    "host_traffic",
    "hardware",
    "matmuls",
    "model_state_bytes",
    "merge_traffic",
    "model_flops",
    "padding_bytes",
    "pipeline_gathered_bytes",
    "pipeline_traffic",
    "step_time",
    "token_lookup",
    "subnet_traffic",
    "context_traffic",
    "traffic",
]

# What the built-in models call each matmul's output (``checkpoint_name``, spmd._remat.NAMES), by the module
# holding the weight: a names policy keeps those it names. Other models' matmuls count as unnamed.
_OUTPUT_NAMES = {"query": "query_proj", "key": "key_proj", "value": "value_proj", "out": "out_proj"}
_OUTPUT_NAMES |= {"wi": "mlp_hidden", "wo": "mlp_out"}


def _output_name(m: Matmul) -> str | None:
    parts = m.row.path.split("/")
    # A Dense's kernel sits in the module named for it; an expert layer's weights are named themselves.
    holder = parts[-2] if parts[-1] == "kernel" and len(parts) > 1 else parts[-1]
    return _OUTPUT_NAMES.get(holder)


def _recomputed(plan: Plan, m: Matmul) -> bool:
    """Whether the plan's remat policy runs ``m`` again in the backward pass (see :attr:`Matmul.recomputed`)."""
    return m.recomputed and plan.remat.recomputes(_output_name(m))


# A compiled figure more than this far from the analytic one is flagged in the report.
TOLERANCE = 0.10
# The traffic of offloaded state between host and device memory: not a collective (no mesh axes).
HOST_TRANSFER = "host-transfer"


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one training step processes, beyond the parameters: ``batch`` sequences of ``seq_len`` tokens.

    ``top_k`` and ``capacity_factor`` describe mixture-of-experts routing (the built-in ``moe-tiny``'s values);
    ``act_bytes`` is the width of an activation element.

    >>> import numpy as np
    >>> Workload.from_batch({"tokens": np.zeros((32, 128), np.int32)}).tokens
    4096
    """

    batch: int
    seq_len: int
    act_bytes: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @classmethod
    def from_batch(cls, batch: Any, **options: Any) -> Workload:
        """Reads ``[batch, seq]`` from the batch's first rank-2 integer array, its tokens (arrays or
        ShapeDtypeStructs); a float ``[batch, features]`` array or one-hot labels are not tokens."""
        for x in jax.tree.leaves(batch):
            shape, dtype = tuple(getattr(x, "shape", ())), getattr(x, "dtype", None)
            if len(shape) == 2 and dtype is not None and jnp.issubdtype(dtype, jnp.integer):
                return cls(batch=int(shape[0]), seq_len=int(shape[1]), **options)
        raise ValueError("costmodel.Workload.from_batch: no [batch, seq] token array in the batch; build a Workload")


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Analytic traffic of one kind of collective over one group of mesh axes, per step and per device.

    >>> Traffic("all-reduce", ("data",), bytes=1024, traffic_bytes=2 * 7 / 8 * 1024).to_dict()  # ring over 8
    {'kind': 'all-reduce', 'axes': ['data'], 'count': 1, 'bytes': 1024, 'traffic_bytes': 1792}
    """

    kind: str
    axes: tuple[str, ...]
    bytes: float  # full buffers, summed
    traffic_bytes: float  # ring traffic per device
    count: int = 1  # collectives per step (those XLA combines counted once)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "axes": list(self.axes),
            "count": self.count,
            "bytes": int(self.bytes),
            "traffic_bytes": int(self.traffic_bytes),
        }


class _Totals:
    """Accumulates buffers per (kind, axes) with their ring traffic; collectives on one device are free."""

    def __init__(self, sizes: Mapping[str, int]) -> None:
        self.sizes = dict(sizes)
        self.acc: dict[tuple[str, tuple[str, ...]], list[float]] = {}

    def add(
        self, kind: str, axes: Iterable[str], buffer: float, count: int = 1, *, combined: bool = False,
        group: int | None = None,
    ) -> None:  # fmt: skip
        """``group``: the devices of each collective, where they are fewer than the axes' (pairs of neighbours)."""
        axes = set(axes)
        n = math.prod(self.sizes[a] for a in axes)
        if n <= 1 or buffer <= 0:
            return
        n = group or n
        factor = 2 * (n - 1) / n if kind == "all-reduce" else 1.0 if kind == "collective-permute" else (n - 1) / n
        key = (kind, tuple(a for a in self.sizes if a in axes))
        acc = self.acc.setdefault(key, [0.0, 0.0, 0])
        acc[0] += buffer
        acc[1] += factor * buffer
        # XLA combines independent gradient reductions into one op; per-layer collectives stay separate.
        acc[2] = max(acc[2], count) if combined else acc[2] + count

    def result(self) -> list[Traffic]:
        out = [Traffic(kind, axes, b, t, int(c)) for (kind, axes), (b, t, c) in self.acc.items()]
        return sorted(out, key=lambda t: -t.traffic_bytes)


def model_state_bytes(layout: StateLayout, precision: Precision | None = None) -> dict[str, int]:
    """Per-device bytes of parameters, gradients and optimizer state, from a :class:`spmd.StateLayout`.

    >>> import jax, optax, spmd
    >>> params = {"w": jax.ShapeDtypeStruct((256, 256), "float32")}
    >>> model_state_bytes(spmd.resolve_state(spmd.Plan(), params, optax.adam(1e-3), {"data": 8}))  # 2 moments + count
    {'params': 262144, 'grads': 262144, 'optimizer': 524292, 'total': 1048580}

    Under a mixed-precision ``precision`` (ZeRO's accounting, Rajbhandari et al. section 3.1): ``params`` are the
    stored master weights (``precision.params``), ``optimizer`` the optimizer's state: with Adam these two are the
    paper's 12Ψ (fp32 master, momentum, variance). ``compute_params`` is the step's cast copy in
    ``precision.compute`` on the parameters' layout, the paper's 2Ψ of fp16 parameters (here a temporary of each
    step, not stored); ``grads`` are the gradients as the model's backward pass makes them, in the compute dtype,
    on the gradients' layout: the paper's 2Ψ of fp16 gradients. Data parallelism then holds 16Ψ and ZeRO-3 16Ψ/N
    as in the paper; ZeRO-1 and ZeRO-2 keep the master with the parameters the model reads (replicated), so hold
    8Ψ + 8Ψ/N and 6Ψ + 10Ψ/N where the paper, which splits the master with the optimizer state, has 4Ψ + 12Ψ/N
    and 2Ψ + 14Ψ/N.

    >>> model_state_bytes(spmd.resolve_state(spmd.Plan(), params, optax.adam(1e-3), {"data": 8}), spmd.Precision())
    {'params': 262144, 'grads': 131072, 'optimizer': 524292, 'compute_params': 131072, 'total': 1048580}
    """
    params = sum(r.bytes_per_device for r in layout.params.leaves)
    grads = sum(r.bytes_per_device for r in layout.grads.leaves)
    optimizer = sum(r.bytes_per_device for r in layout.opt_state.leaves)
    if precision is None:
        return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}
    grads = sum(_in_compute(r, precision) for r in layout.grads.leaves)
    # Leaves stored in the compute dtype already are used as they are: no copy.
    copy = sum(_in_compute(r, precision) for r in layout.params.leaves if jnp.dtype(r.dtype) != precision.compute)
    total = params + grads + optimizer + copy
    return {"params": params, "grads": grads, "optimizer": optimizer, "compute_params": copy, "total": total}


def _in_compute(row: LeafLayout, precision: Precision) -> int:
    """Bytes per device of a float array cast to the compute dtype (an integer one stays as it is)."""
    dtype = jnp.dtype(row.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return row.bytes_per_device
    return row.bytes_per_device * precision.itemsize("compute") // dtype.itemsize


def _width(row: LeafLayout, precision: Precision | None, field: str) -> float:
    """The share of a stored float array's bytes that a collective moving it in ``precision``'s ``field`` moves."""
    dtype = jnp.dtype(row.dtype)
    if precision is None or not jnp.issubdtype(dtype, jnp.floating):
        return 1.0
    return precision.itemsize(field) / dtype.itemsize


# Dimensions computed where they live though a batch axis splits them: experts (their tokens travel to them),
# a pipeline's stages and a subnetwork worker's own part.
_RESIDENT = (A.EXPERT, A.STAGE, A.WORKER)


def gathered_axes(row: LeafLayout, batch_axes: Iterable[str]) -> set[str]:
    """The batch axes a parameter must be gathered over before use: those splitting one of its dimensions
    (FSDP, whichever plan part chose the split: an FSDP strategy, a logical rule such as ``("embed", "fsdp")``,
    a path rule), except dimensions computed where they live (experts, pipeline stages, workers' parts).

    >>> import spmd, numpy as np
    >>> from flax import linen as nn
    >>> rules = spmd.Plan.from_logical_rules([("expert", "data"), ("embed", "fsdp")])
    >>> plan = rules + spmd.Plan(batch_axes=("data", "fsdp"))
    >>> wi = nn.LogicallyPartitioned(np.zeros((4, 8, 16)), ("expert", "embed", "mlp"))
    >>> row, = plan.resolve({"wi": wi}, {"data": 2, "fsdp": 2}).leaves
    >>> row.spec, gathered_axes(row, plan.batch_axes)  # the experts stay where they are; embed is gathered
    (P('data', 'fsdp', None), {'fsdp'})
    """
    names = row.names or (None,) * len(row.shape)
    resident = [d for d, name in enumerate(names) if name in _RESIDENT]
    return (_axes(row) - _dim_axes(row, resident)) & set(batch_axes)


def token_lookup(rows: Iterable[LeafLayout], batch_axes: Iterable[str]) -> tuple[Matmul | None, set[str]]:
    """The token embedding (the largest lookup table) when batch axes split its width but not its rows, with those
    axes: XLA then looks the tokens up in the local columns and exchanges the activations by all-to-all (forward
    and backward) rather than gathering the table, and the table's gradient stays where it lives.

    >>> import spmd, numpy as np
    >>> from flax import linen as nn
    >>> plan = spmd.Plan.from_logical_rules([("embed", "fsdp")]) + spmd.Plan(batch_axes=("fsdp",))
    >>> table = nn.LogicallyPartitioned(np.zeros((256, 64)), ("vocab", "embed"))
    >>> m, axes = token_lookup(plan.resolve({"embed": {"embedding": table}}, {"fsdp": 8}).leaves, plan.batch_axes)
    >>> m.row.path, axes
    ('embed/embedding', {'fsdp'})
    """
    tables = [m for m in matmuls(rows) if m.lookup]
    if not tables:
        return None, set()
    m = max(tables, key=lambda m: m.row.shape[m.in_dims[0]])
    split = gathered_axes(m.row, batch_axes)
    if not split or _dim_axes(m.row, m.in_dims) & split:
        return None, set()
    return m, split


def data_parallel_traffic(
    layout: Any, plan: Plan, mesh_shape: Mapping[str, int], *, stage_uses: tuple[float, float] | None = None
) -> list[Traffic]:
    """Collective traffic per step of the gradient reductions and parameter gathers the layouts imply, over the
    plan's :attr:`~spmd.Plan.data_axes` (the batch axes and the context axis: both split the data).

    For each parameter, with ``local`` its bytes per device:
    - batch axes that split the parameter (FSDP, set F of size nF, whichever plan part split it: see
      :func:`gathered_axes`): all-gather the full-over-F buffer before use ((nF−1)·local, once, or twice with
      ``plan.remat`` or in stacked layers, whose backward loop gathers its slice again — embedding tables, named
      ``.../embedding``, once), and reduce-scatter its gradient ((nF−1)·local); the token embedding split along
      its width only is not gathered at all (see :func:`token_lookup`);
    - batch axes over which the gradient is split but the parameter not (ZeRO-2, set E): reduce-scatter the
      gradient over E, then all-gather the updated shards ((nE−1)/nE · full each);
    - batch axes over which only the optimizer state is split (ZeRO-1, set E): all-reduce the gradient, then
      all-gather the updated shards;
    - remaining batch axes (set R): all-reduce the gradient, 2(nR−1)/nR of its buffer (see :func:`_reduce_rest`).

    With ``plan.accumulate`` = K, the FSDP gathers and reduce-scatters run once per microbatch (K times, each of
    the whole buffer), the other reductions once per step (:mod:`spmd._accumulate`); so too for an execution
    mode whose devices loop over their own microbatches (its ``iterations``: the busiest device's count).

    ``stage_uses``: in a pipeline, how many times per step a device gathers its stages' FSDP-split layers and
    reduces their gradients, in whole stacks (see ``spmd.pipeline.Pipeline.weight_uses``): every schedule action uses
    the weights afresh (W only those its equations read), rather than once forward and once backward.

    >>> import spmd, strategies, optax, jax, jax.numpy as jnp
    >>> mesh = spmd.make_mesh({"data": -1})
    >>> plan = strategies.data_parallel()
    >>> layout = spmd.resolve_state(plan, {"w": jax.ShapeDtypeStruct((256,), jnp.float32)}, optax.sgd(0.1), mesh)
    >>> [t.kind for t in data_parallel_traffic(layout, plan, mesh.shape)] == ["all-reduce"] * (mesh.size > 1)
    True
    """
    sizes = dict(mesh_shape)
    batch = set(plan.data_axes)
    totals = _Totals(sizes)
    table, _ = token_lookup(layout.params.leaves, batch)
    repeats = plan.accumulate * getattr(plan.execution, "iterations", 1)  # microbatches the busiest device runs

    # A precision policy gathers its cast copies; the gradients are reduced as the backward pass makes them, in
    # the compute dtype, except for the once-per-step reduction of accumulated gradients, which runs in the
    # policy's reduce dtype (spmd._accumulate); ZeRO-1/2 all-gather the updated stored shards.
    precision = plan.precision
    for p, g, m in zip(layout.params.leaves, layout.grads.leaves, layout.moments.leaves, strict=True):
        stored = p.bytes_per_device
        local, reduced = stored * _width(p, precision, "gather"), stored * _width(p, precision, "compute")
        once = stored * _width(p, precision, "reduce") if plan.accumulate > 1 else reduced
        p_axes, g_axes = _axes(p), _axes(g)
        fsdp = gathered_axes(p, batch) if table is None or p.path != table.row.path else set()
        n_fsdp = math.prod(sizes[a] for a in fsdp)
        zero2 = (g_axes - p_axes) & batch
        zero1 = ((_axes(m) - p_axes) & batch) - zero2
        rest = batch - p_axes - zero2
        layers = stacked(p)
        staged = stage_uses is not None and bool(p.names) and p.names[0] == A.STAGE
        if fsdp:
            # Rematerialised layers use their weights again in the backward pass, and a scan's backward loop
            # gathers its slice of the stored shards afresh rather than keep every layer's gathered weights, so
            # FSDP gathers them twice; an embedding table is gathered once, since the gradient of a lookup does
            # not need the table.
            times = 2 if (plan.remat or layers > 1) and not p.path.endswith("embedding") else 1
            times = (stage_uses[0] if staged else times) * repeats  # every microbatch gathers
            totals.add("all-gather", fsdp, times * local * n_fsdp, times * layers, combined=True)
        # The gradient arrives in the gathered (full-over-F) shape and is reduce-scattered over F and E together.
        grad_buffer = (reduced if fsdp else once) * n_fsdp
        if fsdp or zero2:
            reductions = stage_uses[1] if staged and fsdp else 1
            # Accumulation keeps the gradient in the parameters' FSDP layout: each microbatch reduce-scatters
            # into it; the other batch axes reduce once per step.
            reductions *= repeats if fsdp else 1
            count = (layers if fsdp else 1) * reductions
            totals.add("reduce-scatter", fsdp | zero2, reductions * grad_buffer, count, combined=True)
        n_zero2 = math.prod(sizes[a] for a in zero2)
        uses = stage_uses[1] * repeats if staged else plan.accumulate  # each reduces over context (automatic)
        _reduce_rest(totals, rest, _context_axes(plan), (once / n_zero2, reduced / n_zero2), uses, layers)
        if zero2:
            totals.add("all-gather", zero2, stored, combined=True)
        if zero1:
            totals.add("all-gather", zero1, stored, combined=True)
    return totals.result()


def _reduce_rest(
    totals: _Totals, rest: set[str], context: set[str], buffers: tuple[float, float], uses: float, layers: int
) -> None:
    """A gradient's all-reduces over the data axes that split none of it: over the batch axes once a step (of
    ``buffers[0]``, in the reduce dtype), over the context axis apart from them (XLA reduces the sequence's
    partial sums on their own), ``uses`` times of ``buffers[1]`` where a pipeline's program, automatic over the
    context axis (manual over the batch axes), reduces the layers' gradients at every backward action."""
    if rest & context:
        buffer, count = (buffers[1] * uses, uses * layers) if uses > 1 else (buffers[0], 1)
        totals.add("all-reduce", rest & context, buffer, count, combined=True)
    totals.add("all-reduce", rest - context, buffers[0], combined=True)


def pipeline_traffic(
    ticks: int, message_bytes: float, outer_bytes: float, axis: str, mesh_shape: Mapping[str, int]
) -> list[Traffic]:
    """A pipeline's own exchanges per step: every tick each device sends its message around both rings (two
    collective-permutes over ``axis`` of ``message_bytes`` each; one on two stages, where both rings are the
    same pair), and the gradients of the parameters outside the stacked layers (``outer_bytes``: embeddings,
    head; used on the first and last stage) are summed over the stages once.

    >>> [(t.kind, t.count, t.traffic_bytes) for t in pipeline_traffic(10, 100, 0, "stage", {"stage": 4})]
    [('collective-permute', 20, 2000.0)]
    >>> [(t.kind, t.count, t.traffic_bytes) for t in pipeline_traffic(10, 100, 0, "stage", {"stage": 2})]
    [('collective-permute', 10, 1000.0)]
    """
    totals, rings = _Totals(mesh_shape), 1 if mesh_shape[axis] == 2 else 2
    totals.add("collective-permute", (axis,), rings * ticks * message_bytes, rings * ticks)
    totals.add("all-reduce", (axis,), outer_bytes)
    return totals.result()


def subnet_traffic(summary: Mapping[str, Any], axis: str, *, masking: str) -> list[Traffic]:
    """Subnetwork data parallelism's gradient reductions per step (``summary``: ``spmd.execution.Subnetworks.figures``):
    shared parameters' gradients all-reduced over all workers, each part's over its owners only; with backward
    masking also the updated parts put back into every worker's full parameters (an all-reduce of the grouped
    parameters over all workers).

    >>> s = {"owned_grad_bytes": 100, "shared_grad_bytes": 0, "owners_per_group": 4, "parts": 2}
    >>> [(t.kind, t.traffic_bytes) for t in subnet_traffic(s, "data", masking="forward")]
    [('all-reduce', 150.0)]
    """
    n, parts = summary["owners_per_group"], summary["parts"]
    workers, owned, shared = n * parts, summary["owned_grad_bytes"], summary["shared_grad_bytes"]
    ring = lambda n, b: 2 * (n - 1) / n * b  # noqa: E731
    out = [Traffic("all-reduce", (axis,), shared, ring(workers, shared))] if shared and workers > 1 else []
    if n > 1:
        out.append(Traffic("all-reduce", (axis,), owned, ring(n, owned)))
    if masking == "backward":
        grouped = owned * parts  # every part's groups, in the full parameters
        out.append(Traffic("all-reduce", (axis,), grouped, ring(workers, grouped)))
    return out


# ------------------------------------------------------------------------------------------------- matmuls
def _attention_share(plan: Plan, sizes: Mapping[str, int]) -> float:
    """The share of the causal attention products a context-parallel device computes (its busiest device)."""
    cp = plan.context
    return 1.0 if cp is None else attention_share(cp, sizes.get(cp.axis, 1))


def _context_axes(plan: Plan) -> set[str]:
    return {plan.context.axis} if plan.context is not None else set()


def _seq_axes(plan: Plan, mesh_shape: Mapping[str, int]) -> set[str]:
    """Mesh axes a sequence-parallel or context-parallel plan splits the residual stream's sequence over."""
    entries = assign_by_rules((A.BATCH, A.SEQ, A.EMBED), plan.logical_rules())
    return {a for a in entries[1] if mesh_shape.get(a, 1) > 1}


def _tokens_per_device(plan: Plan, mesh_shape: Mapping[str, int], workload: Workload) -> float:
    ways = math.prod(mesh_shape[a] for a in plan.data_axes if a in mesh_shape)
    return workload.tokens / ways


def _capacity(workload: Workload, experts: int) -> int:
    return max(1, math.ceil(workload.capacity_factor * workload.top_k * workload.seq_len / experts))


def _rows_of(m: Matmul, plan: Plan, sizes: Mapping[str, int], workload: Workload) -> float:
    """Rows a matmul multiplies per device per layer: the local tokens, or for experts their dispatched slots."""
    tokens = _tokens_per_device(plan, sizes, workload)
    if not m.experts:
        return tokens
    if not workload.seq_len:  # no tokens: nothing is dispatched
        return 0.0
    return tokens / workload.seq_len * m.experts * _capacity(workload, m.experts)


def activation_traffic(layout: Any, plan: Plan, mesh_shape: Mapping[str, int], workload: Workload) -> list[Traffic]:
    """Collective traffic per step of the activations: tensor, sequence, 2-D tensor and expert parallelism.

    For every matmul (see :func:`matmuls`), with T its rows per device, over the model axes (those that are not
    batch axes): a split of its input dimensions over axes C all-reduces the output (T × local output) over C
    in the forward pass (again in the backward pass with ``plan.remat``, if its layer recomputes it:
    :attr:`Matmul.recomputed`); a split of its output dimensions over
    axes O all-reduces the input gradient (T × local input) over O in the backward pass (not for embedding
    lookups). Under sequence parallelism each all-reduce over the sequence axes is a reduce-scatter plus an
    all-gather of the same buffer, and the parameters not split over those axes all-reduce their gradients over
    them. Expert weights split over an axis move T × embed per MoE layer there and back by all-to-all, in the
    forward and the backward pass.

    >>> import spmd, strategies, optax, numpy as np
    >>> from flax import linen as nn
    >>> mlp = {"wi": {"kernel": nn.LogicallyPartitioned(np.zeros((8, 32), np.float32), ("embed", "mlp"))},
    ...        "wo": {"kernel": nn.LogicallyPartitioned(np.zeros((32, 8), np.float32), ("mlp", "embed"))}}
    >>> plan = strategies.tensor_parallel(axis="tensor")
    >>> layout = spmd.resolve_state(plan, mlp, optax.sgd(0.1), {"tensor": 4})
    >>> [(t.kind, t.axes, t.count) for t in activation_traffic(layout, plan, {"tensor": 4}, Workload(4, 16))]
    [('all-reduce', ('tensor',), 2)]

    Megatron's pair: ``wo``'s output is all-reduced forward, ``wi``'s input gradient backward.
    """
    sizes = dict(mesh_shape)
    model_axes = {a for a in sizes if a not in plan.data_axes}
    seq = _seq_axes(plan, sizes)
    totals = _Totals(sizes)
    forward_passes = 2 if plan.remat else 1

    def all_reduce(axes: set[str], buffer: float, count: int) -> None:
        if seq and axes == seq:
            totals.add("reduce-scatter", axes, buffer, count)
            totals.add("all-gather", axes, buffer, count)
        else:
            totals.add("all-reduce", axes, buffer, count)

    table, exchanged = token_lookup(layout.params.leaves, plan.data_axes)
    if table is not None:  # the looked-up tokens, full width, to the devices holding their batch and back
        buffer = _tokens_per_device(plan, sizes, workload) * table.local(table.out_dims, model_axes, sizes)
        totals.add("all-to-all", exchanged, 2 * buffer * workload.act_bytes, 2)
    for m in matmuls(layout.params.leaves):
        rows = _rows_of(m, plan, sizes, workload)
        contraction = _dim_axes(m.row, m.in_dims) & model_axes
        output = _dim_axes(m.row, m.out_dims) & model_axes
        if contraction:
            buffer = rows * m.local(m.out_dims, model_axes, sizes) * workload.act_bytes
            forwards = 1 + _recomputed(plan, m)
            all_reduce(contraction, forwards * m.layers * buffer, forwards * m.layers)
        if output and not m.lookup:
            buffer = rows * m.local(m.in_dims, model_axes, sizes) * workload.act_bytes
            all_reduce(output, m.layers * buffer, m.layers)
        expert_axes = _dim_axes(m.row, (m.row.names.index(A.EXPERT),)) if m.experts else set()
        if expert_axes and m.reads_residual:  # once per MoE layer: at its first weight
            buffer = rows * m.local(m.in_dims, model_axes, sizes) * workload.act_bytes
            passes = 2 * forward_passes + 2  # dispatch and return, forward (twice with remat) and backward
            totals.add("all-to-all", expert_axes, passes * m.layers * buffer, passes * m.layers)
    # Over sp's axis, gradients are reduced here; over the context axis, as over the batch's (data_parallel_traffic).
    sequence_only = seq - set(plan.data_axes)
    if sequence_only:
        for row in layout.grads.leaves:
            if not _axes(row) & sequence_only:
                totals.add("all-reduce", sequence_only, row.bytes_per_device, combined=True)
    return totals.result()


def context_traffic(layout: Any, plan: Plan, mesh_shape: Mapping[str, int], workload: Workload) -> list[Traffic]:
    """Context parallelism's own exchanges per step (see :mod:`spmd._context_parallel`), with ``T`` a device's
    tokens and ``b`` the bytes of its keys and values of one layer (``key``/``value`` matmul outputs):

    - ``allgather``: every layer all-gathers K and V (``c·b`` gathered) forward, and reduce-scatters their
      gradients backward; a remat policy gathers them again in the backward pass;
    - ``ring``: ``c − 1`` collective-permutes of K and V blocks (``b``) forward, as many of their gradients
      backward (again forward under remat);
    - ``alltoall``: Q, K, V and the output exchanged by all-to-all ((c−1)/c of each) forward and backward;
    - load balancing: the tokens put in head-tail order once, and the residual stream (``T × width``) back in order
      before the head, forward and backward, each in two collective-permutes of half a device's share.

    >>> import spmd, strategies, optax, jax
    >>> from spmd import models
    >>> params = jax.eval_shape(models.get("gpt-tiny", layers=2).init, jax.random.key(0))
    >>> plan, sizes = strategies.context_parallel(method="ring"), {"context": 4}
    >>> layout = spmd.resolve_state(plan, params, optax.sgd(0.1), sizes)
    >>> [(t.kind, t.count) for t in context_traffic(layout, plan, sizes, Workload(2, 32))]
    [('collective-permute', 30)]
    """
    cp = plan.context
    sizes = dict(mesh_shape)
    if cp is None or sizes.get(cp.axis, 1) <= 1:
        return []
    c, axis = sizes[cp.axis], {cp.axis}
    model_axes = {a for a in sizes if a not in plan.data_axes}
    tokens = _tokens_per_device(plan, sizes, workload)
    found = {_output_name(m): m for m in matmuls(layout.params.leaves)}
    totals = _Totals(sizes)
    # An execution mode that takes cp (a pipeline) runs the layers split over its axes, and moves the
    # sequence inside its branches by all-gathers.
    in_branches = plan.execution is not None
    if "key_proj" in found and "value_proj" in found:
        k, v, q = found["key_proj"], found["value_proj"], found.get("query_proj", found["key_proj"])
        layers = k.layers  # the layers one device runs (a pipeline's: its stage's)
        width = lambda m: m.local(m.out_dims, model_axes, sizes)  # noqa: E731
        kv = tokens * (width(k) + width(v)) * workload.act_bytes
        forwards = 2 if plan.remat else 1
        if cp.method == "allgather":
            totals.add("all-gather", axis, forwards * layers * c * kv, forwards * layers * 2)
            totals.add("reduce-scatter", axis, layers * c * kv, layers * 2)
        elif cp.method == "ring" and in_branches:
            # Between neighbour pairs (see _pass_on): each of the c − 1 blocks of K and of V arrives in an
            # all-gather over two devices (two blocks out, one received), its gradient in a reduce-scatter.
            rounds = 2 * layers * (c - 1)
            totals.add("all-gather", axis, forwards * rounds * kv, forwards * rounds, group=2)
            totals.add("reduce-scatter", axis, rounds * kv, rounds, group=2)
        elif cp.method == "ring":
            permutes = (forwards + 1) * layers * (c - 1)
            totals.add("collective-permute", axis, permutes * kv, 2 * permutes)
        else:
            qo = 2 * tokens * width(q) * workload.act_bytes
            totals.add("all-to-all", axis, (forwards + 1) * layers * (kv + qo), (forwards + 1) * layers * 4)
    residual = [m for m in matmuls(layout.params.leaves) if m.writes_residual]
    if cp.load_balance and residual:
        d = math.prod(residual[0].row.shape[i] for i in residual[0].out_dims)
        if in_branches:
            # Inside a pipeline's branches the sequence moves by one all-gather (see _moved_by_gather): the
            # first stage's tokens, the last stage's residual stream forward and its gradient scattered back.
            totals.add("all-gather", axis, c * tokens * 4, 1)  # int32 tokens
            totals.add("all-gather", axis, c * tokens * d * workload.act_bytes, 1)
            totals.add("reduce-scatter", axis, c * tokens * d * workload.act_bytes, 1)
            return totals.result()
        moving = sum(1 for moves in exchanges(c) if moves)  # of the two, the exchanges that move anything
        totals.add("collective-permute", axis, moving * tokens / 2 * 4, moving)  # int32 tokens
        totals.add("collective-permute", axis, 2 * moving * tokens / 2 * d * workload.act_bytes, 2 * moving)
    return totals.result()


def traffic(
    layout: Any,
    plan: Plan,
    mesh_shape: Mapping[str, int],
    workload: Workload | None,
    *,
    stage_uses: tuple[float, float] | None = None,
) -> list[Traffic]:
    """All the traffic the model expects per step: :func:`data_parallel_traffic` plus, given a workload,
    :func:`activation_traffic`; one entry per (kind, axes), largest first.

    >>> import spmd, strategies, optax, numpy as np
    >>> from flax import linen as nn
    >>> mlp = {"wi": {"kernel": nn.LogicallyPartitioned(np.zeros((8, 32), np.float32), ("embed", "mlp"))},
    ...        "wo": {"kernel": nn.LogicallyPartitioned(np.zeros((32, 8), np.float32), ("mlp", "embed"))}}
    >>> plan, sizes = strategies.data_parallel() + strategies.tensor_parallel(axis="tensor"), {"data": 2, "tensor": 4}
    >>> layout = spmd.resolve_state(plan, mlp, optax.sgd(0.1), sizes)
    >>> [t.axes for t in traffic(layout, plan, sizes, Workload(4, 16))]  # activations too, given a workload
    [('tensor',), ('data',)]
    >>> [t.axes for t in traffic(layout, plan, sizes, None)]
    [('data',)]
    """
    parts = data_parallel_traffic(layout, plan, mesh_shape, stage_uses=stage_uses)
    if workload is not None:
        parts += activation_traffic(layout, plan, mesh_shape, workload)
        parts += context_traffic(layout, plan, mesh_shape, workload)
    return merge_traffic(parts)


def merge_traffic(parts: Iterable[Traffic]) -> list[Traffic]:
    """One entry per (kind, axes), largest first.

    >>> merge_traffic([Traffic("all-reduce", ("data",), 100, 175), Traffic("all-reduce", ("data",), 100, 175)])
    [Traffic(kind='all-reduce', axes=('data',), bytes=200, traffic_bytes=350, count=2)]
    """
    merged: dict[tuple[str, tuple[str, ...]], Traffic] = {}
    for t in parts:
        old = merged.get((t.kind, t.axes))
        if old is not None:
            t = Traffic(t.kind, t.axes, old.bytes + t.bytes, old.traffic_bytes + t.traffic_bytes, old.count + t.count)
        merged[(t.kind, t.axes)] = t
    return sorted(merged.values(), key=lambda t: -t.traffic_bytes)


# ------------------------------------------------------------------------------------------------- compute, memory
def model_flops(params: Iterable[LeafLayout], workload: Workload) -> float:
    """The model's training FLOPs per step by the usual rule, 6·N·T (Kaplan et al.): N the weights that act as
    matmuls (embedding lookups left out; of an expert layer, the ``top_k`` of its experts a token uses), T the
    tokens of the step. The compiled matmul FLOPs over this show what a plan adds: recompute, replicated work.

    >>> import spmd, numpy as np
    >>> from flax import linen as nn
    >>> params = {"wi": {"kernel": nn.LogicallyPartitioned(np.zeros((8, 32), np.float32), ("embed", "mlp"))}}
    >>> model_flops(spmd.Plan().resolve(params).leaves, Workload(batch=4, seq_len=16))  # 6 · 256 weights · 64 tokens
    98304.0
    """
    weights = 0.0
    for m in matmuls(params):
        if m.lookup:
            continue
        size = math.prod(m.row.shape[d] for d in m.in_dims + m.out_dims) * m.layers
        weights += size * min(workload.top_k, m.experts) if m.experts else size
    return 6.0 * weights * workload.tokens


def flops_per_device(
    params: Iterable[LeafLayout], plan: Plan, mesh_shape: Mapping[str, int], workload: Workload
) -> float:
    """FLOPs one device computes per training step: matmuls (forward 2·T·in·out, backward twice that, the
    forward again under remat for those a layer recomputes, see :attr:`Matmul.recomputed`) and attention's two
    ``seq × seq`` products per head. Embedding lookups are free.

    >>> import spmd, numpy as np
    >>> from flax import linen as nn
    >>> params = {"wi": {"kernel": nn.LogicallyPartitioned(np.zeros((8, 32), np.float32), ("embed", "mlp"))}}
    >>> plan = spmd.Plan(batch_axes=("data",))
    >>> rows = plan.resolve(params, {"data": 2}).leaves
    >>> flops_per_device(rows, plan, {"data": 2}, Workload(batch=4, seq_len=16))  # 6 · 32 tokens · 8 · 32
    49152.0
    """
    sizes = dict(mesh_shape)
    model_axes = {a for a in sizes if a not in plan.data_axes}
    ms = matmuls(params)
    total = 0.0
    for m in ms:
        if m.lookup:
            continue
        rows = _rows_of(m, plan, sizes, workload)
        ways = math.prod(sizes[a] for a in _dim_axes(m.row, m.in_dims + m.out_dims) & model_axes)
        full = math.prod(m.row.shape[d] for d in m.in_dims + m.out_dims)
        passes = 3 + _recomputed(plan, m)  # forward, input and weight gradients (+ recomputed forward)
        total += passes * 2 * rows * full * m.layers / ways
    tokens = _tokens_per_device(plan, sizes, workload)
    for m in attention_parents(ms).values():
        width = m.local(m.out_dims, model_axes, sizes)
        # Scores and their product with the values; a policy keeping no untagged matmul output recomputes the
        # scores (the probabilities are not kept), and the product unless attention's output is kept.
        passes = 3 + (plan.remat.recomputes(None) + plan.remat.recomputes("attn_out")) / 2
        total += passes * 2 * 2 * tokens * workload.seq_len * width * m.layers * _attention_share(plan, sizes)
    return total


def pipeline_gathered_bytes(params: Iterable[LeafLayout], plan: Plan, mesh_shape: Mapping[str, int]) -> float:
    """The FSDP-gathered weights of one device's stacked layers (all its chunks) with their gradient: what a
    pipeline tick holds while it differentiates a chunk. ``params``: the stored rows (``[stage, chunk, layer,
    ...]`` for the stacked layers).

    >>> import numpy as np, strategies
    >>> from flax import linen as nn
    >>> names = ("stage", "chunk", "layers", "embed", "mlp")
    >>> box = nn.LogicallyPartitioned(np.zeros((1, 1, 4, 64, 64), np.float32), names)
    >>> plan, mesh = strategies.fsdp(min_bytes=0), {"fsdp": 4}
    >>> pipeline_gathered_bytes(plan.resolve({"w": box}, mesh).leaves, plan, mesh)  # 4 layers of 64·64 f32, twice
    131072
    """
    batch = set(plan.data_axes)
    gathered = sum(
        row.bytes_per_device * math.prod(mesh_shape[a] for a in _axes(row) & batch)
        for row in params
        if row.names and row.names[0] == A.STAGE and _axes(row) & batch
    )
    return 2 * gathered


def activation_bytes(
    params: Iterable[LeafLayout], plan: Plan, mesh_shape: Mapping[str, int], workload: Workload
) -> float:
    """An estimate of the activations one device keeps for the backward pass, per microbatch (the device's
    share of the batch), in device memory.

    Per layer, every matmul's input (inputs shared by sibling projections, like ``query``/``key``/``value``,
    counted once) and output, plus attention's probabilities; the logits three times (with their softmax and
    its gradient). Under a remat policy (``plan.remat``) the stacked layers keep each layer's input (the
    residual, split like it) and what the policy saves (``dots``: every matmul output and the attention scores;
    ``names``: the named matmul outputs; ``offload``: nothing more, the named ones go to the host, see
    :func:`host_activation_bytes`), and one layer's activations are live again while it is recomputed.

    >>> import spmd, numpy as np
    >>> from flax import linen as nn
    >>> rows = spmd.Plan().resolve({"wi": {"kernel": nn.LogicallyPartitioned(np.zeros((8, 32)), ("embed", "mlp"))}})
    >>> activation_bytes(rows.leaves, spmd.Plan(), {}, Workload(1, 16))  # (16 · 32 outputs + 16 · 8 inputs) · 4
    2560.0
    """
    return _activations(params, plan, mesh_shape, workload)[0]


def host_activation_bytes(
    params: Iterable[LeafLayout], plan: Plan, mesh_shape: Mapping[str, int], workload: Workload
) -> float:
    """The activations one device moves to host memory for the backward pass (an ``offload`` remat policy's
    named matmul outputs, every stacked layer's), per microbatch; 0 under other policies.

    >>> import spmd, numpy as np
    >>> from flax import linen as nn
    >>> wi = nn.LogicallyPartitioned(np.zeros((2, 8, 32)), ("layers", "embed", "mlp"))
    >>> rows = spmd.Plan().resolve({"mlp": {"wi": {"kernel": wi}}}).leaves
    >>> host_activation_bytes(rows, spmd.Plan(remat="offload:mlp_hidden"), {}, Workload(1, 16))  # 2 · 16 · 32 · 4
    4096.0
    """
    return _activations(params, plan, mesh_shape, workload)[1]


def _activations(
    params: Iterable[LeafLayout], plan: Plan, mesh_shape: Mapping[str, int], workload: Workload
) -> tuple[float, float]:
    """(device, host) bytes of the kept activations: see :func:`activation_bytes`."""
    sizes = dict(mesh_shape)
    model_axes = {a for a in sizes if a not in plan.data_axes}
    ms = matmuls(params)
    # The context axis already splits the tokens a device holds; sp's axis splits the kept residual besides.
    seq_ways = math.prod(sizes[a] for a in _seq_axes(plan, sizes) - set(_context_axes(plan)))
    tokens = _tokens_per_device(plan, sizes, workload)
    per_layer: dict[int, float] = {}  # stacked layer count -> elements per layer
    saved: dict[int, float] = {}  # stacked layer count -> elements per layer the remat policy keeps
    residual: dict[int, float] = {}
    inputs_seen: set[tuple[str, tuple]] = set()
    remat = plan.remat
    for m in ms:
        if m.lookup:
            continue
        rows = _rows_of(m, plan, sizes, workload)
        names = tuple(m.row.names[d] for d in m.in_dims) if m.row.names else m.in_dims
        elements = rows * m.local(m.out_dims, model_axes, sizes)
        if not remat.recomputes(_output_name(m)):
            saved[m.layers] = saved.get(m.layers, 0.0) + elements
        if m.logits:
            elements *= 3  # the logits, their softmax and its gradient are live together in the loss
        if (m.parent, names) not in inputs_seen:
            inputs_seen.add((m.parent, names))
            elements += rows * m.local(m.in_dims, model_axes, sizes)
        per_layer[m.layers] = per_layer.get(m.layers, 0.0) + elements
        if m.reads_residual and m.layers > 1:
            residual[m.layers] = tokens * m.local(m.in_dims, model_axes, sizes) / seq_ways
    for m in attention_parents(ms).values():
        heads_ways = math.prod(sizes[a] for a in _dim_axes(m.row, m.out_dims[:1]) & model_axes)
        heads = m.row.shape[m.out_dims[0]] // heads_ways
        scores = tokens * workload.seq_len * heads
        per_layer[m.layers] = per_layer.get(m.layers, 0.0) + scores
        if not remat.recomputes(None):  # dots keeps the scores (a matmul's output) too
            saved[m.layers] = saved.get(m.layers, 0.0) + scores
    device = host = 0.0
    for layers, elements in per_layer.items():
        if not remat or layers == 1:
            device += layers * elements
            continue
        kept = saved.get(layers, 0.0)
        device += layers * (residual.get(layers, 0.0) + (0.0 if remat.kind == "offload" else kept)) + elements
        host += layers * kept if remat.kind == "offload" else 0.0
    return device * workload.act_bytes, host * workload.act_bytes


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A modelled training step: compute at the device's sustained rate, then communication (no overlap).

    >>> StepTime(compute_s=2.0, comm_s=0.5, hardware="h100").total_s
    2.5
    """

    compute_s: float
    comm_s: float
    hardware: str

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    def to_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "comm_s": self.comm_s, "total_s": self.total_s, "hardware": self.hardware}


def step_time(flops: float, traffic: Iterable[Traffic], hw: Hardware, mesh_shape: Mapping[str, int]) -> StepTime:
    """Modelled step time: ``flops / (peak × utilisation)`` plus, per collective, its ring traffic over the
    bandwidth of the slowest link its axes cross and a latency per op; host-transfer traffic (offloaded state
    moved in and out) over the host link.

    >>> h = HARDWARE["h100"]
    >>> t = step_time(1e12, [Traffic("all-reduce", ("data",), 9e8, 9e8)], h, {"data": 8})
    >>> round(t.compute_s * 1e3, 3), round(t.comm_s * 1e3, 3)
    (2.022, 2.005)
    """
    comm = 0.0
    for t in traffic:
        bandwidth, latency = hw.link(t.axes, mesh_shape)
        if t.kind == HOST_TRANSFER:
            bandwidth, latency = hw.host_bandwidth, hw.ici_latency
        comm += t.traffic_bytes / bandwidth + t.count * latency
    return StepTime(flops / (hw.flops * hw.utilisation), comm, hw.name)


@dataclasses.dataclass(frozen=True)
class Contribution:
    """What an execution mode changes in the estimate (see ``spmd.execution.Executor.costs``).

    ``traffic``: the collectives that move parameters and gradients, replacing data parallelism's reductions and
    gathers (:func:`data_parallel_traffic`); the activations' traffic is added to it either way. ``activation_bytes``:
    what a device keeps for the backward pass, replacing :func:`activation_bytes`, with ``activation_note`` naming
    it in the report. ``compute_factor``: the step's compute time over a device's own compute (a pipeline's
    makespan over its busy time: the bubble). ``host_activation_bytes`` and ``host_traffic``: with
    ``activation_bytes``, what the mode keeps of them in host memory (an offload remat policy's activations) and
    moves between host and device per step. ``flops``: what a device computes per step, replacing
    :func:`flops_per_device` (a pipeline runs the head on one stage only).

    >>> Contribution().traffic is None
    True
    """

    traffic: tuple[Traffic, ...] | None = None
    activation_bytes: float | None = None
    activation_note: str = "activations kept for backward"
    compute_factor: float = 1.0
    host_activation_bytes: float = 0.0
    host_traffic: tuple[Traffic, ...] = ()
    flops: float | None = None


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What the cost model expects of one plan, per device and per step, without compiling anything.

    >>> import optax, jax, spmd
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), "float32")}
    >>> e = estimate(spmd.Plan(batch_axes=("data",)), params, {"data": 8}, Workload(batch=8, seq_len=16),
    ...              optimizer=optax.adam(1e-3), hardware=HARDWARE["h100"])
    >>> e.memory_bytes == e.per_device_bytes["total"] + 4 * 1024 * 1024 + e.activation_bytes
    True
    """

    per_device_bytes: dict[str, int]  # model state: params, grads, optimizer, total
    activation_bytes: int
    padding_bytes: int  # of block alignment, in the stored parameters, gradients and optimizer state
    traffic: tuple[Traffic, ...]
    flops: float
    time: StepTime
    activation_note: str = "activations kept for backward"
    host_bytes: int = 0  # per device, of state offloaded to host memory (not in per_device_bytes' total)
    host_traffic: tuple[Traffic, ...] = ()  # offloaded state and activations moved to and from the device, per step
    accumulator_bytes: int = 0  # the float32 accumulated gradient, with plan.accumulate > 1
    host_activation_bytes: int = 0  # moved to host memory by an offload remat policy, outside memory_bytes

    @property
    def memory_bytes(self) -> int:
        """What must fit in a device's memory at the step's peak: the model state, the kept activations (or an
        offloaded optimizer state brought in for the update, if larger), and the optimizer's update (a temporary
        the size of the parameters) and any accumulated gradient."""
        kept = max(self.activation_bytes, self.host_bytes)
        return self.per_device_bytes["total"] + self.per_device_bytes["params"] + kept + self.accumulator_bytes

    @property
    def comm_bytes(self) -> int:
        return int(sum(t.traffic_bytes for t in self.traffic))

    def step_memory(self, batch_bytes: int) -> dict[str, int]:
        """The step's memory per device, as the compiler reports it: its arguments (the training state — the
        parameters, the optimizer state, the int32 step — and ``batch_bytes`` of batch) exactly, and an estimate
        of its temporaries (the gradients, the optimizer's parameter-sized update and the kept activations).

        With the optimizer state offloaded (``host_bytes``), the arguments hold none of it; it comes to the device
        for the update, after the backward pass has freed the activations, so the temporaries hold the larger of
        the two; ``host_argument_bytes`` and ``host_transfer_bytes`` (moved in and out per step) are added.

        >>> e = Estimate({"params": 8, "grads": 8, "optimizer": 16, "total": 32}, 100, 0, (), 0.0, None)
        >>> e.step_memory(10)
        {'argument_bytes': 38, 'activation_bytes': 100, 'padding_bytes': 0, 'temp_bytes': 116, 'peak_bytes': 154}
        """
        state, extra = self.per_device_bytes, self.accumulator_bytes
        out = {
            "argument_bytes": state["params"] + state["optimizer"] + 4 + batch_bytes,
            "activation_bytes": self.activation_bytes,
            "padding_bytes": self.padding_bytes,
            "temp_bytes": state["grads"]
            + state["params"]
            + state.get("compute_params", 0)
            + max(self.activation_bytes, self.host_bytes)
            + extra,
        }
        out |= {"peak_bytes": out["argument_bytes"] + out["temp_bytes"]}
        if self.host_bytes:
            out |= {"host_argument_bytes": self.host_bytes}
        if self.host_activation_bytes:
            out |= {"host_activation_bytes": self.host_activation_bytes}
        if self.host_traffic:
            out |= {"host_transfer_bytes": int(sum(t.bytes for t in self.host_traffic))}
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "per_device_bytes": self.per_device_bytes,
            "activation_bytes": self.activation_bytes,
            "accumulator_bytes": self.accumulator_bytes,
            "memory_bytes": self.memory_bytes,
            "padding_bytes": self.padding_bytes,
            "comm_bytes_per_step": self.comm_bytes,
            "collectives": [t.to_dict() for t in self.traffic],
            "flops_per_device": self.flops,
            "step_time": self.time.to_dict(),
        } | (
            {"host_bytes": self.host_bytes, "host_traffic": [t.to_dict() for t in self.host_traffic]}
            if self.host_traffic
            else {}
        )


def padding_bytes(layout: StateLayout) -> int:
    """Bytes per device that block-aligned sharding adds: each padded parameter's padding, once for the
    parameter, once for its gradient and once per optimizer moment mirroring it.

    >>> import jax, optax, spmd, strategies
    >>> plan, w = strategies.fsdp(axis="data", min_bytes=0, block=8), jax.ShapeDtypeStruct((4, 16), "float32")
    >>> layout = spmd.resolve_state(plan, {"w": w}, optax.adam(1e-3), {"data": 4})  # 16 columns padded to 32
    >>> padding_bytes(layout)  # 64 bytes per device, for the parameter, its gradient and Adam's 2 moments
    256
    """
    total = 0
    for p in layout.params.leaves:
        if p.padded_shape is None:
            continue
        suffix = "/" + p.path.split("/", 1)[-1]
        moments = sum(1 for r in layout.opt_state.leaves if r.shape == p.padded_shape and r.path.endswith(suffix))
        total += p.padding_bytes_per_device * (2 + moments)
    return total


def estimate_layout(
    layout: StateLayout,
    plan: Plan,
    mesh_shape: Mapping[str, int],
    workload: Workload,
    hardware: Hardware,
    contribution: Contribution = Contribution(),  # noqa: B008 - frozen, shared safely
) -> Estimate:
    """The cost model's view of a training state's ``layout``: model state, activations, traffic, FLOPs and a
    step time on ``hardware``, with what the execution mode contributes (see :class:`Contribution`).

    >>> import optax, jax, spmd
    >>> plan = spmd.Plan(batch_axes=("data",))
    >>> layout = resolve_state(plan, {"w": jax.ShapeDtypeStruct((256, 256), "float32")}, optax.sgd(0.1), {"data": 8})
    >>> e = estimate_layout(layout, plan, {"data": 8}, Workload(batch=8, seq_len=16), HARDWARE["h100"])
    >>> [t.kind for t in e.traffic], e.per_device_bytes["params"]
    (['all-reduce'], 262144)
    """
    if plan.precision is not None:  # activations are the compute dtype's
        workload = dataclasses.replace(workload, act_bytes=plan.precision.itemsize("compute"))
    moved = contribution.traffic
    if moved is None:
        moved = data_parallel_traffic(layout, plan, mesh_shape)
    exchanged = [
        *activation_traffic(layout, plan, mesh_shape, workload),
        *context_traffic(layout, plan, mesh_shape, workload),
    ]
    moved = tuple(merge_traffic([*moved, *exchanged]))
    kept, host_acts, acts_moved = (
        contribution.activation_bytes,
        contribution.host_activation_bytes,
        contribution.host_traffic,
    )
    if kept is None:  # accumulation keeps one microbatch's activations at a time
        micro = dataclasses.replace(workload, batch=max(workload.batch // plan.accumulate, 1))
        kept, host_acts = _activations(layout.params.leaves, plan, mesh_shape, micro)
        # Each microbatch's offloaded activations go to the host in its forward and come back for its backward.
        acts_moved = host_traffic(int(host_acts * plan.accumulate))
    flops = contribution.flops
    if flops is None:
        flops = flops_per_device(layout.params.leaves, plan, mesh_shape, workload)
    state, host = model_state_bytes(layout, plan.precision), 0
    if "optimizer" in plan.offload:  # ZeRO-Offload: the optimizer state lives in host memory between steps
        host = state["optimizer"]
        state = state | {"optimizer": 0, "total": state["total"] - host, "host_optimizer": host}
    streamed = (*host_traffic(host), *acts_moved)
    time = step_time(flops, (*moved, *streamed), hardware, mesh_shape)
    time = dataclasses.replace(time, compute_s=time.compute_s * contribution.compute_factor)
    return Estimate(
        per_device_bytes=state,
        activation_bytes=int(kept),
        padding_bytes=padding_bytes(layout),
        traffic=moved,
        flops=flops,
        time=time,
        activation_note=contribution.activation_note,
        host_bytes=host,
        host_traffic=streamed,
        accumulator_bytes=accumulator_bytes(layout, plan),
        host_activation_bytes=int(host_acts),
    )


def host_traffic(offloaded_bytes: int) -> tuple[Traffic, ...]:
    """The per-step traffic between host and device memory of ``offloaded_bytes`` per device (state the update
    reads and writes, or activations the backward reads): moved each way once, each device its own (no mesh axes).

    >>> host_traffic(1024)
    (Traffic(kind='host-transfer', axes=(), bytes=2048, traffic_bytes=2048, count=2),)
    >>> host_traffic(0)
    ()
    """
    if offloaded_bytes <= 0:
        return ()
    return (Traffic(HOST_TRANSFER, (), 2 * offloaded_bytes, 2 * offloaded_bytes, 2),)


def accumulator_bytes(layout: StateLayout, plan: Plan) -> int:
    """Bytes per device of the accumulated gradient (:mod:`spmd._accumulate`): a float32 array per parameter,
    in the parameter's layout; none without accumulation.

    >>> import jax, optax, spmd
    >>> plan = spmd.Plan(batch_axes=("data",)).with_accumulation(4)
    >>> layout = resolve_state(plan, {"w": jax.ShapeDtypeStruct((256,), "bfloat16")}, optax.sgd(0.1), {"data": 8})
    >>> accumulator_bytes(layout, plan)
    1024
    """
    if plan.accumulate == 1:
        return 0
    return sum(r.bytes_per_device * 4 // jnp.dtype(r.dtype).itemsize for r in layout.params.leaves)


def estimate(
    plan: Plan,
    params: Any,
    mesh_shape: Mapping[str, int],
    workload: Workload,
    *,
    optimizer: Any,
    hardware: Hardware,
) -> Estimate:
    """The cost model's view of ``plan`` (plain SPMD execution) for abstract (annotated) ``params`` on mesh sizes
    alone: model state, activations, traffic, FLOPs and a step time on ``hardware`` (see :class:`Estimate`).

    >>> import jax, optax, spmd
    >>> params = {"w": jax.ShapeDtypeStruct((256, 256), "float32")}
    >>> e = estimate(spmd.Plan(batch_axes=("data",)), params, {"data": 8}, Workload(batch=8, seq_len=16),
    ...              optimizer=optax.sgd(0.1), hardware=HARDWARE["h100"])
    >>> e.per_device_bytes["params"], e.flops  # 6 FLOPs · 16 tokens per device · 256 · 256
    (262144, 6291456.0)
    """
    if plan.execution is not None:
        raise PlanError(
            f"costmodel.estimate prices plans that SPMD annotations run; this one runs "
            f"{plan.execution.describe()}: build its spmd.TrainStep and use spmd.report (or estimate_layout with "
            f"the step's executor.costs)"
        )
    plan.check_mesh(mesh_shape)
    return estimate_layout(resolve_state(plan, params, optimizer, mesh_shape), plan, mesh_shape, workload, hardware)


def compare(compiled: float, analytic: float) -> str | None:
    """A flag when compiled and analytic figures differ by more than :data:`TOLERANCE`, else None.

    >>> compare(105, 100) is None, compare(150, 100)
    (True, 'compiled is 1.50× the analytic figure: ...')
    """
    if analytic == 0:
        return None if compiled == 0 else "the compiler communicates where the model expects nothing"
    ratio = compiled / analytic
    if abs(ratio - 1) <= TOLERANCE:
        return None
    if ratio < 1:
        return (
            f"compiled is {ratio:.2f}× the analytic figure: the compiler found something cheaper (e.g. gathering "
            f"activations instead of weights when the batch is small, or keeping a gathered weight alive)"
        )
    return (
        f"compiled is {ratio:.2f}× the analytic figure: an unexpected collective usually means an intermediate "
        f"left replicated (add a constraint) or a layout the compiler reshards between layers"
    )
