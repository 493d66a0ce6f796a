"""Rates in tc's notation: '100mbit' is bits, '10mbps' is bytes per second.

tc's convention surprises: '100Mbps' is 100 megabytes per second, 800 Mbit/s. turboctl follows
tc (the same strings mean the same rates in both), and prints the effective rate in bit/s
(`describe_rate`) wherever it applies or shows one, so the surprise is visible.
"""

from __future__ import annotations

import re

from .errors import RateError
from .text import quote

_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
}
# At most 20 digits either side of the point: no rate needs more, and float() of more is inexact or inf.
_RATE = re.compile(r"^\s*([0-9]{1,20}(?:\.[0-9]{1,20})?)\s*([a-z]*)\s*$")


def parse_rate(text: str | int) -> int:
    """Return bits per second. A bare number is bits per second, as in tc."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), "bit"
    else:
        m = _RATE.match(str(text).lower())
        if not m:
            raise RateError(f"bad rate {quote(text)}: expected a number and a unit such as 100mbit or 1gbit")
        value, unit = float(m.group(1)), m.group(2) or "bit"
    if unit not in _UNITS:
        raise RateError(f"bad rate {quote(text)}: unknown unit {unit!r} (use bit, kbit, mbit, gbit, bps, kbps, mbps)")
    bits = int(value * _UNITS[unit])
    if bits <= 0:
        raise RateError(f"bad rate {quote(text)}: must be positive")
    return bits


def format_rate(bits_per_s: int) -> str:
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_s >= scale and bits_per_s % scale == 0:
            return f"{bits_per_s // scale}{unit}"
    return f"{bits_per_s}bit"


def describe_rate(bits_per_s: int) -> str:
    """'800mbit (800,000,000 bit/s)': tc's notation and the rate in plain bits per second."""
    return f"{format_rate(bits_per_s)} ({bits_per_s:,} bit/s)"
