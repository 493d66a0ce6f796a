"""An image as the API answers it: 8-bit RGB pixels to a base64 PNG. The engine process
encodes its jobs' images (render/engine/host.py); the HTTP API encodes those of an engine it
drives in its own process (the tests' and benches' in-process engine)."""

from __future__ import annotations

import base64
import io


def base64_png(array) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue())


def encode_png(array) -> str:
    return base64_png(array).decode()
