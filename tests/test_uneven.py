"""Collectives over uneven shards on HAP's conformance cases: values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmd import collectives

MESH = Mesh(np.array(jax.devices()[:4]), ("i",))


def padded(global_array, lengths, dim):
    """Device i's shard of ``global_array`` along ``dim``, padded to max(lengths): stacked [4, ...]."""
    width = max(max(lengths), 1)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    out = []
    for i, n in enumerate(lengths):
        shard = np.take(global_array, np.arange(starts[i], starts[i] + n), axis=dim)
        pad = [(0, 0)] * global_array.ndim
        pad[dim] = (0, width - n)
        out.append(np.pad(shard, pad))
    return np.stack(out)


REPLICATED = P()


def on_each_device(f, out_spec=REPLICATED):
    return jax.shard_map(lambda x: f(x[0]), mesh=MESH, in_specs=P("i"), out_specs=out_spec, check_vma=False)


@pytest.mark.parametrize(
    "lengths",
    [
        [1, 2, 3, 4],
        pytest.param([0, 3, 0, 2], marks=pytest.mark.slow),
        pytest.param([2, 0, 0, 0], marks=pytest.mark.slow),
    ],
)
def test_padded_all_gather(lengths):
    total = sum(lengths)
    x = padded(np.ones((5, total), np.float32), lengths, dim=1)

    def gathered(x):
        out = collectives.padded_all_gather(x, lengths, "i", dim=1)
        return out[None]

    out = on_each_device(gathered, P("i"))(jnp.asarray(x))
    assert out.shape == (4, 5, total)  # every device holds the whole (5, total) array
    assert all(float(out[d].sum()) / 4 == total * 5 / 4 for d in range(4))
    # Values land where they belong: number the columns and gather them back in order.
    numbered = padded(np.tile(np.arange(total, dtype=np.float32), (5, 1)), lengths, dim=1)
    again = on_each_device(gathered, P("i"))(jnp.asarray(numbered))
    np.testing.assert_array_equal(np.asarray(again[2]), np.tile(np.arange(total), (5, 1)))

    # Each device sums what it gathered; their mean is the loss: every valid input entry's gradient is 1.
    def loss(x):
        per_device = on_each_device(
            lambda x: jax.lax.psum(collectives.padded_all_gather(x, lengths, "i", dim=1).sum(), "i")
        )
        return per_device(x) / 4

    grad = jax.grad(loss)(jnp.asarray(x))
    valid = padded(np.ones((5, total), np.float32), lengths, dim=1)
    np.testing.assert_allclose(np.asarray(grad), valid)


@pytest.mark.parametrize("lengths", [[1, 2, 3, 4], pytest.param([0, 3, 0, 2], marks=pytest.mark.slow)])
def test_padded_reduce_scatter(lengths):
    total = sum(lengths)
    x = np.ones((4, 5, total), np.float32)  # ones(5, total) on every device
    scatter = on_each_device(lambda x: collectives.padded_reduce_scatter(x, lengths, "i", dim=1)[None], P("i"))
    out = np.asarray(scatter(jnp.asarray(x)))
    width = max(lengths)
    assert out.shape == (4, 5, width)
    for d, n in enumerate(lengths):
        np.testing.assert_array_equal(out[d, :, :n], 4.0)  # its slice of the sum over 4 devices
        np.testing.assert_array_equal(out[d, :, n:], 0.0)
    # Slices from numbered columns: device d gets exactly its columns.
    numbered = np.broadcast_to(np.arange(total, dtype=np.float32), (4, 5, total))
    out = np.asarray(scatter(jnp.asarray(numbered)))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for d, n in enumerate(lengths):
        np.testing.assert_array_equal(out[d, 0, :n], 4 * np.arange(starts[d], starts[d] + n))
    # Every input entry reaches exactly one output entry: gradient 1 everywhere.
    grad = jax.grad(lambda x: scatter(x).sum())(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(grad), 1.0)


@pytest.mark.parametrize(
    "split,concat", [([4, 3, 2, 1], [1, 2, 3, 4]), pytest.param([0, 5, 0, 5], [3, 0, 7, 0], marks=pytest.mark.slow)]
)
def test_uneven_all_to_all(split, concat):
    rows, cols = sum(concat), sum(split)
    a = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    x = padded(a, concat, dim=0)  # device i: its concat[i] rows, all columns

    def reshard(x):
        out = collectives.uneven_all_to_all(
            x, "i", split_dim=1, concat_dim=0, split_lengths=split, concat_lengths=concat
        )
        return out[None]

    f = on_each_device(reshard, P("i"))
    out = np.asarray(f(jnp.asarray(x)))
    expected = padded(a, split, dim=1)  # device j: all rows, its split[j] columns
    np.testing.assert_array_equal(out, expected)
    # The gradient routes each output entry's weight back to the input entry it came from (zero in padding).
    weights = np.random.default_rng(0).normal(size=out.shape).astype(np.float32)
    grad = jax.grad(lambda x: (f(x) * weights).sum())(jnp.asarray(x))
    back = padded(np.concatenate([weights[j, :, : split[j]] for j in range(4)], axis=1), concat, dim=0)
    np.testing.assert_allclose(np.asarray(grad), back)


def test_lengths_must_match_the_axis():
    with pytest.raises(ValueError, match=r"lengths \[1, 2\] must give one non-negative length per device of axis 'i'"):
        on_each_device(lambda x: collectives.padded_all_gather(x, [1, 2], "i"))(jnp.ones((4, 2)))
