"""The image sizes a backend renders, as plain data (no torch): the engine process sends them to
the front once loaded, which checks each request's size before queueing it (a 400, not a failed
job) without asking the engine process."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SizeRange:
    """Every (height, width) from `low` to `high` in pixels, as `what` was built for."""

    low: tuple[int, int]
    high: tuple[int, int]
    what: str  # "this node's TensorRT engines"

    def unsupported(self, height: int, width: int) -> str | None:
        """Why height x width is not rendered here, or None."""
        (h0, w0), (h2, w2) = self.low, self.high
        if h0 <= height <= h2 and w0 <= width <= w2:
            return None
        # WIDTHxHEIGHT, as the API's 'size' is written
        built = f"{w0}x{h0} to {w2}x{h2}; worker.size sets it"
        return f"{width}x{height} is outside what {self.what} were built for ({built})"
