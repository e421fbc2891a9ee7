"""Uneven data parallelism inside one SPMD program: each device runs its own number of microbatches.

JAX has no uneven sharding, so the batch goes to the devices as a padded buffer, ``[devices, longest share,
...]``, and inside a ``shard_map`` over the data axis every device loops ``lax.fori_loop(0, loops[i], ...)`` with
its own bound read by ``axis_index``: a slow device really does less work. Each microbatch's gradient is
weighted by its share of the global batch and the sum is reduced once, so the result is the gradient of the
whole batch's mean loss, whatever the split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

__all__ = ["Shares", "UnevenData"]


@dataclasses.dataclass(frozen=True)
class Shares:
    """The uneven-data part of a plan: ``shares[i]`` examples for position ``i`` of mesh axis ``axis``, run
    as ``shares[i] / microbatch`` loop iterations of ``microbatch`` examples.

    >>> Shares("data", (12, 4), 4).loops
    (3, 1)
    """

    axis: str
    shares: tuple[int, ...]
    microbatch: int = 1

    def __post_init__(self) -> None:
        if self.microbatch < 1 or any(s < 0 or s % self.microbatch for s in self.shares) or not sum(self.shares):
            raise ValueError(
                f"uneven data parallelism: shares {list(self.shares)} must be non-negative multiples of the "
                f"microbatch ({self.microbatch}) with a positive sum"
            )

    @property
    def loops(self) -> tuple[int, ...]:
        return tuple(s // self.microbatch for s in self.shares)

    @property
    def batch(self) -> int:
        return sum(self.shares)

    def describe(self) -> str:
        return f"uneven shares {list(self.shares)} over {self.axis} (microbatches of {self.microbatch})"


class UnevenData:
    """Loss and gradients of a batch split over ``spec.axis`` by ``spec.shares``."""

    def __init__(self, loss_fn: Callable[[Any, Any], jax.Array], spec: Shares, mesh: Mesh) -> None:
        if mesh.shape.get(spec.axis) != len(spec.shares):
            raise ValueError(
                f"uneven data parallelism: {len(spec.shares)} shares but mesh axis {spec.axis!r} has "
                f"{mesh.shape.get(spec.axis, 0)} devices; give one share per position"
            )
        self.loss_fn, self.spec, self.mesh = loss_fn, spec, mesh

    def value_and_grad(self, params: Any, batch: Any) -> tuple[jax.Array, Any]:
        loss, grads, _ = self._run(params, batch)
        return loss, grads

    def executed_loops(self, params: Any, batch: Any) -> np.ndarray:
        """Runs once and returns how many loop iterations each position along the axis really ran."""
        _, _, loops = jax.jit(self._run)(params, batch)
        return np.asarray(loops)

    def _padded(self, batch: Any) -> Any:
        """``[positions, longest share, ...]``: position ``i``'s examples first, then padding (never read)."""
        spec = self.spec
        rows = max(spec.shares)
        starts = np.concatenate([[0], np.cumsum(spec.shares)])
        index = np.zeros((len(spec.shares), rows), np.int32)
        for i, share in enumerate(spec.shares):
            index[i, :share] = np.arange(starts[i], starts[i] + share)

        def one(x: jax.Array) -> jax.Array:
            if x.shape[0] != spec.batch:
                raise ValueError(
                    f"uneven data parallelism: the batch has {x.shape[0]} examples but the shares "
                    f"{list(spec.shares)} add up to {spec.batch}; plan the shares for this batch size"
                )
            return jnp.take(x, index.reshape(-1), axis=0).reshape(*index.shape, *x.shape[1:])

        return jax.tree.map(one, batch)

    def _run(self, params: Any, batch: Any) -> tuple[jax.Array, Any, jax.Array]:
        axis, spec = self.spec.axis, self.spec
        weight = spec.microbatch / spec.batch  # each microbatch's share of the global mean

        def body(params: Any, rows: Any, loops: jax.Array) -> tuple:
            rows = jax.tree.map(lambda x: x[0], rows)

            def step(i: jax.Array, carry: tuple) -> tuple:
                grads, loss, count = carry
                start = i * spec.microbatch
                micro = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, spec.microbatch), rows)
                value, grad = jax.value_and_grad(self.loss_fn)(params, micro)
                grads = jax.tree.map(lambda acc, g: acc + weight * g, grads, grad)
                return grads, loss + weight * value, count + 1

            start = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
            # A bound read from the table by position: each device runs its own number of iterations.
            grads, loss, count = jax.lax.fori_loop(0, loops[jax.lax.axis_index(axis)], step, start)
            loss, grads = jax.lax.psum((loss, grads), axis)
            return loss, grads, count[None]

        run = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(PartitionSpec(), PartitionSpec(axis), PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(axis)),
            axis_names={axis},
            check_vma=False,
        )
        return run(params, self._padded(batch), jnp.asarray(spec.loops, jnp.int32))
