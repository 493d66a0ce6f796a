"""A small TOML file read whole and safely: the configuration (turbonode/config/) and the
worker's keys file (turbonode/accounts.py)."""

from __future__ import annotations

import os
import stat
import tomllib
from typing import Any

from .errors import ConfigError

MAX_FILE_BYTES = 1 << 20  # a configuration file is a few KiB; refuse reading a runaway one whole


def _is_devnull(st: os.stat_result) -> bool:
    null = os.stat(os.devnull)
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == null.st_rdev


def read_toml(path: str) -> dict[str, Any]:
    """The file's TOML; one ConfigError naming the file for anything that is not a small UTF-8
    TOML file. O_NONBLOCK: opening a FIFO must not wait for a writer that never comes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(path, "file not found") from None
    except OSError as exc:
        raise ConfigError(path, exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or _is_devnull(st)):  # /dev/null: "no file", as usual
            mode = st.st_mode
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
            raise ConfigError(path, f"not a regular file ({kind})")
        raw = b""
        while len(raw) <= MAX_FILE_BYTES and (chunk := os.read(fd, MAX_FILE_BYTES + 1 - len(raw))):
            raw += chunk
    except OSError as exc:
        raise ConfigError(path, exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(path, f"larger than {MAX_FILE_BYTES >> 20} MiB: not a configuration file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(path, f"not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, f"not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(path, "not valid TOML here: nested too deeply") from None
