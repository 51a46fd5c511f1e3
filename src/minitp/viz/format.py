"""Bytes for people to read: one convention, decimal units (KB = 1000 bytes), as bandwidths are
quoted, used by every table and figure of minitp."""

from __future__ import annotations

DECIMAL_UNITS = (("GB", 1e9), ("MB", 1e6), ("KB", 1e3))


def format_bytes(n: float) -> str:
    """723200 -> '723.2 KB'; under a kilobyte, whole bytes: '512 B'."""
    for unit, scale in DECIMAL_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def byte_scale(largest: float) -> tuple[str, float]:
    """The unit an axis whose largest value is ``largest`` bytes counts in, and its size in
    bytes."""
    for unit, scale in DECIMAL_UNITS:
        if largest >= scale:
            return unit, scale
    return "bytes", 1.0
