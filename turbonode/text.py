"""Untrusted text: integers spelled in ASCII digits, and bad values quoted briefly in errors."""

from __future__ import annotations

import reprlib
from typing import Any

_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 60
_QUOTE.maxlevel = 2


def parse_decimal(text: str) -> int | None:
    """The integer `text` spells in ASCII digits, else None. (str.isdigit() also accepts '²' and
    other digits int() refuses, and int() refuses more than 4300 digits.)"""
    return int(text) if 0 < len(text) <= 18 and text.isascii() and text.isdigit() else None


def quote(value: Any) -> str:
    """repr() cut short: a bad value is quoted in an error message, never echoed whole (a request
    or a file may hold a megabyte of it, nested a thousand deep)."""
    return _QUOTE.repr(value)
