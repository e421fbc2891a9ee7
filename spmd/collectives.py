"""Collectives over uneven shards (HAP's padded collectives), for use inside ``shard_map``: plain JAX, so they
differentiate; shard lengths may differ per device, and may be zero.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jax.sharding import Mesh, PartitionSpec as P
>>> from spmd import collectives
>>> mesh = Mesh(np.array(jax.devices()[:2]), ("i",))
>>> gather = lambda x: collectives.padded_all_gather(x, [2, 1], "i")
>>> run = jax.shard_map(gather, mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=False)
>>> run(jnp.array([1.0, 2.0, 3.0, 0.0])).tolist()  # device 0 holds 2 entries, device 1 one (and padding)
[1.0, 2.0, 3.0]
"""

from spmd._uneven import padded_all_gather, padded_reduce_scatter, uneven_all_to_all

__all__ = ["padded_all_gather", "padded_reduce_scatter", "uneven_all_to_all"]
