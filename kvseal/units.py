"""Sizes as people write them: '1GiB', '512MiB', '64m', '1073741824' in flags, '1 GiB' and '23.3 GiB' in
messages."""

from __future__ import annotations

import re
from fractions import Fraction

from kvseal.errors import quote

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
    "p": 1 << 50,
    "pib": 1 << 50,
    "e": 1 << 60,
    "eib": 1 << 60,
}
MAX_SIZE = 1 << 60  # 1 EiB: past any machine's memory or disk, and far inside an int64


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '64m', '1073741824' -> bytes; ValueError naming the text otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{quote(text)} is not a size such as 1GiB, 512MiB or 1048576")
    size = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]  # exact: no float rounding, no overflow
    if size > MAX_SIZE:
        raise ValueError(f"{quote(text)} is more than {format_size(MAX_SIZE)}")
    return int(size)


def format_size(n: int) -> str:
    """1073741824 -> '1 GiB', 25052033024 -> '23.3 GiB'."""
    for unit, shift in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        scale = 1 << shift
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} bytes"
