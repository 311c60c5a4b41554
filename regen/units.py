"""Units shared by every stage: bytes shown in binary units (KiB, MiB, GiB), bandwidths in decimal GB/s."""

from __future__ import annotations

BYTES_PER_UNIT = 1024
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
BYTES_PER_GIB = BYTES_PER_UNIT ** 3
BYTES_PER_GB = 1e9  # copy bandwidths are given and shown in decimal GB/s, as links are specified


def format_bytes(n: float) -> str:
    """`123 B`, `4.00 KiB`, `1.50 GiB`: the way regen shows a byte count to people."""
    for unit in BYTE_UNITS:
        if abs(n) < BYTES_PER_UNIT or unit == BYTE_UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= BYTES_PER_UNIT
    return f"{n} B"
