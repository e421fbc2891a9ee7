"""Fully sharded data parallelism (ZeRO stage 3): parameters split over the data-parallel axis."""

from __future__ import annotations

from spmd import Plan, Remat
from spmd import axes as A
from spmd.rules import ShardLargest


def fsdp(
    *,
    axis: str = "fsdp",
    min_bytes: int = 4096,
    avoid: tuple[str, ...] = (A.LAYERS,),
    remat: Remat | str | bool = "dots",
    block: int = 1,
    paths: tuple[str, ...] = (),
) -> Plan:
    """Splits each parameter of at least ``min_bytes`` over ``axis`` on its largest dimension that the axis
    divides and that no other part of the plan took; the batch is split over ``axis`` too.

    Works on any model, annotated or not. Dimensions whose logical name is in ``avoid`` are never chosen:
    splitting the stacked ``layers`` dimension would make a scan gather every layer at once.

    ``remat`` is the layers' remat policy (:class:`spmd.Remat`). Without one XLA keeps gathered weights alive
    from the forward to the backward pass and FSDP saves little peak memory. The default, ``dots``, keeps every
    matmul output and nothing else: each layer's weights are gathered again in the backward pass (the ZeRO
    paper's 3Ψ traffic) and no matmul is recomputed; ``full`` recomputes the whole layer for less memory.

    ``block`` (veScale-FSDP) aligns every shard to whole blocks of ``block`` rows, so block-wise optimizers
    (blocked Shampoo, 8-bit Adam's quantisation blocks) find whole blocks on each device; an array with no such
    dimension is padded, and the report shows the padding. ``paths`` limits the split to those arrays.

    >>> import numpy as np
    >>> fsdp(axis="fsdp", min_bytes=0).specs({"w": np.zeros((4, 16))}, {"fsdp": 4})
    {'w': P(None, 'fsdp')}
    >>> layout = fsdp(axis="fsdp", min_bytes=0, block=8).resolve({"w": np.zeros((4, 16))}, {"fsdp": 4})
    >>> layout.leaves[0].spec, layout.leaves[0].padded_shape  # 16 / 4 = 4 rows: padded to 32 for 8-row blocks
    (P(None, 'fsdp'), (4, 32))
    """
    if min_bytes < 0:
        raise ValueError(f"strategies.fsdp: min_bytes must be >= 0, got {min_bytes}")
    part = ShardLargest(axis=axis, min_bytes=min_bytes, avoid=tuple(avoid), block=block, paths=tuple(paths))
    return Plan(parts=(part,), batch_axes=(axis,), remat=remat)
