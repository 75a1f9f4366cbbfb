"""Byte sizes: parse "8GiB" / "512MB" / 4096 and print them back readably; the alignment of
a parameter inside its group's flat buffer."""

from __future__ import annotations

import re

__all__ = ["parse_size", "format_size", "format_apart", "PARAM_ALIGN"]

# Every parameter starts at a multiple of this in its group's flat buffer, so any dtype can
# view it and vector loads stay aligned; a rank's slice of a group is a multiple of it too,
# so no element straddles two ranks (offload.params builds the groups, offload.distributed
# sizes the slices: both read it here, below either).
PARAM_ALIGN = 256

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, name: str = "size", allow_zero: bool = False) -> int:
    """Return ``value`` in bytes.

    Accepts plain non-negative ints and strings such as ``"512MiB"``, ``"8GiB"``,
    ``"1.5GB"`` or ``"4096"``. ``name`` is the field named in the error message.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a size: give bytes as an int or a string like '8GiB'")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size: use an int number of bytes or a string "
                "like '512MiB', '8GiB' or '1.5GB'"
            )
        nbytes = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"{name}={value!r} is not a size: give an int or a string like '8GiB'")
    if nbytes < 0 or (nbytes == 0 and not allow_zero):
        raise ValueError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'} bytes")
    return nbytes


def format_size(nbytes: float) -> str:
    """``format_size(3 << 30) == '3.00 GiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_apart(have: int, need: int) -> tuple[str, str]:
    """Two sizes a refusal compares (a budget and what it must be), in bytes where rounding
    would print them alike: "needs 160.00 KiB but host_budget is 160.00 KiB" says nothing."""
    a, b = format_size(have), format_size(need)
    return (f"{int(have)} bytes", f"{int(need)} bytes") if a == b and int(have) != int(need) else (a, b)
