"""What the commands' output shares: a console sized for parameter paths, a loss curve in one line, and JSON
that is always JSON."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from rich.console import Console

__all__ = ["console", "dumps", "sparkline"]


def dumps(value: Any) -> str:
    """``value`` as one line of standard JSON: NaN and infinities (a skipped step's loss) become null, which
    every JSON reader accepts; Python's own ``NaN`` is not JSON.

    >>> dumps({"losses": [1.5, float("nan")], "diff": float("inf")})
    '{"losses": [1.5, null], "diff": null}'
    """

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(value), allow_nan=False)


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
