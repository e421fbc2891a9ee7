"""What collectives a compiled SPMD program really runs, read from its optimised HLO text.

``jax.jit(f).lower(...).compile().as_text()`` is the module XLA executes after SPMD partitioning, collective
combining and loop optimisation. :func:`collectives` walks it from ``ENTRY``, multiplies ops inside ``while``
bodies by their known trip counts, and maps each op's replica groups back to the mesh axes they span.

Facts about the text on this stack (jax/jaxlib 0.10.2, XLA CPU) that the parser relies on:

* Device numbers in ``replica_groups`` / ``source_target_pairs`` are positions in the program's device
  assignment, which for a jitted program over a mesh is ``mesh.devices.flat`` order -- not ``Device.id``.
  (Checked with a mesh built from a permuted ``jax.devices()``: the HLO groups stay ``{{0,4},...}`` for a psum
  over the leading axis and ``runtime_executable().local_devices()`` equals ``list(mesh.devices.flat)``.)
* Replica groups come in three spellings: explicit ``{{0,1},{2,3}}``, iota ``[4,2]<=[2,4]T(1,0)``, and the
  mesh-axes form ``mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}`` whose
  axis names are XLA's own, not the jax mesh's.
* Trip counts sit in the while op's ``backend_config={..."known_trip_count":{"n":"5"}}``.
* Loop-invariant collectives get hoisted out of while bodies by XLA, so only loop-variant ones are multiplied.

:func:`matmul_flops` reads the program's matmul work the same way: each ``dot`` (also inside the fusions the CPU
backend wraps matmuls in) is 2 FLOPs per multiply-add, weighted as collectives are; convolutions and elementwise
work are not counted, so the figure compares with the cost model's matmul FLOPs.

All-reduces that are only sliced count as reduce-scatters. XLA's CPU pipeline has no reduce-scatter pass, so where
the SPMD partitioner wants a reduced buffer sharded (ZeRO-2 gradients constrained to ``P("data", None)``, FSDP's
gradient reduction) the CPU program runs ``all-reduce`` and then has each device ``dynamic-slice`` its 1/N out of
the result, e.g. over ``Mesh(devices, ("data",))``::

    %all-reduce.2 = (f32[256,64]{1,0}, f32[256]{0}) all-reduce(%dot.1, %wrapped_reduce), ...
    %get-tuple-element.3 = f32[256]{0} get-tuple-element(%all-reduce.2), index=1
    %multiply_dynamic-slice_fusion = f32[32]{0} fusion(%get-tuple-element.3, %partition-id.1), calls=%fc.1
    ...  in %fc.1: %dynamic-slice.5 = f32[32]{0} dynamic-slice(%param_0.1, %multiply.6), dynamic_slice_sizes={32}

GPU and TPU pipelines rewrite exactly that pair into one ``reduce-scatter`` (half the traffic of the all-reduce),
so an inventory taken on CPU would otherwise overstate what the program costs on an accelerator. An all-reduce (or
one element of a combined, tuple-shaped one) is recognised when every use of its result -- through
``get-tuple-element``, ``bitcast``/``copy``/``reshape``/``transpose``, ``all-reduce-done``, and into fusions via the
fused computation's parameter -- is the data operand of a ``dynamic-slice``/``slice`` that keeps 1/N of it along
exactly one dimension (N the group size). It is then reported with ``kind="reduce-scatter"`` and
``raw_kind="all-reduce"`` (what the CPU program really runs), ``bytes`` the full buffer S and reduce-scatter
traffic (N-1)/N*S; a combined all-reduce whose elements differ is split between the two entries by bytes.

Narrow floats count at the width the program moves them. XLA:CPU cannot run bf16 collectives: its float
normalisation widens each bf16 all-gather, all-reduce or reduce-scatter to f32, rounding the operand through bf16
first (a ``convert_convert_fusion`` f32 -> bf16 -> f32 feeds an f32 all-gather; reductions get a ``*_promoted``
reduction). GPU and TPU send bf16. So, as for reduce-scatters, the inventory counts what an accelerator runs: a
collective whose operand was last converted from a narrower float (followed through value-keeping ops and into
fusions) has ``bytes`` and ``traffic_bytes`` at that width and ``dtype`` naming it, and ``wire_bytes`` keeps the
buffer at the width the CPU program sends.

For example (``collectives`` of a program gathering a buffer rounded through bf16):

>>> text = '''HloModule m, num_partitions=2
... %fused (param_0: f32[4]) -> f32[4] {
...   %param_0 = f32[4]{0} parameter(0)
...   %convert.1 = bf16[4]{0} convert(%param_0)
...   ROOT %convert.2 = f32[4]{0} convert(%convert.1)
... }
... ENTRY %main (p: f32[4]) -> f32[8] {
...   %p = f32[4]{0} parameter(0)
...   %convert_convert_fusion = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused
...   ROOT %g = f32[8]{0} all-gather(%convert_convert_fusion), replica_groups={{0,1}}, dimensions={0}
... }'''
>>> [(c.dtype, c.bytes, c.wire_bytes) for c in collectives(text)]
[('bf16', 16, 32)]
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import jax
import numpy as np

__all__ = ["Collective", "collectives", "matmul_flops", "num_devices"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Bits per element; sub-byte types are packed, so bytes are rounded up per buffer.
_DTYPE_BITS = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "bf16": 16,
    "f16": 16,
    "s16": 16,
    "u16": 16,
    "f32": 32,
    "s32": 32,
    "u32": 32,
    "f64": 64,
    "s64": 64,
    "u64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}

_ARRAY_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_CALLEE_ATTR = re.compile(
    r"\b(to_apply|calls|condition|body|true_computation|false_computation|branch_computations"
    r"|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRANSFORMED = re.compile(r"\w+\(|\)")  # a transformation's name and parentheses around a scope
_TRIP_COUNT = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective over one set of mesh axes, summed over a whole program run."""

    kind: str
    axes: tuple[str, ...]
    group_size: int
    count: int
    bytes: int
    traffic_bytes: int
    #: The op the compiled program really runs; differs from ``kind`` only for an all-reduce whose result is only
    #: sliced, which counts as the ``reduce-scatter`` accelerator backends turn it into (see the module doc).
    raw_kind: str = ""
    #: Empty when each group spans its mesh axes whole; else, per axis in ``axes``, how many of its coordinates
    #: one group spans. XLA's partitioner makes such part-axis groups when it reshards in steps (a gather from a
    #: table split over an axis the indices are split over too gathers over 2 of a 4-device axis).
    spans: tuple[int, ...] = ()
    #: The element type the program moves (``bf16``), as GPU and TPU run it: ``bytes`` and ``traffic_bytes`` count
    #: at this width. XLA:CPU widens narrow floats on its wire (see the module doc); ``wire_bytes`` is the full
    #: buffer at the width it really sends (equal to ``bytes`` where nothing was widened).
    dtype: str = dataclasses.field(default="", compare=False)  # descriptive: equal inventories need not name it
    wire_bytes: int = -1

    def __post_init__(self) -> None:
        if not self.raw_kind:
            object.__setattr__(self, "raw_kind", self.kind)
        if self.wire_bytes < 0:
            object.__setattr__(self, "wire_bytes", self.bytes)

    @property
    def widened(self) -> bool:
        """Whether the compiled program sends a wider type than the program's own (CPU's bf16 -> f32)."""
        return self.wire_bytes != self.bytes

    def to_dict(self) -> dict:
        """A JSON-ready dict; ``axes`` becomes a list."""
        return {
            "kind": self.kind,
            "raw_kind": self.raw_kind,
            "count": self.count,
            "bytes": self.bytes,
            "traffic_bytes": self.traffic_bytes,
            "axes": list(self.axes),
            "group_size": self.group_size,
            "spans": list(self.spans),
            "dtype": self.dtype,
            "wire_bytes": self.wire_bytes,
        }


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: str
    attrs: str
    root: bool = False


def collectives(
    hlo_text: str,
    mesh: jax.sharding.Mesh | None = None,
    *,
    branch_weights: Mapping[str, Sequence[float]] | None = None,
) -> list[Collective]:
    """The collectives ``hlo_text`` executes per run, aggregated by (kind, raw_kind, axes, group_size).

    ``hlo_text`` is ``compiled.as_text()``; ``mesh`` (the one the program was jitted over) names the axes,
    which stay empty without it. Degenerate collectives (one device per group) are dropped. An all-reduce whose
    result is only sliced to 1/N counts as a reduce-scatter (see the module doc); a combined one split between
    both kinds adds one to the count of each. Sorted by ``traffic_bytes``, largest first.

    Each branch of a conditional counts as if it ran (an upper bound), except for conditionals made under a
    named scope in ``branch_weights``: there branch ``i`` counts ``branch_weights[scope][i]`` times per run of
    the conditional (a pipeline's tick switch, whose branches' shares the schedule gives).

    >>> text = '''HloModule m, num_partitions=2
    ... ENTRY %main (p: f32[8]) -> f32[8] {
    ...   %p = f32[8]{0} parameter(0)
    ...   ROOT %r = f32[8]{0} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, to_apply=%add
    ... }'''
    >>> collectives(text)  # doctest: +NORMALIZE_WHITESPACE
    [Collective(kind='all-reduce', axes=(), group_size=2, count=1, bytes=32, traffic_bytes=32,
                raw_kind='all-reduce', spans=(), dtype='f32', wire_bytes=32)]

    On a real program (a single device runs no collectives at all, so the check holds for any count):

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()), ("i",))
    >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    >>> ops = collectives(jax.jit(f).lower(jnp.ones(4 * mesh.size)).compile().as_text(), mesh)
    >>> all(c.kind == "all-reduce" and c.axes == ("i",) and c.bytes == 16 for c in ops)
    True
    """
    computations, entry = _parse_module(hlo_text)
    if entry is None:
        return []
    devices = num_devices(hlo_text)
    multiplier = _multipliers(computations, entry, branch_weights or {})

    flow = _Dataflow(computations)
    totals: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    dtypes: dict[tuple, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for comp_name, times in multiplier.items():
        instrs = computations[comp_name]
        shapes = {i.name: i.shape for i in instrs}
        for instr in instrs:
            op = _describe(instr, shapes, devices, mesh)
            if op is None:
                continue
            kind, (axes, spans), n, size = op
            parts = [(kind, size)]
            if kind == "all-reduce":
                scattered = _sliced_bytes(flow, comp_name, instr, n)
                split = [("reduce-scatter", scattered), ("all-reduce", size - scattered)]
                parts = [(k, b) for k, b in split if b > 0] or parts
            dtype, narrow = payload(flow, comp_name, instr)
            for counted, nbytes in parts:
                key = (counted, kind, axes, n, spans)
                total = totals[key]
                total[0] += times
                total[1] += times * nbytes * narrow
                total[2] += times * nbytes * narrow * _traffic_factor(counted, n)
                total[3] += times * nbytes
                dtypes[key][dtype] += times * nbytes * narrow

    return _inventory(totals, dtypes)


def _inventory(totals: Mapping[tuple, list[float]], dtypes: Mapping[tuple, Mapping[str, float]]) -> list[Collective]:
    """One :class:`Collective` per (kind, raw_kind, axes, group_size, spans), the largest traffic first."""
    out = [
        Collective(
            kind,
            axes,
            n,
            round(count),
            round(nbytes),
            round(traffic),
            raw_kind,
            spans,
            max(dtypes[key], key=dtypes[key].get),
            round(wire),
        )  # fmt: skip
        for key, (count, nbytes, traffic, wire) in totals.items()
        for kind, raw_kind, axes, n, spans in [key]
    ]
    out.sort(key=lambda c: (-c.traffic_bytes, c.kind, c.raw_kind, c.axes, c.spans))
    return out


def _traffic_factor(kind: str, n: int) -> float:
    # Per-device bytes sent by a bandwidth-optimal ring implementation, as a fraction of the full buffer S.
    if kind == "all-reduce":
        return 2 * (n - 1) / n
    if kind == "collective-permute":
        return 1.0
    return (n - 1) / n


_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([\d,\s]*)\}")


def matmul_flops(hlo_text: str, *, branch_weights: Mapping[str, Sequence[float]] | None = None) -> float:
    """Matmul FLOPs of one run of the program ``hlo_text`` (``compiled.as_text()``), per device; loops weighted
    by their trip counts and switch branches by ``branch_weights``, as :func:`collectives` weighs them.

    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda a, b: jax.lax.fori_loop(0, 3, lambda i, x: x @ b, a))
    >>> matmul_flops(f.lower(jnp.ones((4, 8)), jnp.ones((8, 8))).compile().as_text())  # 3 · 2 · 4·8 · 8
    1536.0
    """
    computations, entry = _parse_module(hlo_text)
    if entry is None:
        return 0.0
    total = 0.0
    for name, times in _multipliers(computations, entry, branch_weights or {}).items():
        instrs = computations[name]
        shapes = {i.name: i.shape for i in instrs}
        for instr in instrs:
            if instr.opcode == "dot":
                total += times * _dot_flops(instr.shape, _operand_shapes(instr.operands, shapes), instr.attrs)
    return total


def _dot_flops(result: str, operands: list[str | None], attrs: str) -> float:
    contracting = _CONTRACTING.search(attrs)
    lhs = _ARRAY_SHAPE.findall(operands[0] or "") if operands else []
    out = _ARRAY_SHAPE.findall(result)
    if contracting is None or len(lhs) != 1 or len(out) != 1:
        return 0.0
    lhs_dims = [int(d) for d in lhs[0][1].split(",") if d.strip().isdigit()]
    out_dims = [int(d) for d in out[0][1].split(",") if d.strip().isdigit()]
    dims = [int(d) for d in contracting.group(1).split(",") if d.strip()]
    if any(d >= len(lhs_dims) for d in dims):
        return 0.0
    return 2.0 * math.prod(out_dims) * math.prod(lhs_dims[d] for d in dims)


# ---------------------------------------------------------------------------- module parsing


def _parse_module(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    computations: dict[str, list[_Instr]] = {}
    entry = None
    current: list[_Instr] | None = None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and not line.startswith(("HloModule", " ")):
                current = computations.setdefault(header.group(2).lstrip("%"), [])
                if header.group(1):
                    entry = header.group(2).lstrip("%")
            continue
        if line.startswith("}"):
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            current.append(instr)
    return computations, entry


def _parse_instr(line: str) -> _Instr | None:
    match = _INSTR.match(line)
    if match is None:
        return None
    name, rest = match.group(2).lstrip("%"), match.group(3)
    if rest.startswith("("):
        end = _matching(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode_match = re.match(r"([\w\-]+)\(", rest)
    if opcode_match is None:
        return None
    open_at = opcode_match.end() - 1
    close_at = _matching(rest, open_at)
    operands, attrs = rest[open_at + 1 : close_at], rest[close_at + 1 :]
    return _Instr(name, shape, opcode_match.group(1), operands, attrs, root=bool(match.group(1)))


def _matching(text: str, open_at: int) -> int:
    pairs = {"(": ")", "{": "}", "[": "]"}
    opener, closer, depth = text[open_at], pairs[text[open_at]], 0
    for i in range(open_at, len(text)):
        if text[i] == opener:
            depth += 1
        elif text[i] == closer:
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


def num_devices(text: str) -> int:
    """How many devices the compiled program ``text`` runs on: its partitions times its replicas.

    >>> import jax, jax.numpy as jnp
    >>> num_devices(jax.jit(lambda x: x + 1).lower(jnp.ones(4)).compile().as_text())
    1
    """
    header = text[: text.find("\n")] if "\n" in text else text
    partitions = re.search(r"\bnum_partitions=(\d+)", header)
    replicas = re.search(r"\breplica_count=(\d+)", header)
    return (int(partitions.group(1)) if partitions else 1) * (int(replicas.group(1)) if replicas else 1)


def _callees(instr: _Instr, branch_weights: Mapping[str, Sequence[float]]) -> list[tuple[str, float]]:
    """(computation, executions per execution of ``instr``) for each computation ``instr`` calls."""
    # A natively async collective (`all-gather-start`) is counted itself; descending into whatever it
    # references as well would count it twice. `-done`/`-update` halves repeat the `-start`'s callee.
    if instr.opcode.endswith(("-done", "-update")) or _collective_kind(instr.opcode):
        return []
    attrs = _QUOTED.sub('""', instr.attrs)
    scope = _OP_NAME.search(instr.attrs)
    # A named scope that JAX's transformations wrap (``jvp(scope)``, ``transpose(jvp(scope))``) is the scope.
    path = _TRANSFORMED.sub("", scope.group(1)) if scope else ""
    trips: float = 1
    if instr.opcode == "while":
        found = _TRIP_COUNT.search(instr.attrs)
        # A loop whose bound each device reads for itself (uneven shares) is weighed by its named scope's one
        # weight, the busiest device's trip count; without either, the body is counted once: a lower bound.
        named = next((w for name, w in branch_weights.items() if path.endswith(f"{name}/while") and len(w) == 1), None)
        trips = int(found.group(1)) if found else float(named[0]) if named else 1
    weights = None
    if instr.opcode == "conditional":
        weights = next((w for name, w in branch_weights.items() if path.endswith(f"{name}/cond")), None)
    out = []
    for key, value in _CALLEE_ATTR.findall(attrs):
        # Each conditional branch counts as if it ran: an upper bound, since exactly one runs (unless weighted).
        times = trips if key == "body" else trips + 1 if key == "condition" and instr.opcode == "while" else 1
        names = re.findall(r"%?([\w.\-]+)", value)
        if key == "branch_computations" and weights is not None and len(weights) == len(names):
            out.extend((name.lstrip("%"), float(w)) for name, w in zip(names, weights, strict=True))
        else:
            out.extend((name.lstrip("%"), times) for name in names)
    return out


def _multipliers(
    computations: dict[str, list[_Instr]], entry: str, branch_weights: Mapping[str, Sequence[float]]
) -> dict[str, float]:
    """How many times each computation reachable from ``entry`` runs per program run."""
    edges: dict[str, list[tuple[str, int]]] = {}
    stack, seen = [entry], {entry}
    while stack:
        comp = stack.pop()
        edges[comp] = [
            (callee, times)
            for instr in computations.get(comp, [])
            for callee, times in _callees(instr, branch_weights)
            if callee in computations
        ]
        for callee, _ in edges[comp]:
            if callee not in seen:
                seen.add(callee)
                stack.append(callee)
    # HLO call graphs are acyclic, so a topological order exists; a computation called from two places (or
    # from two callers) accumulates both.
    indegree = dict.fromkeys(seen, 0)
    for callees in edges.values():
        for callee, _ in callees:
            indegree[callee] += 1
    mult = dict.fromkeys(seen, 0)
    mult[entry] = 1
    ready = [c for c, d in indegree.items() if d == 0]
    while ready:
        comp = ready.pop()
        for callee, times in edges[comp]:
            mult[callee] += mult[comp] * times
            indegree[callee] -= 1
            if indegree[callee] == 0:
                ready.append(callee)
    return {c: m for c, m in mult.items() if m > 0}


# ---------------------------------------------------------------------------- one collective


def _collective_kind(opcode: str) -> tuple[str, bool] | None:
    """(kind, is_async_start) for a collective opcode, else None."""
    if opcode in KINDS:
        return opcode, False
    if opcode.endswith("-start") and opcode[: -len("-start")] in KINDS:
        return opcode[: -len("-start")], True
    return None


def _describe(
    instr: _Instr, shapes: dict[str, str], num_devices: int, mesh: jax.sharding.Mesh | None
) -> tuple[str, tuple[tuple[str, ...], tuple[int, ...]], int, int] | None:
    """(kind, (axes, spans), group_size, bytes of one execution) for a non-degenerate collective, else None."""
    found = _collective_kind(instr.opcode)
    if found is None:
        return None
    kind, is_start = found
    attrs = _QUOTED.sub('""', instr.attrs)
    if kind == "collective-permute":
        pairs = _parse_pairs(attrs)
        pairs = [(s, t) for s, t in pairs if s != t]
        if not pairs and "source_target_pairs" in attrs:
            return None
        n = _largest_component(pairs) if pairs else 2
        axes = (_axes_of_pairs(pairs, mesh), ())
    else:
        groups = _parse_groups(attrs, num_devices)
        n = max((len(g) for g in groups), default=0) if groups is not None else 0
        if groups is None or n <= 1:
            return None
        axes = _axes_of_groups(groups, mesh)
    return kind, axes, n, _buffer_bytes(kind, is_start, instr, shapes, n)


def _buffer_bytes(kind: str, is_start: bool, instr: _Instr, shapes: dict[str, str], n: int) -> int:
    """The full buffer S of one execution (see :class:`Collective`)."""
    if not is_start and kind != "reduce-scatter":
        # Synchronous results are exactly S (all-gather: the gathered result; tuples when ops were combined).
        return _shape_bytes(instr.shape)
    # A -start's result mixes operands, results and context scalars, so S comes from the operands instead.
    operand_shapes = _operand_shapes(instr.operands, shapes)
    if kind == "collective-permute":
        # The in-place form carries index operands after the buffer.
        operand_shapes = operand_shapes[:1]
    scale = n if kind == "all-gather" else 1
    if operand_shapes and all(s is not None for s in operand_shapes):
        return scale * sum(_shape_bytes(s) for s in operand_shapes if s is not None)
    # Unresolvable operands: reduce-scatter's result is S/N; a -start's result leads with its operand(s),
    # except all-reduce-start, whose result is just its operand(s).
    if not is_start:
        return _shape_bytes(instr.shape) * n
    if kind == "all-reduce":
        return _shape_bytes(instr.shape)
    return scale * _shape_bytes(_tuple_elements(instr.shape)[0])


def _operand_shapes(operands: str, shapes: dict[str, str]) -> list[str | None]:
    out: list[str | None] = []
    for part in _split_top_level(operands):
        part = part.strip()
        if not part:
            continue
        # Older printers spell the operand's shape inline: `f32[8]{0} %p`.
        name = re.search(r"%?([\w.\-]+)\s*$", part)
        inline = part[: name.start()].strip() if name else ""
        out.append(inline or (shapes.get(name.group(1)) if name else None))
    return out


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _tuple_elements(shape: str) -> list[str]:
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    return [p.strip() for p in _split_top_level(shape[1:-1]) if p.strip()]


def _shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape, tuple elements summed; layouts and memory-space suffixes are ignored."""
    total = 0
    # Layout braces hold no `[`, so every `dtype[dims]` in the text is one array (dynamic dims print `<=`).
    for dtype, dims in _ARRAY_SHAPE.findall(shape):
        bits = _DTYPE_BITS.get(dtype)
        if bits is None:
            # f8e4m3fn, f8e5m2, f4e2m1fn, ...: the width is the number after the leading `f`.
            width = re.match(r"f(\d+)e", dtype)
            if width is None:
                continue
            bits = int(width.group(1))
        # Bounded dynamic dims print as `<=16` (count the bound); unbounded `?` ones have no static size.
        sizes = [d.strip().lstrip("<=") for d in dims.split(",") if d.strip()]
        elems = math.prod(int(d) if d.isdigit() else 0 for d in sizes)
        total += (elems * bits + 7) // 8
    return total


# ------------------------------------------------------------------- all-reduces that are only sliced

# Ops that pass a value on unchanged in content (layout or shape only; a convert keeps which elements are
# used), followed when looking for its slices.
_PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose", "all-reduce-done", "convert")
_SLICES = ("dynamic-slice", "slice")


class _Dataflow:
    """Who uses each value, per computation, built lazily."""

    def __init__(self, computations: dict[str, list[_Instr]]):
        self.computations = computations
        self._users: dict[str, dict[str, list[tuple[_Instr, int]]]] = {}
        self._by_name: dict[str, dict[str, _Instr]] = {}

    def producer(self, comp: str, name: str | None) -> _Instr | None:
        """The instruction of ``comp`` named ``name``."""
        if comp not in self._by_name:
            self._by_name[comp] = {i.name: i for i in self.computations.get(comp, [])}
        return self._by_name[comp].get(name or "")

    def shapes(self, comp: str) -> dict[str, str]:
        """value name -> shape in ``comp``."""
        self.producer(comp, None)
        return {name: i.shape for name, i in self._by_name[comp].items()}

    def users(self, comp: str) -> dict[str, list[tuple[_Instr, int]]]:
        """value name -> (user, operand position) for each use in ``comp``."""
        if comp not in self._users:
            users: dict[str, list[tuple[_Instr, int]]] = defaultdict(list)
            for instr in self.computations.get(comp, []):
                for position, name in enumerate(_operand_names(instr.operands)):
                    users[name].append((instr, position))
            self._users[comp] = users
        return self._users[comp]


def _operand_names(operands: str) -> list[str | None]:
    names: list[str | None] = []
    for part in _split_top_level(operands):
        name = re.search(r"%?([\w.\-]+)\s*$", part.strip())
        names.append(name.group(1) if name else None)
    return names


def _sliced_bytes(flow: _Dataflow, comp: str, instr: _Instr, n: int) -> int:
    """Bytes of the elements of an all-reduce's result that are only ever sliced to 1/n (see the module doc)."""
    elements = _tuple_elements(instr.shape)
    if not instr.shape.strip().startswith("("):
        return _shape_bytes(elements[0]) if _only_sliced(flow, comp, instr, n) else 0
    uses = _tuple_uses(flow, comp, instr)
    if uses is None:
        return 0
    return sum(
        _shape_bytes(element)
        for index, element in enumerate(elements)
        if uses.get(index) and all(_only_sliced(flow, comp, gte, n) for gte in uses[index])
    )


def _tuple_uses(flow: _Dataflow, comp: str, value: _Instr) -> dict[int, list[_Instr]] | None:
    """The get-tuple-element ops reading a tuple-shaped value, by index; None if it is used whole."""
    if value.root:
        return None
    out: dict[int, list[_Instr]] = defaultdict(list)
    for user, _ in flow.users(comp).get(value.name, []):
        if user.opcode == "all-reduce-done":
            inner = _tuple_uses(flow, comp, user)
            if inner is None:
                return None
            for index, gtes in inner.items():
                out[index].extend(gtes)
            continue
        index = re.search(r"\bindex=(\d+)", user.attrs)
        if user.opcode != "get-tuple-element" or index is None:
            return None
        out[int(index.group(1))].append(user)
    return out


def _only_sliced(flow: _Dataflow, comp: str, value: _Instr, n: int, outer: tuple = ()) -> bool:
    """Whether every use of array ``value`` in ``comp`` ends in a slice keeping 1/n of it along one dimension.
    ``outer``: for a fused computation, (computation, fusion, its own outer) the fusion runs in: a value that is
    the fusion's result (a fusion that only converts) goes on to the fusion's uses there."""
    if value.root and outer:
        outer_comp, fusion, further = outer
        return _only_sliced(flow, outer_comp, fusion, n, further)
    uses = flow.users(comp).get(value.name, [])
    if value.root or not uses:
        return False
    for user, position in uses:
        if user.opcode in _SLICES:
            if position != 0 or not _keeps_one_nth(value.shape, user.shape, n):
                return False
        elif user.opcode in _PASS_THROUGH:
            if not _only_sliced(flow, comp, user, n, outer):
                return False
        elif user.opcode == "fusion":
            callee = re.search(r"\bcalls=%?([\w.\-]+)", user.attrs)
            fused = callee.group(1) if callee else ""
            params = [
                i
                for i in flow.computations.get(fused, [])
                if i.opcode == "parameter" and i.operands.strip() == str(position)
            ]
            if len(params) != 1 or not _only_sliced(flow, fused, params[0], n, (comp, user, outer)):
                return False
        else:
            return False
    return True


def _keeps_one_nth(full: str, part: str, n: int) -> bool:
    """Whether array shape ``part`` is ``full`` with exactly one dimension divided by ``n``."""
    full_dims, part_dims = _dims(full), _dims(part)
    if full_dims is None or part_dims is None or len(full_dims) != len(part_dims):
        return False
    changed = [(f, p) for f, p in zip(full_dims, part_dims, strict=True) if f != p]
    return len(changed) == 1 and changed[0][0] == n * changed[0][1]


def _dims(shape: str) -> list[int] | None:
    arrays = _ARRAY_SHAPE.findall(shape)
    if len(arrays) != 1 or shape.strip().startswith("("):
        return None
    sizes = [d.strip() for d in arrays[0][1].split(",") if d.strip()]
    return [int(d) for d in sizes] if all(d.isdigit() for d in sizes) else None


# ------------------------------------------------------------------- the program's payload type

# Ops that move a value's elements without changing them: a narrow value stays narrow through them.
_KEEPS_VALUES = ("bitcast", "copy", "reshape", "transpose", "slice", "dynamic-slice", "broadcast")


def _element_type(shape: str) -> str:
    found = _ARRAY_SHAPE.search(shape)
    return found.group(1) if found else ""


def _float_bits(dtype: str) -> int | None:
    if not (dtype.startswith("f") or dtype == "bf16") or dtype not in _DTYPE_BITS and not re.match(r"f\d+e", dtype):
        return None
    return _DTYPE_BITS.get(dtype) or int(re.match(r"f(\d+)", dtype).group(1))


def _rounded_through(flow: _Dataflow, comp: str, name: str | None, outer: tuple = ()) -> str | None:
    """The narrower float type value ``name`` of ``comp`` was last converted from (``bf16`` for
    ``convert(bf16 -> f32)``), followed back through value-keeping ops and into and out of fusions; else None."""
    instr = flow.producer(comp, name)
    if instr is None:
        return None
    operands = _operand_names(instr.operands)
    if instr.opcode == "convert":
        source = _element_type(_operand_shapes(instr.operands, flow.shapes(comp))[0] or "")
        narrow, wide = _float_bits(source), _float_bits(_element_type(instr.shape))
        return source if narrow is not None and wide is not None and narrow < wide else None
    if instr.opcode in _KEEPS_VALUES and operands:
        return _rounded_through(flow, comp, operands[0], outer)
    if instr.opcode == "fusion":
        callee = re.search(r"\bcalls=%?([\w.\-]+)", instr.attrs)
        root = next((i for i in flow.computations.get(callee.group(1) if callee else "", []) if i.root), None)
        return None if root is None else _rounded_through(flow, callee.group(1), root.name, (comp, instr, outer))
    if instr.opcode == "parameter" and outer:
        outer_comp, fusion, further = outer
        index = int(instr.operands.strip()) if instr.operands.strip().isdigit() else -1
        names = _operand_names(fusion.operands)
        return _rounded_through(flow, outer_comp, names[index], further) if 0 <= index < len(names) else None
    return None


def payload(flow: _Dataflow, comp: str, instr: _Instr) -> tuple[str, float]:
    """The element type a collective's program moves, and its bytes as a share of the compiled buffer's: an
    operand the program rounds through a narrower float before sending (XLA:CPU's float normalisation widens
    bf16 collectives to f32 and rounds their operands first) counts at the narrow width."""
    shapes = flow.shapes(comp)
    wire = narrow = 0.0
    kinds: dict[str, float] = defaultdict(float)
    names, operand_shapes = _operand_names(instr.operands), _operand_shapes(instr.operands, shapes)
    if len(names) != len(operand_shapes):  # no operands to read: the result's own type
        return _element_type(instr.shape), 1.0
    for name, shape in zip(names, operand_shapes, strict=True):
        if shape is None:
            continue
        size, own = _shape_bytes(shape), _element_type(shape)
        through = _rounded_through(flow, comp, name)
        width = (_float_bits(through) or 0) / (_float_bits(own) or 1) if through else 1.0
        wire, narrow = wire + size, narrow + size * width
        kinds[through or own] += size * width
    if not wire:
        return _element_type(instr.shape), 1.0
    return max(kinds, key=kinds.get), narrow / wire


# ----------------------------------------------------------------------------- device groups


def _parse_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """The replica groups of a collective's attributes, as lists of device-assignment positions."""
    at = attrs.find("replica_groups=")
    if at < 0:
        # No attribute means every device in one group.
        return [list(range(num_devices))]
    text = attrs[at + len("replica_groups=") :]
    if text.startswith("{"):
        body = text[: _matching(text, 0) + 1]
        groups = [[int(x) for x in re.findall(r"\d+", g)] for g in re.findall(r"\{([^{}]*)\}", body[1:-1])]
        return groups or [list(range(num_devices))]
    if text.startswith("["):
        iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        return _iota_groups(iota.group(0)) if iota else None
    if text.startswith("maximal_mesh"):
        return None
    if text.startswith("mesh"):
        return _mesh_axes_groups(text)
    return None


def _iota_array(reshape_dims: Sequence[int], perm: Sequence[int] | None, dims: Sequence[int]) -> np.ndarray:
    array = np.arange(math.prod(reshape_dims)).reshape(reshape_dims)
    if perm is not None:
        array = array.transpose(perm)
    return array.reshape(dims)


def _iota_groups(text: str) -> list[list[int]]:
    """Rows of an iota replica-group list such as ``[4,2]<=[2,4]T(1,0)``."""
    match = re.fullmatch(r"\s*\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    if match is None:
        raise ValueError(f"not an iota replica-group list: {text!r}")
    dims = [int(x) for x in match.group(1).split(",")]
    reshape = [int(x) for x in match.group(2).split(",")]
    perm = [int(x) for x in match.group(3).split(",")] if match.group(3) else None
    return _iota_array(reshape, perm, (dims[0], -1)).tolist()


def _mesh_axes_groups(text: str) -> list[list[int]] | None:
    """Groups of the mesh-axes form ``mesh['a'=2,'b'=4], device_ids=(...) {'b','a':(1)2}``."""
    mesh_match = re.match(r"mesh\[([^\]]*)\]", text)
    if mesh_match is None:
        return None
    names, sizes = [], []
    for item in mesh_match.group(1).split(","):
        name, _, size = item.rpartition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    rest = text[mesh_match.end() :]
    devices = np.arange(math.prod(sizes))
    ids = re.match(r"\s*,\s*device_ids=\(", rest)
    if ids:
        close = _matching(rest, ids.end() - 1)
        devices = _device_ids(rest[ids.end() : close], sizes)
        if devices is None:
            return None
        rest = rest[close + 1 :]
    axes_match = re.match(r"\s*\{([^}]*)\}", rest)
    if axes_match is None:
        return None
    refs: list[tuple[int, int, int]] = []  # (mesh dim, pre_size, size) of each grouped (sub-)axis, as listed
    for ref in (r.strip() for r in axes_match.group(1).split(",")):
        if not ref:
            continue
        sub = re.fullmatch(r"(.+?):\((\d+)\)(\d+)", ref)
        name = (sub.group(1) if sub else ref).strip("'\"")
        if name not in names:
            return None
        dim = names.index(name)
        refs.append((dim, int(sub.group(2)), int(sub.group(3))) if sub else (dim, 1, sizes[dim]))
    # Split each mesh dim into (padding, sub-axis, ...) factors, major to minor, then move the grouped factors
    # last (in listed order) so that each row of the reshaped array is one group.
    factor_sizes: list[int] = []
    factor_of_ref: dict[int, int] = {}
    for dim, size in enumerate(sizes):
        covered = 1
        on_dim = sorted((r for r in range(len(refs)) if refs[r][0] == dim), key=lambda r: refs[r][1])
        for r in on_dim:
            _, pre, sub_size = refs[r]
            if pre != covered:
                factor_sizes.append(pre // covered)
            factor_of_ref[r] = len(factor_sizes)
            factor_sizes.append(sub_size)
            covered = pre * sub_size
        if covered != size:
            # A sub-axis `(pre)size` splits its dim major-to-minor as [pre, size, rest], as XLA does.
            factor_sizes.append(size // covered)
    grouped = [factor_of_ref[r] for r in range(len(refs))]
    order = [f for f in range(len(factor_sizes)) if f not in grouped] + grouped
    group_size = math.prod(factor_sizes[f] for f in grouped)
    return devices.reshape(factor_sizes).transpose(order).reshape(-1, group_size).tolist()


def _device_ids(text: str, sizes: Sequence[int]) -> np.ndarray | None:
    """The mesh's device array from the inside of ``device_ids=(...)``: iota ``[2,2,2]T(0,2,1)`` or a list."""
    iota = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    if iota:
        reshape = [int(x) for x in iota.group(1).split(",")]
        perm = [int(x) for x in iota.group(2).split(",")] if iota.group(2) else None
        if math.prod(reshape) != math.prod(sizes):
            return None
        return _iota_array(reshape, perm, sizes)
    numbers = [int(x) for x in re.findall(r"\d+", re.sub(r"^\s*\[[\d,]+\]", "", text))]
    return np.array(numbers).reshape(sizes) if len(numbers) == math.prod(sizes) else None


def _parse_pairs(attrs: str) -> list[tuple[int, int]]:
    at = attrs.find("source_target_pairs=")
    if at < 0:
        return []
    text = attrs[at + len("source_target_pairs=") :]
    body = text[: _matching(text, 0) + 1] if text.startswith("{") else ""
    return [(int(s), int(t)) for s, t in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", body)]


def _largest_component(pairs: Iterable[tuple[int, int]]) -> int:
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for s, t in pairs:
        parent[find(s)] = find(t)
    sizes: dict[int, int] = defaultdict(int)
    for x in list(parent):
        sizes[find(x)] += 1
    return max(sizes.values(), default=2)


def _coords(mesh: jax.sharding.Mesh | None, ids: Iterable[int]) -> dict[int, tuple[int, ...]] | None:
    # HLO device numbers are positions in the device assignment, i.e. in mesh.devices.flat; see module doc.
    if mesh is None or getattr(mesh, "devices", None) is None:
        return None
    shape = mesh.devices.shape
    ids = list(ids)
    if any(i >= mesh.devices.size for i in ids):
        return None
    return {i: tuple(int(c) for c in np.unravel_index(i, shape)) for i in ids}


def _axes_of_groups(groups: list[list[int]], mesh: jax.sharding.Mesh | None) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The mesh axes along which the groups' devices differ, and their spans (see :attr:`Collective.spans`)."""
    coords = _coords(mesh, {i for g in groups for i in g})
    if coords is None or mesh is None:
        return (), ()
    spans = {
        d: max(len({coords[i][d] for i in g}) for g in groups)
        for d in range(len(mesh.axis_names))
        if any(len({coords[i][d] for i in g}) > 1 for g in groups)
    }
    axes = tuple(name for d, name in enumerate(mesh.axis_names) if d in spans)
    whole = all(n == mesh.devices.shape[d] for d, n in spans.items())
    return axes, () if whole else tuple(spans[d] for d in sorted(spans))


def _axes_of_pairs(pairs: list[tuple[int, int]], mesh: jax.sharding.Mesh | None) -> tuple[str, ...]:
    coords = _coords(mesh, {i for p in pairs for i in p})
    if coords is None or mesh is None:
        return ()
    varying = {d for s, t in pairs for d in range(len(mesh.axis_names)) if coords[s][d] != coords[t][d]}
    return tuple(name for d, name in enumerate(mesh.axis_names) if d in varying)
