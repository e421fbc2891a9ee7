"""Numbers for people: byte counts and durations."""

from __future__ import annotations

__all__ = ["format_bytes", "format_seconds"]


def format_bytes(n: float | None) -> str:
    """Bytes for people: ``B``, ``KiB`` or ``MiB`` (empty for None).

    >>> format_bytes(3 << 20), format_bytes(1536), format_bytes(None)
    ('3.00 MiB', '1.5 KiB', '')
    """
    if n is None:
        return ""
    if n < 1024:
        return f"{n} B"
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1 << 20):.2f} MiB"


def format_seconds(seconds: float) -> str:
    """A short duration in milliseconds, or microseconds below 0.1 ms.

    >>> format_seconds(0.0123), format_seconds(2e-6)
    ('12.3 ms', '2 µs')
    """
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} µs"
