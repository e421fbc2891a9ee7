"""Collectives over uneven shards, for use inside ``shard_map`` (HAP's padded collectives).

JAX has no uneven sharding, so a device's shard of length ``lengths[i]`` along ``dim`` is carried padded to
``max(lengths)``: every device's local array has the same shape, and the first ``lengths[i]`` entries are its own.
Each function pads, runs the even collective, and keeps the valid entries with a static gather, so all three
are plain JAX and differentiate correctly: the gradient of a padded all-gather is a padded reduce-scatter of the
cotangent, and the other way round. Lengths may be zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["padded_all_gather", "padded_reduce_scatter", "uneven_all_to_all"]


def _check(lengths: Sequence[int], axis_name: str, what: str) -> tuple[int, ...]:
    lengths = tuple(int(n) for n in lengths)
    size = jax.lax.axis_size(axis_name)
    if len(lengths) != size or any(n < 0 for n in lengths):
        raise ValueError(
            f"spmd.{what}: lengths {list(lengths)} must give one non-negative length per device of axis "
            f"{axis_name!r} ({size} devices)"
        )
    return lengths


def _valid_positions(lengths: Sequence[int], width: int) -> np.ndarray:
    """Positions of the valid entries in a ``[devices · width]`` concatenation of padded shards."""
    return np.concatenate([i * width + np.arange(n) for i, n in enumerate(lengths)]).astype(np.int32)


def padded_all_gather(x: jax.Array, lengths: Sequence[int], axis_name: str, *, dim: int = 0) -> jax.Array:
    """Gathers uneven shards: device ``i`` holds ``x`` whose first ``lengths[i]`` entries along ``dim`` are its
    shard (the rest padding, ``x.shape[dim] >= max(lengths)``); every device gets the ``sum(lengths)``-long
    concatenation.

    >>> import spmd, jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(jax.devices()[:2], ("i",))
    >>> x = jnp.array([[1.0, 0.0], [2.0, 3.0]])  # device 0 holds [1] (padded), device 1 holds [2, 3]
    >>> f = jax.shard_map(lambda x: padded_all_gather(x[0], [1, 2], "i"), mesh=mesh, in_specs=P("i"),
    ...                   out_specs=P(), check_vma=False)
    >>> f(x).tolist()
    [1.0, 2.0, 3.0]
    """
    lengths = _check(lengths, axis_name, "padded_all_gather")
    width = max(max(lengths), 1)
    x = jnp.moveaxis(x, dim, 0)[:width]
    gathered = jax.lax.all_gather(x, axis_name, tiled=True)  # [devices · width, ...]
    return jnp.moveaxis(jnp.take(gathered, _valid_positions(lengths, width), axis=0), 0, dim)


def padded_reduce_scatter(x: jax.Array, lengths: Sequence[int], axis_name: str, *, dim: int = 0) -> jax.Array:
    """Sums ``x`` (``sum(lengths)`` long along ``dim`` on every device) over the devices and leaves device ``i``
    the ``lengths[i]`` entries of its shard, padded with zeros to ``max(lengths)``.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(jax.devices()[:2], ("i",))
    >>> f = jax.shard_map(lambda x: padded_reduce_scatter(x[0], [1, 2], "i")[None], mesh=mesh,
    ...                   in_specs=P("i"), out_specs=P("i"), check_vma=False)
    >>> f(jnp.ones((2, 3))).tolist()  # device 0: [2] padded; device 1: [2, 2]
    [[2.0, 0.0], [2.0, 2.0]]
    """
    lengths = _check(lengths, axis_name, "padded_reduce_scatter")
    width = max(max(lengths), 1)
    x = jnp.moveaxis(x, dim, 0)
    if x.shape[0] != sum(lengths):
        raise ValueError(f"spmd.padded_reduce_scatter: dimension {dim} has {x.shape[0]} entries, not {sum(lengths)}")
    # Lay the shards out padded, one block per device, so an even reduce-scatter hands each its block.
    blocks = jnp.zeros((len(lengths) * width, *x.shape[1:]), x.dtype).at[_valid_positions(lengths, width)].set(x)
    return jnp.moveaxis(jax.lax.psum_scatter(blocks, axis_name, scatter_dimension=0, tiled=True), 0, dim)


def uneven_all_to_all(
    x: jax.Array,
    axis_name: str,
    *,
    split_dim: int,
    concat_dim: int,
    split_lengths: Sequence[int],
    concat_lengths: Sequence[int],
) -> jax.Array:
    """Re-shards from uneven ``concat_lengths`` along ``concat_dim`` to uneven ``split_lengths`` along
    ``split_dim``: device ``i`` holds all ``sum(split_lengths)`` entries along ``split_dim`` and its
    ``concat_lengths[i]`` (padded) along ``concat_dim``; afterwards it holds its ``split_lengths[i]`` (padded)
    along ``split_dim`` and all ``sum(concat_lengths)`` along ``concat_dim``.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(jax.devices()[:2], ("i",))
    >>> rows = jnp.arange(6.0).reshape(2, 1, 3)  # device 0: row [0 1 2]; device 1: row [3 4 5]
    >>> f = jax.shard_map(
    ...     lambda x: uneven_all_to_all(x[0], "i", split_dim=1, concat_dim=0, split_lengths=[1, 2],
    ...                                 concat_lengths=[1, 1])[None],
    ...     mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False)
    >>> f(rows).tolist()  # device 0: column 0; device 1: columns 1 and 2
    [[[0.0, 0.0], [3.0, 0.0]], [[1.0, 2.0], [4.0, 5.0]]]
    """
    split_lengths = _check(split_lengths, axis_name, "uneven_all_to_all")
    concat_lengths = _check(concat_lengths, axis_name, "uneven_all_to_all")
    if x.shape[split_dim] != sum(split_lengths):
        raise ValueError(
            f"spmd.uneven_all_to_all: split_dim {split_dim} has {x.shape[split_dim]} entries, not "
            f"sum(split_lengths) = {sum(split_lengths)}"
        )
    n = len(split_lengths)
    width_out, width_in = max(max(split_lengths), 1), max(max(concat_lengths), 1)
    x = jnp.moveaxis(x, (split_dim, concat_dim), (0, 1))[:, :width_in]
    # The pieces for each destination, padded to the longest: [devices · width_out, width_in, ...].
    pieces = jnp.zeros((n * width_out, *x.shape[1:]), x.dtype).at[_valid_positions(split_lengths, width_out)].set(x)
    received = jax.lax.all_to_all(pieces, axis_name, split_axis=0, concat_axis=1, tiled=True)
    # [width_out, devices · width_in, ...]: keep each sender's valid entries along the concatenated dimension.
    out = jnp.take(received, _valid_positions(concat_lengths, width_in), axis=1)
    return jnp.moveaxis(out, (0, 1), (split_dim, concat_dim))
