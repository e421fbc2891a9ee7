"""nnx modules rebuilt from plain parameter trees: how spmd runs an nnx model on the arrays a plan laid out."""

from __future__ import annotations

from typing import Any

from flax import nnx

__all__ = ["nnx_module"]


def nnx_module(graphdef: Any, abstract_flat: Any, values: Any) -> nnx.Module:
    """The nnx module ``graphdef`` with its parameters set to ``values`` (nested dicts keyed like the module's
    attributes); ``abstract_flat`` (``nnx.to_flat_state`` of its abstract parameters) gives their metadata.

    >>> import jax, jax.numpy as jnp
    >>> abstract = nnx.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> graphdef, params = nnx.split(abstract, nnx.Param)
    >>> values = {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}
    >>> layer = nnx_module(graphdef, list(nnx.to_flat_state(params)), values)
    >>> layer(jnp.ones((1, 2))).tolist()
    [[2.0, 2.0, 2.0]]
    """
    flat = []
    for path, variable in abstract_flat:
        node = values
        for key in path:
            node = node[key]
        # New Variables with the abstract ones' metadata: the shared abstract state is never mutated.
        flat.append((path, variable.replace(node)))
    with nnx.use_eager_sharding(False):
        return nnx.merge(graphdef, nnx.from_flat_state(flat))
