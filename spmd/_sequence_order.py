"""What a trace under the active plan did to the sequence's order, so a model that put its sequence in head-tail
order (:func:`spmd.balance_sequence`) is made to restore it before the loss reads neighbouring positions."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

from spmd._rules import PlanError


@dataclasses.dataclass
class SequenceOrder:
    """How often the trace balanced the sequence and how often it restored it."""

    balanced: int = 0
    restored: int = 0


_ORDER: contextvars.ContextVar[SequenceOrder | None] = contextvars.ContextVar("spmd_sequence_order", default=None)


def current_order() -> SequenceOrder | None:
    """The order being tracked (under :func:`tracking_order`), or None outside one."""
    return _ORDER.get()


def note_order(*, restored: bool) -> None:
    """Counts one balancing (or, ``restored``, one restoring) of the sequence in the order being tracked."""
    order = _ORDER.get()
    if order is not None and restored:
        order.restored += 1
    elif order is not None:
        order.balanced += 1


@contextlib.contextmanager
def tracking_order() -> Iterator[None]:
    """Checks, when a trace under the active plan ends, that a model that balanced the sequence restored it.

    >>> with tracking_order():
    ...     current_order().balanced += 1
    Traceback (most recent call last):
    spmd._rules.PlanError: spmd.balance_sequence put the sequence in head-tail order and nothing restored it: ...
    """
    order = SequenceOrder()
    token = _ORDER.set(order)
    try:
        yield
    finally:
        _ORDER.reset(token)
    if order.balanced and not order.restored:
        raise PlanError(
            "spmd.balance_sequence put the sequence in head-tail order and nothing restored it: call "
            "spmd.restore_sequence before the loss reads neighbouring positions (the next-token shift)"
        )
