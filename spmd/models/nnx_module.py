"""nnx modules rebuilt from plain parameter trees: how spmd runs an nnx model on the arrays a plan laid out."""

from __future__ import annotations

from typing import Any

from flax import nnx

__all__ = ["nnx_module", "split_params"]


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


def split_params(module: nnx.Module, whose: str, fix: str) -> tuple[Any, Any]:
    """``(graphdef, params)`` of a module that holds only ``nnx.Param`` state. Other state would not follow the
    parameters through a plan, so it is refused, naming ``whose`` it is, where it is, and the ``fix``.

    >>> graphdef, params = split_params(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), "the layer", "")
    >>> sorted(params.keys())
    ['bias', 'kernel']
    >>> split_params(nnx.Dropout(0.1, rngs=nnx.Rngs(0)), "the layer", "build it without rngs")
    Traceback (most recent call last):
    ...
    ValueError: the layer holds state other than nnx.Param at ['rngs/count', 'rngs/key'] (e.g. ...); build it ...
    """
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    others = ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(rest)]
    if others:
        raise ValueError(
            f"{whose} holds state other than nnx.Param at {others[:8]} (e.g. stored nnx.Rngs, dropout streams or "
            f"batch statistics); {fix}"
        )
    return graphdef, params
