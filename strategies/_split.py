"""Splitting work over the positions of a mesh axis whose devices differ: the exact integer split by weight
under caps, and what a position is (its speed and memory are its slowest and smallest device's; its name lists
its devices). Shared by the data, pipeline and tensor shares of :mod:`strategies.hetero` and
:mod:`strategies.tensor_shares`.

>>> proportional_split(7, [2, 1])
(5, 2)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction

import numpy as np

from spmd.devices import Profile

__all__ = ["position_name", "proportional_split", "rank_memory", "rank_speeds"]


def proportional_split(
    total: int, weights: Sequence[float], *, caps: Sequence[int | None] | None = None
) -> tuple[int, ...]:
    """Non-negative integers summing to ``total``, proportional to ``weights``, each at most its cap.

    Parts whose proportional share exceeds their cap get the cap and the rest is split again among the others
    (water-filling); the integer parts then take the floors of their exact shares, and the units left over go to
    the largest remainders (ties to the lower index), so every part is within one unit of its exact share.

    >>> proportional_split(56, [3, 3, 1, 1, 1, 1, 2, 2])
    (12, 12, 4, 4, 4, 4, 8, 8)
    >>> proportional_split(10, [1, 1, 1])  # 3⅓ each: one part takes the leftover unit
    (4, 3, 3)
    >>> proportional_split(40, [4, 1, 1, 1, 1], caps=[8, None, None, None, None])  # the fast part is capped
    (8, 8, 8, 8, 8)
    """
    n = len(weights)
    caps = [None] * n if caps is None else list(caps)
    if n == 0 or total < 0 or any(w <= 0 for w in weights) or len(caps) != n:
        raise ValueError(f"proportional_split: need positive weights and one cap (or None) each, got {weights}")
    room = sum(math.inf if c is None else c for c in caps)
    if room < total:
        raise ValueError(
            f"cannot place {total} units: the caps {caps} hold only {room} in all; lower the batch or give the "
            f"devices more memory"
        )
    exact = [Fraction(0)] * n
    free, left = set(range(n)), Fraction(total)
    while free:
        weight = sum(Fraction(weights[i]) for i in free)
        over = [i for i in free if caps[i] is not None and left * Fraction(weights[i]) / weight > caps[i]]
        if not over:
            for i in free:
                exact[i] = left * Fraction(weights[i]) / weight
            break
        for i in over:
            exact[i] = Fraction(caps[i])
            left -= caps[i]
            free.discard(i)
    parts = [math.floor(x) for x in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - parts[i]), i))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return tuple(parts)


def rank_speeds(profile: Profile, mesh_axes: Mapping[str, int], axis: str) -> tuple[float, ...]:
    """The speed of each position along ``axis``: the slowest of the devices sharing it (they run in step).

    >>> rank_speeds(Profile.from_speeds([3, 3, 1, 1]), {"data": 2, "tensor": 2}, "data")
    (3.0, 1.0)
    >>> rank_speeds(Profile.from_speeds([3, 1, 3, 1]), {"data": 2, "tensor": 2}, "data")  # each pairs 3 with 1
    (1.0, 1.0)
    """
    speeds = np.array(profile.speeds).reshape(tuple(mesh_axes.values()))
    position = list(mesh_axes).index(axis)
    return tuple(float(x) for x in np.moveaxis(speeds, position, 0).reshape(mesh_axes[axis], -1).min(axis=1))


def rank_memory(profile: Profile, mesh_axes: Mapping[str, int], axis: str) -> tuple[int | None, ...]:
    """The memory of each position along ``axis``: the least of its devices' (None where none is known)."""
    memory = profile.memory
    if all(m is None for m in memory):
        return (None,) * mesh_axes[axis]
    grid = np.array([math.inf if m is None else m for m in memory], dtype=float).reshape(tuple(mesh_axes.values()))
    position = list(mesh_axes).index(axis)
    least = np.moveaxis(grid, position, 0).reshape(mesh_axes[axis], -1).min(axis=1)
    return tuple(None if math.isinf(x) else int(x) for x in least)


def position_name(mesh_axes: Mapping[str, int], axis: str, position: int) -> str:
    """Position ``position`` along ``axis`` and the devices (in mesh order) that share it.

    >>> position_name({"data": 2, "tensor": 2}, "data", 1)
    'data position 1 (devices 2, 3)'
    """
    grid = np.moveaxis(
        np.arange(math.prod(mesh_axes.values())).reshape(tuple(mesh_axes.values())), list(mesh_axes).index(axis), 0
    )
    devices = sorted(int(d) for d in grid[position].reshape(-1))
    return f"{axis} position {position} (device{'s' if len(devices) > 1 else ''} {', '.join(map(str, devices))})"
