"""Which parameters act as matmul weights, and which of their dimensions are contracted and which produced, read
from the layouts alone: the shapes, the model's own dimension names (whatever words it chose) and the specs.

The roles follow flax's conventions, not spmd's vocabulary: a ``Dense`` kernel is ``[in, out]``; a
``DenseGeneral`` kernel holds its input dimensions first and its output dimensions after, e.g. ``(embed, heads,
head_dim)`` reads the residual stream and ``(heads, head_dim, embed)`` writes it back. Which name is the residual
stream is found from the model itself: the name that leads some weights and ends others. Stacked layers (the
``layers`` dimension of a scan, a pipeline's ``stage``/``chunk``) and a leading ``expert`` dimension batch the
matmul rather than take part in it.

>>> import spmd, numpy as np
>>> from flax import linen as nn
>>> box = lambda shape, names: {"kernel": nn.LogicallyPartitioned(np.zeros(shape, np.float32), names)}
>>> params = {"q": box((8, 2, 4), ("width", "h", "d")), "o": box((2, 4, 8), ("h", "d", "width"))}
>>> [(m.parent, m.in_dims, m.out_dims) for m in matmuls(spmd.Plan().resolve(params).leaves)]
[('o', (0, 1), (2,)), ('q', (0,), (1, 2))]
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping

from spmd import axes as A
from spmd._layout import LeafLayout

__all__ = ["Matmul", "matmuls"]

# Leading dimensions that stack layers: ``layers`` (a scan), and a pipeline's ``[stage, chunk, layers]``, whose
# ``stage`` dimension is split over the pipeline axis (one entry per device).
STACKING = A.STACKING


def spec_axes(row: LeafLayout) -> set[str]:
    """Every mesh axis splitting ``row``."""
    return {a for e in row.spec if e for a in ((e,) if isinstance(e, str) else e)}


def dim_axes(row: LeafLayout, dims: Iterable[int]) -> set[str]:
    """The mesh axes splitting ``dims`` of ``row``."""
    out: set[str] = set()
    for d in dims:
        e = row.spec[d] if d < len(row.spec) else None
        if e:
            out.update((e,) if isinstance(e, str) else e)
    return out


def stacked(row: LeafLayout) -> int:
    """How many layers of a stacked parameter one device runs (its stacking dimensions), else 1."""
    depth = 1
    for name, size in zip(row.names or (), row.shape, strict=False):
        if name in STACKING:
            depth *= 1 if name == A.STAGE else size
    return depth


@dataclasses.dataclass(frozen=True)
class Matmul:
    """A weight read as a matmul: which of its dimensions are contracted with the input, which are the output.

    ``layers`` is how many stacked layers use it; ``experts`` the size of a leading expert dimension (a batch of
    independent matmuls), else 0; ``reads_residual`` / ``writes_residual``: its input / output is the residual
    stream; ``logits``: its output is the vocabulary (the model's head).

    >>> import strategies, numpy as np
    >>> from flax import linen as nn
    >>> wi = nn.LogicallyPartitioned(np.zeros((8, 32), np.float32), ("embed", "mlp"))
    >>> m, = matmuls(strategies.tensor_parallel(axis="tensor").resolve({"wi": {"kernel": wi}}, {"tensor": 4}).leaves)
    >>> m.parent, m.in_dims, m.out_dims, m.local(m.out_dims, {"tensor"}, {"tensor": 4})  # 32 outputs over 4
    ('wi', (0,), (1,), 8)
    """

    row: LeafLayout
    layers: int
    in_dims: tuple[int, ...]
    out_dims: tuple[int, ...]
    experts: int = 0
    lookup: bool = False  # an embedding table: a gather, with no input gradient
    reads_residual: bool = False
    logits: bool = False
    writes_residual: bool = False

    def local(self, dims: tuple[int, ...], model_axes: set[str], sizes: Mapping[str, int]) -> int:
        """Elements of ``dims`` one device holds when only the model axes (not the batch axes) split them."""
        full = math.prod(self.row.shape[d] for d in dims)
        return full // math.prod(sizes[a] for a in dim_axes(self.row, dims) & model_axes)

    @property
    def parent(self) -> str:
        return self.row.path.rsplit("/", 2)[0] if self.row.path.endswith("/kernel") else self.row.path

    @property
    def recomputed(self) -> bool:
        """Whether rematerialising the layers runs it again in the backward pass: every matmul of a stacked layer
        except the one that ends the layer, the projection writing the residual stream from one dimension (an
        MLP's ``wo``; what it writes is the next layer's input, kept anyway); nothing outside the stack."""
        names = self.row.names or ()
        in_stack = any(name in STACKING for name in names)
        return in_stack and not (self.writes_residual and len(self.in_dims) == 1)

    @property
    def projects_heads(self) -> bool:
        """Whether it projects one input dimension onto two (``[embed] -> [heads, head_dim]``): attention's."""
        return len(self.in_dims) == 1 and len(self.out_dims) == 2 and not self.experts


# What flax calls the weights of its Dense, DenseGeneral, Einsum and Embed layers.
_WEIGHTS = ("kernel", "embedding")


def _candidates(rows: Iterable[LeafLayout]) -> list[tuple[LeafLayout, list[int], int]]:
    """(row, the dimensions that take part in a matmul, expert count) for each array of two such or more."""
    out = []
    for row in rows:
        names = row.names or (None,) * len(row.shape)
        dims = [d for d in range(len(row.shape)) if names[d] not in STACKING]
        experts = 0
        if dims and names[dims[0]] == A.EXPERT:
            experts, dims = row.shape[dims[0]], dims[1:]
        if len(dims) >= 2 and (row.names is not None or len(dims) == 2):
            out.append((row, dims, experts))
    return out


def _residual_name(candidates: list[tuple[LeafLayout, list[int], int]]) -> str | None:
    """The model's name for the residual stream: the name that leads some weights and ends others (read by
    the first, written by the second), the most used such name; ``embed`` breaks ties."""
    first = Counter(row.names[dims[0]] for row, dims, _ in candidates if row.names)
    last = Counter(row.names[dims[-1]] for row, dims, _ in candidates if row.names)
    both = [n for n in first if n is not None and n in last]
    return max(both, key=lambda n: (first[n] + last[n], n == A.EMBED), default=None)


def matmuls(rows: Iterable[LeafLayout]) -> list[Matmul]:
    """The parameters that act as matmul weights, with their input and output dimensions (see the module doc).

    Two-dimensional weights are ``[in, out]`` (flax ``Dense``, and ``Embed`` tables, which are lookups); wider
    annotated ones read the residual stream when its name comes first and write it when it comes last, and are
    not matmuls otherwise (a convolution's ``[taps, in, out]``). An annotated array counts when flax would call
    it a ``kernel`` or an ``embedding``, or when it touches the residual stream (a mixture's raw expert weights);
    vectors (biases, norm scales) never do.

    >>> import spmd, numpy as np
    >>> from flax import linen as nn
    >>> wi = nn.LogicallyPartitioned(np.zeros((2, 8, 32), np.float32), ("layers", "width", "hidden"))
    >>> m, = matmuls(spmd.Plan().resolve({"wi": {"kernel": wi}}).leaves)
    >>> m.layers, m.in_dims, m.out_dims
    (2, (1,), (2,))
    """
    candidates = _candidates(rows)
    residual = _residual_name(candidates)
    tables = sorted((row for row, _, _ in candidates if row.path.endswith("embedding")), key=lambda r: -r.shape[0])
    vocab = {A.VOCAB} | ({tables[0].names[0]} if tables and tables[0].names else set())
    out = []
    for row, dims, experts in candidates:
        names = row.names or (None,) * len(row.shape)
        touches = residual is not None and residual in (names[dims[0]], names[dims[-1]])
        if row.names is not None and not touches and not row.path.endswith(_WEIGHTS):
            continue  # an annotated array that neither a Dense/Embed holds nor touches the residual stream
        if len(dims) == 2:
            in_dims, out_dims = (dims[0],), (dims[1],)
        elif residual is not None and names[dims[0]] == residual:
            in_dims, out_dims = (dims[0],), tuple(dims[1:])
        elif residual is not None and names[dims[-1]] == residual:
            in_dims, out_dims = tuple(dims[:-1]), (dims[-1],)
        else:
            continue
        reads = residual is not None and names[in_dims[0]] == residual
        writes = residual is not None and names[out_dims[-1]] == residual
        logits = row.names is not None and any(names[d] in vocab for d in out_dims)
        lookup = row.path.endswith("embedding")
        out.append(Matmul(row, stacked(row), in_dims, out_dims, experts, lookup, reads, logits and not lookup, writes))
    return out


def attention_parents(ms: list[Matmul]) -> dict[str, Matmul]:
    """One projection per attention module: its first weight projecting onto ``[heads, head_dim]``."""
    found: dict[str, Matmul] = {}
    for m in ms:
        if m.projects_heads:
            found.setdefault(m.parent, m)
    return found
