"""A loss's randomness: the run's base key folded with the step, and with the microbatch where a step is split.

A loss asks for randomness by naming it: ``loss_fn(params, batch, *, key, step)`` (either keyword alone, or
both). The names are read from its signature, so a loss that takes neither is called exactly as before, and
nothing else needs to say what the loss uses (a flag beside the loss could disagree with it). ``key`` is
``fold_in(base key, step)``: each step draws other numbers. The key is replicated and the bits drawn for an array
are a function of the key and the array's shape, never of its layout, so a sharded step draws what one device
draws; JAX's partitionable threefry (``jax_threefry_partitionable``, on by default) lets each device compute
only its own shard's bits. Where an executor calls the loss on parts of the batch (microbatches, workers), part
``i`` gets ``fold_in(key, i)``.

>>> import jax
>>> draw = StepKey(jax.random.fold_in(jax.random.key(0), 3), jax.numpy.int32(3))
>>> call_loss(lambda p, b, *, key, step: int(step), None, None, draw)
3
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["KEYWORDS", "BaseKey", "StepKey", "call_loss", "named"]

KEYWORDS = ("key", "step")


class StepKey(NamedTuple):
    """What one call of a loss draws from: ``key`` (None when the loss takes no key) and the ``step``.

    >>> import jax
    >>> draw = StepKey(jax.random.key(0), jax.numpy.int32(0))
    >>> bool((jax.random.key_data(draw.fold(1).key) != jax.random.key_data(draw.key)).any())
    True
    """

    key: jax.Array | None
    step: jax.Array

    def fold(self, index: Any) -> StepKey:
        """The draw of part ``index`` of the step (a microbatch, a worker): the key folded with ``index``."""
        return self if self.key is None else StepKey(jax.random.fold_in(self.key, index), self.step)


def named(loss: Callable) -> tuple[frozenset[str], frozenset[str]]:
    """Which of ``key`` and ``step`` the loss takes as keywords, and which of those it requires (no default).
    Only keywords the loss names count: one taking ``**kwargs`` (which may forward them to ``model.apply``)
    or whose signature cannot be read takes neither, and is called exactly as before.

    >>> takes, requires = named(lambda p, b, *, key, step=0: 0.0)
    >>> sorted(takes), sorted(requires)
    (['key', 'step'], ['key'])
    """
    try:
        parameters = inspect.signature(loss).parameters.values()
    except (TypeError, ValueError):
        return frozenset(), frozenset()
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes = [p for p in parameters if p.name in KEYWORDS and p.kind in keyword]
    return frozenset(p.name for p in takes), frozenset(p.name for p in takes if p.default is p.empty)


def call_loss(loss: Callable, params: Any, batch: Any, draw: StepKey | None) -> jax.Array:
    """``loss(params, batch)``, given the keywords of ``draw`` it names (see :func:`named`).

    >>> call_loss(lambda p, b: p + b, 1, 2, None)
    3
    """
    takes, requires = named(loss)
    if draw is None or not takes:
        if requires:
            raise TypeError(f"the loss requires {sorted(requires)} but the step gives it none; {_HOW}")
        return loss(params, batch)
    given = {name: getattr(draw, name) for name in takes if getattr(draw, name) is not None}
    if requires - set(given):
        raise TypeError(f"the loss requires a key but the step has no seed; {_HOW}")
    return loss(params, batch, **given)


_HOW = "build the TrainStep with seed= (an int or a jax.random.key) so the loss receives key=fold_in(seed, step)"


class BaseKey(NamedTuple):
    """The run's base key as host data (the same constant in every process's program) and its implementation.

    >>> import jax
    >>> base = BaseKey.of(0)
    >>> bool((jax.random.key_data(base.at(jax.numpy.int32(0))) ==
    ...       jax.random.key_data(jax.random.fold_in(jax.random.key(0), 0))).all())
    True
    """

    data: np.ndarray
    impl: Any

    @classmethod
    def of(cls, seed: int | jax.Array) -> BaseKey:
        """From an int seed, a typed key (``jax.random.key``) or a raw one (``jax.random.PRNGKey``)."""
        if isinstance(seed, int | np.integer):
            key = jax.random.key(int(seed))
        elif jax.dtypes.issubdtype(getattr(seed, "dtype", None), jax.dtypes.prng_key):
            key = seed
        elif getattr(seed, "dtype", None) == np.uint32:
            key = jax.random.wrap_key_data(seed)
        else:
            raise TypeError(f"TrainStep: seed must be an int or a jax.random.key, got {type(seed).__name__}")
        if key.shape != ():
            raise TypeError(f"TrainStep: seed must be one key, got a key array of shape {key.shape}")
        return cls(np.asarray(jax.random.key_data(key)), jax.random.key_impl(key))

    def at(self, step: jax.Array) -> jax.Array:
        """The key of ``step``: the base key folded with the step."""
        return jax.random.fold_in(jax.random.wrap_key_data(self.data, impl=self.impl), step)
