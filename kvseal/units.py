"""Sizes as people write them: '1GiB', '512MiB', '64m', '1073741824' in flags, '1 GiB' and '23.3 GiB' in
messages."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "bytes": 1,  # as format_size writes a size under 1 KiB
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '64m', '1073741824' -> bytes; ValueError naming the text otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size such as 1GiB, 512MiB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    """1073741824 -> '1 GiB', 25052033024 -> '23.3 GiB'."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} bytes"
