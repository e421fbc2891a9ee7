"""One chunk's stacked layers as a pipeline's actions run them: F keeps each layer's residuals, B walks the
layers backwards computing only input gradients and keeps what each layer's W reads, W computes only the weight
gradients from both (see :class:`spmd._residuals.LayerVjp`).

A device's chunks are padded to the longest stage (``longest`` layers); a chunk of ``count`` layers uses the first
``count`` of everything, and the kept values are padded with zeros so that every chunk's fit one slot.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd._residuals import LayerVjp, on_host, zeros

__all__ = ["Chunk"]


class Chunk:
    """The layer stack of a chunk of ``count`` layers, with slots shaped for ``longest``.

    >>> import jax, jax.numpy as jnp
    >>> layer = lambda w, x: jnp.tanh(x @ w)
    >>> w, x = jnp.ones((3, 4, 4)) / 4, jnp.ones((2, 4))  # three stacked layers
    >>> chunk = Chunk(LayerVjp(layer, w[0], x), count=2, longest=3)
    >>> y, kept = jax.jit(chunk.forward)(w, x)
    >>> [k.shape for k in kept], chunk.kept_bytes  # per layer: the input, tanh's output and its derivative
    ([(3, 2, 4), (3, 2, 4), (3, 2, 4)], 288)
    >>> dx, carried = jax.jit(chunk.input_grad)(w, kept, jnp.ones_like(y))
    >>> dw = jax.jit(chunk.weight_grad)(w, kept, carried)
    >>> want = jax.grad(lambda w, x: jnp.tanh(jnp.tanh(x @ w[0]) @ w[1]).sum(), argnums=(0, 1))(w, x)
    >>> bool(jnp.allclose(dx, want[1]) and jnp.allclose(dw[:2], want[0][:2]) and not dw[2].any())
    True
    """

    def __init__(self, split: LayerVjp, count: int, longest: int) -> None:
        self.split, self.count, self.longest = split, count, longest

    @property
    def kept(self) -> tuple[jax.core.ShapedArray, ...]:
        """One slot's kept residuals: ``[longest, ...]`` per residual of a layer, in its memory space (the host,
        for those an offload remat policy offloads)."""
        return tuple(r.update(shape=(self.longest, *r.shape)) for r in self.split.kept)

    @property
    def carried(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """One slot's values B hands to W: ``[longest, ...]`` per value of a layer."""
        return tuple(jax.ShapeDtypeStruct((self.longest, *r.shape), r.dtype) for r in self.split.carried)

    @property
    def kept_bytes(self) -> int:
        """Of one slot's kept residuals, the bytes in device memory."""
        return _bytes(r for r in self.kept if not on_host(r))

    @property
    def offloaded_bytes(self) -> int:
        """Of one slot's kept residuals, the bytes in host memory (what F moves there, and B reads back)."""
        return _bytes(r for r in self.kept if on_host(r))

    @property
    def offloaded_weight_grad_bytes(self) -> int:
        """Of the offloaded bytes, those W reads back itself (the rest reach it through what B hands over)."""
        reads = self.split.weight_grad_reads
        return _bytes(r for r, read in zip(self.kept, reads, strict=True) if on_host(r) and read)

    @property
    def carried_bytes(self) -> int:
        return _bytes(self.carried)

    def forward(self, w: Any, x: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """F: the chunk's output and its layers' residuals."""
        if self.count == 0:
            return x, _zeros(self.kept)

        def step(x: jax.Array, layer: Any) -> tuple[jax.Array, tuple[jax.Array, ...]]:
            return self.split.forward(layer, x)

        y, kept = jax.lax.scan(step, x, self._first(w))
        return y, self._pad(kept)

    def input_grad(self, w: Any, kept: tuple[jax.Array, ...], dy: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """B: the gradient to the chunk's input from its output's ``dy``, and what each layer's W reads."""
        if self.count == 0:
            return dy, _zeros(self.carried)

        def step(dy: jax.Array, layer: tuple[Any, tuple[jax.Array, ...]]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
            return self.split.input_grad(layer[0], layer[1], dy)

        dx, carried = jax.lax.scan(step, dy, (self._first(w), self._first(kept)), reverse=True)
        return dx, self._pad(carried)

    def weight_grad(self, w: Any, kept: tuple[jax.Array, ...], carried: tuple[jax.Array, ...]) -> Any:
        """W: the gradient to the chunk's weights (zeros in the padding)."""
        if self.count == 0:
            return jax.tree.map(jnp.zeros_like, w)

        def step(_: None, layer: tuple[Any, ...]) -> tuple[None, Any]:
            return None, self.split.weight_grad(*layer)

        _, dw = jax.lax.scan(step, None, (self._first(w), self._first(kept), self._first(carried)))
        return self._pad(dw)

    def _first(self, tree: Any) -> Any:
        return jax.tree.map(lambda a: a[: self.count], tree)

    def _pad(self, tree: Any) -> Any:
        extra = self.longest - self.count

        def pad(a: jax.Array) -> jax.Array:  # written into zeros of the padded shape, in a's memory space
            return jax.lax.dynamic_update_slice_in_dim(
                zeros(a.aval.update(shape=(self.longest, *a.shape[1:]))), a, 0, 0
            )

        return jax.tree.map(pad, tree) if extra else tree


def _zeros(shapes: tuple[Any, ...]) -> tuple[jax.Array, ...]:
    return tuple(zeros(s) for s in shapes)


def _bytes(shapes: Any) -> int:
    return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in shapes)
