"""The API keys a worker serves (`worker.keys_file`, turbonode/accounts.py): `Authorization:
Bearer <key>`, as OpenAI's clients send their `api_key`.

The file is reloaded when it changes (its inode, size or mtime; looked at no more than once a
second, on a request): a key added, revoked or given another budget counts from the next
request, without a restart. A change that does not validate is logged and the keys loaded
before stay in force: a typo in the file locks nobody out and lets nobody in.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from turbonode.accounts import Account, Keys, Period, hash_key, load_keys
from turbonode.errors import ConfigError, TurbonodeError

log = logging.getLogger(__name__)

CHECK_S = 1.0  # how often the file's stat is looked at (on a request)
MISSING, UNKNOWN, REVOKED = "missing", "unknown", "revoked"
AUTH_FAILURES = (MISSING, UNKNOWN, REVOKED)


class AuthError(TurbonodeError):
    """No usable key: `reason` is one of AUTH_FAILURES; the message is what the client reads."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _redacted(key: str) -> str:
    """How OpenAI names a wrong key back to its sender: enough to recognise it, never all of it."""
    return key[:3] + "*" * 4 + key[-4:] if len(key) > 10 else "*" * 4


class KeyRing:
    def __init__(self, path: str, default_period: Period, clock: Callable[[], float] = time.monotonic):
        self.path, self.default_period, self.clock = path, default_period, clock
        self._stamp = self._stat()
        self.keys: Keys = load_keys(path, default_period)  # a bad file at start stops the worker, naming the field
        self._checked = clock()
        self.reloads = 0  # successful reloads after the first load
        self.failed_reloads = 0

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def current(self) -> Keys:
        now = self.clock()
        if now - self._checked >= CHECK_S:
            self._checked = now
            self._reload_if_changed()
        return self.keys

    def _reload_if_changed(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp  # a bad version is reported once, not every second
        try:
            keys = load_keys(self.path, self.default_period)
        except ConfigError as exc:
            self.failed_reloads += 1
            log.error("keys file not reloaded, the %d keys loaded before stay in force: %s", len(self.keys), exc)
            return
        self.reloads += 1
        log.info("keys file %s reloaded: %d keys (was %d)", self.path, len(keys), len(self.keys))
        self.keys = keys

    def authenticate(self, authorization: str | None) -> Account:
        """The account whose key the header carries; AuthError (missing, unknown, revoked) otherwise."""
        token = bearer(authorization)
        if token is None:
            raise AuthError(
                MISSING,
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            )
        account = self.current().by_hash.get(hash_key(token))
        if account is None:
            raise AuthError(UNKNOWN, f"Incorrect API key provided: {_redacted(token)}.")
        if account.revoked:
            raise AuthError(REVOKED, f"The API key {_redacted(token)} ({account.name}) has been revoked.")
        return account

    def named(self, name: str) -> Account:
        """The account a trusted balancer names (it checked the key itself); AuthError if none is usable."""
        account = self.current().by_name.get(name)
        if account is None:
            raise AuthError(UNKNOWN, f"The balancer named an account this worker has no key for: {name[:64]!r}.")
        if account.revoked:
            raise AuthError(REVOKED, f"The API key of {account.name} has been revoked.")
        return account
