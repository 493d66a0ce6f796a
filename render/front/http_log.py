"""A request aiohttp could not parse is one counted WARNING line, not a traceback at ERROR.

aiohttp answers a malformed HTTP message (a bad header, Content-Length or chunk) 400 itself and
logs it with a full traceback at ERROR; only a bad method on a connection's first request goes
to DEBUG. Any client could fill the worker's log that way. The client's fault is counted
(turbonode_worker_http_malformed_requests) and reported at most once per REPORT_EVERY_S with how
many came since the last line; a failure that is the server's (a 5xx) keeps its traceback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp.http_exceptions import HttpProcessingError

AIOHTTP_SERVER_LOGGER = "aiohttp.server"
REPORT_EVERY_S = 60.0


class MalformedRequestLog(logging.Filter):
    """Installed on aiohttp's server logger; `count` is called for every malformed request."""

    def __init__(self, count: Callable[[], None], clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.count, self.clock = count, clock
        self.unreported = 0
        self.reported_at: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError) or not 400 <= exc.code < 500:
            return True
        self.count()
        self.unreported += 1
        now = self.clock()
        if self.reported_at is not None and now - self.reported_at < REPORT_EVERY_S:
            return False
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        reason = (exc.message or type(exc).__name__).splitlines()[0]
        record.msg = "malformed HTTP request from %s answered %d: %s (%d such since the last line)"
        record.args = (peer, exc.code, reason, self.unreported)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        self.unreported, self.reported_at = 0, now
        return True

    def install(self) -> None:
        logging.getLogger(AIOHTTP_SERVER_LOGGER).addFilter(self)

    def uninstall(self) -> None:
        logging.getLogger(AIOHTTP_SERVER_LOGGER).removeFilter(self)
