"""What the commands' output shares: a console sized for parameter paths, and a loss curve in one line."""

from __future__ import annotations

import os
import sys

from rich.console import Console

__all__ = ["console", "sparkline"]


def console(stderr: bool = False) -> Console:
    """A rich console on standard output (or error).

    >>> console().stderr
    False
    """
    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal rich assumes 80 columns, too narrow for parameter paths; COLUMNS still wins.
    width = None if stream.isatty() or "COLUMNS" in os.environ else 120
    return Console(stderr=stderr, width=width)


def sparkline(values: list[float]) -> str:
    """A loss curve as one line of text.

    >>> sparkline([3.0, 2.0, 1.0])
    '█▅▁'
    """
    blocks = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(blocks[round((v - lo) / span * (len(blocks) - 1))] for v in values)
