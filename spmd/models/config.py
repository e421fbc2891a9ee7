"""The configuration shared by the built-in language models."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax.numpy as jnp

from spmd._remat import Remat

__all__ = ["LMConfig"]


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Sizes of a token -> logits language model; every built-in model reads the fields it needs.

    ``remat`` is the remat policy of each layer and of the head (a :class:`spmd.Remat`; ``True`` is ``full``).
    ``dtype`` is the compute dtype of activations; parameters are always float32 and the loss is computed
    in float32.

    >>> c = LMConfig(d_model=128, heads=8)
    >>> c.head_dim
    16
    >>> LMConfig(d_model=64, heads=5)
    Traceback (most recent call last):
    ...
    ValueError: LMConfig: d_model (64) must be divisible by heads (5)
    """

    vocab: int = 256
    seq_len: int = 32
    d_model: int = 64
    heads: int = 4
    mlp: int = 256
    layers: int = 8
    remat: Remat | str | bool = False  # the layers' remat policy (spmd.Remat.of reads it)
    dtype: Any = jnp.float32
    head_size: int | None = None  # the width of a head when it is not d_model // heads (a subnetwork's heads)

    def __post_init__(self) -> None:
        object.__setattr__(self, "remat", Remat.of(self.remat))
        for field in ("vocab", "seq_len", "d_model", "heads", "mlp", "layers"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"LMConfig: {field} must be a positive integer, got {value!r}")
        if self.head_size is None and self.d_model % self.heads:
            raise ValueError(f"LMConfig: d_model ({self.d_model}) must be divisible by heads ({self.heads})")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``head_size`` if set, else ``d_model // heads``."""
        return self.head_size or self.d_model // self.heads
