"""A layer's backward pass cut from its forward and in two: what the forward keeps, the input gradient (B) and
the weight gradient (W), with no forward run again and no work done twice.

A pipeline's forward action (F) and its backward actions run in different ticks, so the vjp of a layer has to
cross from one to the other as data. ``jax.vjp`` returns its backward function as a pytree whose leaves are the
residuals; :class:`LayerVjp` keeps those that depend on the activation (they differ per microbatch) and drops
those that depend only on the weights (the weights themselves, a transpose or a cast of them), which the
backward derives again from the weights it is given: a slot holds activations only, and under FSDP the gathered
weights are gathered again rather than kept.

The backward is traced once as a jaxpr and its equations split as the zero-bubble schedules split it (Qi et al.):
B is every equation the input gradient needs; W is the rest of what the weight gradients need, reading the
values B made that it uses (each matmul's output cotangent, typically) from B as data. So B and W each cost
about one forward, and B + W one backward. A remat policy (``jax.checkpoint``) around the layer decides what the
forward keeps: under ``full`` only the input, and B recomputes the forward (and hands W what it needs of it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core

__all__ = ["LayerVjp", "on_host", "zeros"]

_INLINED = ("jit", "pjit", "remat2", "checkpoint", "closed_call")  # calls whose equations are split one by one


class LayerVjp:
    """``layer(w, x) -> y`` with its vjp split: :meth:`forward` gives ``y`` and the kept residuals,
    :meth:`input_grad` the input gradient and what :meth:`weight_grad` needs to give the weight gradient.
    Built from abstract (or concrete) ``w`` and ``x``; use its methods under ``jax.jit``.

    >>> import jax, jax.numpy as jnp
    >>> layer = lambda w, x: jnp.tanh(x @ w["a"]) @ w["b"]
    >>> w, x = {"a": jnp.ones((4, 8)) / 8, "b": jnp.ones((8, 4)) / 8}, jnp.ones((2, 4))
    >>> split = LayerVjp(layer, w, x)
    >>> [r.shape for r in split.kept]  # x, tanh(x @ a) and its derivative; not the weights
    [(2, 4), (2, 8), (2, 8)]
    >>> y, kept = jax.jit(split.forward)(w, x)
    >>> dx, carried = jax.jit(split.input_grad)(w, kept, jnp.ones_like(y))
    >>> dw = jax.jit(split.weight_grad)(w, kept, carried)
    >>> want = jax.grad(lambda w, x: layer(w, x).sum(), argnums=(0, 1))(w, x)
    >>> bool(jnp.allclose(dx, want[1]) and jnp.allclose(dw["a"], want[0]["a"]))
    True
    """

    def __init__(self, layer: Callable[[Any, jax.Array], jax.Array], w: Any, x: Any) -> None:
        self.layer = layer
        self.x = jax.ShapeDtypeStruct(x.shape, x.dtype)
        closed = jax.make_jaxpr(lambda w, x: jax.tree.leaves(jax.vjp(layer, w, x)[1]))(w, x)
        weights = len(jax.tree.leaves(w))
        self.positions = tuple(i for i, d in enumerate(_depends(closed.jaxpr, weights)) if d)
        self.kept = tuple(_abstract(closed.out_avals[i]) for i in self.positions)
        self._tree = jax.tree.structure(w)
        backward = jax.make_jaxpr(self._backward)(w, self.kept, self.x)
        self._b, self._w, self.carried = _split(backward, weights, len(self.kept))
        read = {v for eqn in self._w.jaxpr.eqns for v in eqn.invars} | set(self._w.jaxpr.outvars)
        # Per kept residual, whether W reads it itself (or only what B made of it, handed over as carried).
        self.weight_grad_reads = tuple(v in read for v in self._w.jaxpr.invars[weights : weights + len(self.kept)])
        # The share of the weights' bytes W reads: a matmul's weight gradient needs its input and output
        # cotangent, not the weight, so under FSDP W gathers little.
        sizes = [math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(w)]
        used = sum(n for n, v in zip(sizes, self._w.jaxpr.invars[:weights], strict=True) if v in read)
        self.weight_grad_weight_share = used / sum(sizes) if sum(sizes) else 0.0

    def forward(self, w: Any, x: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The layer's output and the residuals its backward needs that depend on ``x``."""
        y, vjp = jax.vjp(self.layer, w, x)
        leaves = jax.tree.leaves(vjp)
        return y, tuple(leaves[i] for i in self.positions)

    def input_grad(self, w: Any, kept: Sequence[jax.Array], dy: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """B: the input gradient for the output cotangent ``dy``, and the values W reads (:attr:`carried`)."""
        dx, *carried = jax.extend.core.jaxpr_as_fun(self._b)(*jax.tree.leaves(w), *kept, dy)
        return dx, tuple(carried)

    def weight_grad(self, w: Any, kept: Sequence[jax.Array], carried: Sequence[jax.Array]) -> Any:
        """W: the weight gradient from the residuals and what B handed over."""
        return jax.tree.unflatten(
            self._tree, jax.extend.core.jaxpr_as_fun(self._w)(*jax.tree.leaves(w), *kept, *carried)
        )

    def both(self, w: Any, kept: Sequence[jax.Array], dy: jax.Array) -> tuple[Any, jax.Array]:
        """BW: ``(dw, dx)``."""
        dx, carried = self.input_grad(w, kept, dy)
        return self.weight_grad(w, kept, carried), dx

    def _backward(self, w: Any, kept: Sequence[jax.Array], dy: jax.Array) -> list[jax.Array]:
        # The vjp traced again at a traced stand-in input (a constant would let JAX fold the residuals into
        # another structure), with the kept residuals swapped in: its forward feeds nothing and is dropped.
        _, vjp = jax.vjp(self.layer, w, jnp.zeros_like(dy) * dy)
        leaves, tree = jax.tree.flatten(vjp)
        for i, r in zip(self.positions, kept, strict=True):
            leaves[i] = r
        dw, dx = jax.tree.unflatten(tree, leaves)(dy)
        return [*jax.tree.leaves(dw), dx]


def _abstract(aval: Any) -> jax.core.ShapedArray:
    # The memory space stays: under an offload remat policy the residuals it offloads live on the host, and
    # what holds them (a pipeline's slots) and what reads them (the backward) must say so.
    return jax.core.ShapedArray(aval.shape, aval.dtype, memory_space=aval.memory_space)


def on_host(aval: Any) -> bool:
    """Whether ``aval`` (an array or an abstract value) lives in host memory."""
    return getattr(aval, "memory_space", None) == jax.memory.Space.Host


def zeros(aval: Any) -> jax.Array:
    """Zeros of ``aval``'s shape and dtype, in its memory space (host memory for offloaded residuals)."""
    z = jnp.zeros(aval.shape, aval.dtype)
    return jax.device_put(z, jax.memory.Space.Host) if on_host(aval) else z


def _depends(jaxpr: Any, weights: int) -> list[bool]:
    """Per output of ``jaxpr(*weights, x)``: whether it depends on ``x`` (its inputs after the first
    ``weights``). An equation depends on ``x`` if any of its inputs do (nested calls count as one unit)."""
    live = set(jaxpr.invars[weights:])
    for eqn in jaxpr.eqns:
        if any(isinstance(v, core.Var) and v in live for v in eqn.invars):
            live.update(eqn.outvars)
    return [isinstance(v, core.Var) and v in live for v in jaxpr.outvars]


def _split(closed: Any, weights: int, kept: int) -> tuple[Any, Any, tuple[jax.ShapeDtypeStruct, ...]]:
    """``closed(*w, *kept, dy) -> [*dw, dx]`` cut into B ``(*w, *kept, dy) -> [dx, *carried]`` and W
    ``(*w, *kept, *carried) -> dw``: B is what ``dx`` needs, W what ``dw`` needs besides; ``carried`` is every
    value W reads that B (or ``dy``) gives."""
    jaxpr = closed.jaxpr
    rename: dict[Any, Any] = {}
    eqns = _inline(jaxpr.eqns, rename)
    *dw, dx = (_renamed(v, rename) for v in jaxpr.outvars)
    in_b = _needed(eqns, [dx])
    in_w = _needed(eqns, dw) - in_b
    given = set(jaxpr.invars[: weights + kept]) | set(jaxpr.constvars)
    made_by_w = {v for i in in_w for v in eqns[i].outvars}
    carried, seen = [], set()
    for v in [v for i in sorted(in_w) for v in eqns[i].invars] + list(dw):
        if isinstance(v, core.Var) and v not in given and v not in made_by_w and v not in seen:
            seen.add(v)
            carried.append(v)
    inputs = jaxpr.invars[: weights + kept]
    b = core.Jaxpr(jaxpr.constvars, jaxpr.invars, [dx, *carried], [eqns[i] for i in sorted(in_b)], jaxpr.effects)
    w = core.Jaxpr(jaxpr.constvars, [*inputs, *carried], list(dw), [eqns[i] for i in sorted(in_w)], jaxpr.effects)
    return (
        core.ClosedJaxpr(b, closed.consts),
        core.ClosedJaxpr(w, closed.consts),
        tuple(_abstract(v.aval) for v in carried),
    )


def _needed(eqns: Sequence[Any], outputs: Sequence[Any]) -> set[int]:
    """Indices of the equations ``outputs`` depend on."""
    wanted = {v for v in outputs if isinstance(v, core.Var)}
    out = set()
    for i in reversed(range(len(eqns))):
        if any(v in wanted for v in eqns[i].outvars):
            out.add(i)
            wanted.update(v for v in eqns[i].invars if isinstance(v, core.Var))
    return out


def _inline(eqns: Sequence[Any], rename: dict[Any, Any]) -> list[Any]:
    """The equations with calls (``jit``, remat) replaced by their bodies, so that an input gradient and a weight
    gradient computed inside one call split too; ``rename`` gathers what each call's results are now called.
    Inside one pipeline action nothing is left to deduplicate, so remat's barrier against common-subexpression
    elimination has nothing to guard."""
    out: list[Any] = []
    for eqn in eqns:
        invars = [_renamed(v, rename) for v in eqn.invars]
        body = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINED else None
        inner = getattr(body, "jaxpr", body)
        if not isinstance(inner, core.Jaxpr) or getattr(body, "consts", ()) or inner.constvars:
            out.append(eqn.replace(invars=invars))
            continue
        rename.update(zip(inner.invars, invars, strict=True))
        out.extend(_inline(inner.eqns, rename))
        rename.update((outer, _renamed(v, rename)) for outer, v in zip(eqn.outvars, inner.outvars, strict=True))
    return out


def _renamed(v: Any, rename: dict[Any, Any]) -> Any:
    return rename.get(v, v) if isinstance(v, core.Var) else v
