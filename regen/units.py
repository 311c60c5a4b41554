"""Units shared by every stage: bytes shown in binary units (KiB, MiB, GiB), bandwidths in decimal GB/s,
step times in milliseconds (or a graph's own time unit), and memory caps as people write them."""

from __future__ import annotations

import re

from regen.errors import RegenError

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


MS_PER_S = 1e3


def format_duration(seconds: float, time_unit: str | None = None) -> str:
    """`12.345 ms`; a graph whose times are in its own unit (`time_unit`): `407,590,000.00 graph time units`."""
    if time_unit:
        return f"{seconds:,.2f} {time_unit}" if abs(seconds) >= 1 else f"{seconds:.6g} {time_unit}"
    return f"{seconds * MS_PER_S:.3f} ms"


CAP_UNIT_BYTES = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_CAP_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z%]*)\s*$")


def parse_memory_cap(text: str, baseline_peak_bytes: int, flag: str = "--memory-cap",
                     percent_of: str = "the unplanned peak") -> int:
    """'6GiB', '512MB', '1.5e9' (bytes), '60%' (of `baseline_peak_bytes`, which is `percent_of`) -> bytes.
    `flag` names the option in error messages."""
    m = _CAP_RE.match(str(text))
    if not m:
        raise RegenError(f"{flag} '{text}': expected a number with a unit (6GiB, 512MB, 1.5e9) "
                         f"or a percentage of {percent_of} (60%)")
    value, unit = float(m.group(1)), m.group(2)
    if unit == "%":
        if not 0 < value:
            raise RegenError(f"{flag} '{text}': a percentage must be positive")
        if not baseline_peak_bytes:
            raise RegenError(f"{flag} '{text}': {percent_of} is unknown here; give bytes with a unit")
        return int(baseline_peak_bytes * value / 100.0)
    factor = CAP_UNIT_BYTES.get(unit.lower())
    if factor is None:
        known = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB or %"
        raise RegenError(f"{flag} '{text}': unknown unit '{unit}' (use {known})")
    cap = int(value * factor)
    if cap <= 0:
        raise RegenError(f"{flag} '{text}': the cap must be positive")
    return cap
