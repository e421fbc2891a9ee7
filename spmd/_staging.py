"""A model someone else wrote, cut for pipelining from its parts: an embedding, one stacked layer, a head.

A flax language model with stacked layers (linen ``nn.scan`` over a layer module, ``nn.remat`` inside or not;
nnx layers created by ``nnx.vmap`` and run by ``nnx.scan``) keeps each part's parameters under its own key, the stacked
layer's with a leading layer dimension. Given the part modules and those keys, each part runs on its own slice
of the model's parameter tree: the pipeline then needs nothing from the model beyond its parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import linen as nn
from flax import nnx

from spmd._pipeline import StagedModel
from spmd._tree import unbox
from spmd.models.nnx_module import nnx_module, split_params

__all__ = ["staged_from_parts", "staged_loss"]

Path = str | Sequence[str | int]
Runner = Callable[[Any, Any], Any]


def _path(key: Any, what: str) -> tuple[str | int, ...]:
    if isinstance(key, str):
        return tuple(k for k in key.split("/") if k)
    if isinstance(key, Sequence) and all(isinstance(k, str | int) for k in key):
        return tuple(key)
    raise TypeError(
        f"staged_from_parts: {what} must be a path into the parameter tree, a '/'-separated string or a tuple "
        f"of keys, got {key!r}; e.g. {what}='params/wte' or {what}=('params', 'wte')"
    )


def _get(tree: Any, path: tuple[str | int, ...], what: str) -> Any:
    node = tree
    for i, k in enumerate(path):
        try:
            node = node[k]
        except (KeyError, IndexError, TypeError):
            have = sorted(map(str, node)) if isinstance(node, Mapping) else type(node).__name__
            where = "/".join(map(str, path[:i])) or "the root"
            raise KeyError(
                f"staged_from_parts: {what} {'/'.join(map(str, path))!r}: no key {k!r} under {where} of the "
                f"parameters (it holds {have}); give the path of the part's own parameters, as the whole model's "
                f"init names them"
            ) from None
    return node


def _nnx_runner(module: nnx.Module, what: str) -> Runner:
    graphdef, params = split_params(
        module,
        f"staged_from_parts: the nnx {what} {type(module).__name__}",
        "pipelined parts must hold only parameters: build it without rngs streams (deterministic) or give a "
        "function (params, x) -> y instead",
    )
    # Shapes only: a built module's arrays are not kept alive by the cut; nnx_module takes their metadata.
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    flat = list(nnx.to_flat_state(abstract))
    return lambda p, x: nnx_module(graphdef, flat, p)(x)


def _runner(part: Any, what: str) -> Runner:
    """``(params, x) -> y`` for a linen module instance, an nnx module or such a function itself."""
    if isinstance(part, nn.Module):
        return lambda p, x: part.apply({"params": p}, x)
    if isinstance(part, nnx.Module):
        return _nnx_runner(part, what)
    if callable(part):
        return part
    raise TypeError(
        f"staged_from_parts: {what} must be a flax linen module, an nnx module or a function (params, x) -> y, "
        f"got {type(part).__name__}; e.g. {what}=nn.Dense(vocab)"
    )


def _chain(parts: Any, keys: Any, what: str) -> Runner:
    """One part, or several applied in order, each on its own subtree: ``(params, x) -> y``."""
    many = isinstance(parts, list | tuple)
    parts, keys = (parts, keys) if many else ((parts,), (keys,))
    if many and (not isinstance(keys, list | tuple) or len(keys) != len(parts)):
        raise ValueError(
            f"staged_from_parts: {len(parts)} {what} parts need as many {what}_key paths, one per part, got "
            f"{keys!r}; e.g. {what}_key=['params/ln_f', 'params/head']"
        )
    steps = [(_runner(p, what), _path(k, f"{what}_key")) for p, k in zip(parts, keys, strict=True)]

    def run(params: Any, x: Any) -> Any:
        for fn, path in steps:
            x = fn(unbox(_get(params, path, f"{what}_key")), x)
        return x

    return run


def _inputs(inputs: str | Callable[[Any], Any]) -> Callable[[Any], Any]:
    if isinstance(inputs, str):
        return lambda batch: batch[inputs]
    if callable(inputs):
        return inputs
    raise TypeError(
        f"staged_from_parts: inputs must be a key of the batch or a function batch -> model input, got "
        f"{inputs!r}; e.g. inputs='tokens'"
    )


def staged_from_parts(
    *,
    embed: Any,
    layer: Any,
    head: Any,
    loss: Callable[[Any, Any], jax.Array],
    embed_key: Path | Sequence[Path],
    head_key: Path | Sequence[Path],
    layers_key: Path = ("params", "layers"),
    inputs: str | Callable[[Any], Any] = "tokens",
    activation_names: tuple[str | None, ...] | None = None,
) -> StagedModel:
    """A :class:`StagedModel` from a model's parts, each applied to its own subtree of the model's parameters.

    - ``embed``: the part before the stacked layers, applied to ``inputs`` of the microbatch (a key of the
      batch, default ``"tokens"``, or a function ``batch -> input``);
    - ``layer``: one stacked layer, applied to each slice of the arrays under ``layers_key``; a layer written
      for ``nn.scan`` returns ``(x, y)``, and its carry ``x`` goes on;
    - ``head``: the part after the layers, and ``loss(head_output, microbatch) -> scalar`` (the mean over the
      microbatch) on its output.

    A part is a flax linen module instance (run as ``part.apply({"params": subtree}, x)``), an nnx module (built
    or from ``nnx.eval_shape``; rebuilt with ``nnx.merge`` from its subtree: a ``nnx.vmap``-stacked layer
    module itself does, its slices being one layer), or a function ``(subtree, x) -> y`` (for fixed extra
    arguments, or tied weights: ``head=lambda p, x: nn.Embed(V, D).apply({"params": p}, x, method="attend")``
    with ``head_key`` the embedding's). ``embed`` and ``head`` may be lists of parts run in order, with a list of keys.

    Keys are paths into the parameter tree as the whole model's ``init`` makes it (``"params/wte"`` or
    ``("params", "wte")``); spmd gives an nnx model's parameters as ``{"params": {attribute: ...}}``
    (:func:`spmd.models.from_module`). ``activation_names`` are the logical names of the layers' input
    dimensions, e.g. ``("batch", "seq", "embed")``, or None to leave the kept stage inputs to the compiler.

    >>> import jax, jax.numpy as jnp
    >>> from flax import linen as nn
    >>> class Block(nn.Module):  # written for nn.scan: (carry, output)
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return x + nn.Dense(8)(nn.relu(x)), None
    >>> class LM(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, tokens):
    ...         x = nn.Embed(16, 8, name="wte")(tokens)
    ...         stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
    ...         x, _ = stack(name="layers")(x)
    ...         return nn.Dense(16, name="head")(nn.LayerNorm(name="ln_f")(x))
    >>> staged = staged_from_parts(
    ...     embed=nn.Embed(16, 8), embed_key="params/wte",
    ...     layer=Block(), layers_key="params/layers",
    ...     head=[nn.LayerNorm(), nn.Dense(16)], head_key=["params/ln_f", "params/head"],
    ...     loss=lambda logits, batch: (logits**2).mean(),
    ... )
    >>> batch = {"tokens": jnp.arange(8).reshape(2, 4)}
    >>> params = LM().init(jax.random.key(0), batch["tokens"])
    >>> bool(staged_loss(staged)(params, batch) == (LM().apply(params, batch["tokens"]) ** 2).mean())
    True
    """
    run_embed, run_layer, run_head = (
        _chain(embed, embed_key, "embed"),
        _runner(layer, "layer"),
        _chain(head, head_key, "head"),
    )
    read = _inputs(inputs)

    def embed_(params: Any, batch: Any) -> jax.Array:
        return run_embed(params, read(batch))

    def layer_(layer_params: Any, x: jax.Array) -> jax.Array:
        y = run_layer(unbox(layer_params), x)
        return y[0] if isinstance(y, tuple) else y

    def loss_(params: Any, x: jax.Array, batch: Any) -> jax.Array:
        return loss(run_head(params, x), batch)

    path = _path(layers_key, "layers_key")
    return StagedModel(embed=embed_, layer=layer_, loss=loss_, layers_key=path, activation_names=activation_names)


def staged_loss(staged: StagedModel) -> Callable[[Any, Any], jax.Array]:
    """``loss(params, batch)`` of ``staged`` on one device: its embedding, every stacked layer in a
    ``lax.scan``, then its head and loss. Compare it with the model's own loss to check a cut before
    pipelining it.

    >>> import jax.numpy as jnp
    >>> staged = StagedModel(
    ...     embed=lambda p, batch: batch["x"] * p["scale"],
    ...     layer=lambda w, x: x * w,
    ...     loss=lambda p, x, batch: x.sum(),
    ...     layers_key=("layers",),
    ... )
    >>> float(staged_loss(staged)({"scale": 2.0, "layers": jnp.array([3.0, 4.0])}, {"x": jnp.ones(2)}))
    48.0
    """

    def loss(params: Any, batch: Any) -> jax.Array:
        layers = _get(params, staged.layers_key, "layers_key")
        x = staged.embed(params, batch)
        x, _ = jax.lax.scan(lambda x, layer: (staged.layer(layer, x), None), x, layers)
        return staged.loss(params, x, batch)

    return loss
