"""Units shared by every stage's messages: bytes shown in binary units (KiB, MiB, GiB)."""

from __future__ import annotations

BYTES_PER_UNIT = 1024
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """`123 B`, `4.00 KiB`, `1.50 GiB`: the way regen shows a byte count to people."""
    for unit in BYTE_UNITS:
        if abs(n) < BYTES_PER_UNIT or unit == BYTE_UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= BYTES_PER_UNIT
    return f"{n} B"
