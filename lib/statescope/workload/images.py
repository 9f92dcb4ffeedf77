"""Images inside chat requests: check an ``image_url`` part, read its bytes, open it for vLLM.

What it does: ``image_bytes(url, base_dir)`` returns the encoded image of a ``data:image/...;base64``
URL, a ``file://`` URL or a plain path (relative paths against ``base_dir``: where a request log
lives), checking that the bytes start like an image file (PNG, JPEG, GIF, WebP, BMP); anything else
is a ``ValueError`` saying what was expected, which callers turn into an ``InputError`` naming the
file, line and field. ``as_data_url`` makes a self-contained data URL of it; ``open_image`` a PIL
RGB image (what vLLM's offline ``multi_modal_data`` takes); ``image_urls`` lists a message list's
image URLs in order.

What it deliberately does not do: fetch ``http(s)`` URLs (a replay must not depend on a server
somewhere else still serving the same bytes), resize, or re-encode.
"""
from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote, urlparse

_MAGIC = {b"\x89PNG\r\n\x1a\n": "png", b"\xff\xd8\xff": "jpeg", b"GIF87a": "gif", b"GIF89a": "gif",
          b"BM": "bmp"}


def image_format(data: bytes) -> str | None:
    """'png', 'jpeg', 'gif', 'webp' or 'bmp' from the leading bytes, else None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    for magic, name in _MAGIC.items():
        if data.startswith(magic):
            return name
    return None


def image_bytes(url: Any, base_dir: str | Path | None = None) -> bytes:
    """The encoded image behind ``url``; ValueError (with what was expected) when there is none."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"expected a data:image/...;base64 URL or a readable image file, got {url!r}")
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
            raise ValueError(f"expected a data:image/<format>;base64,<data> URL, got {url[:40]!r}...")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"data URL payload is not valid base64 ({exc})") from exc
    elif url.startswith(("http://", "https://")):
        raise ValueError(f"expected a data URL or a readable file, got a web URL {url[:60]!r} "
                         "(statescope does not fetch images; save them and point at the files)")
    else:
        path = Path(unquote(urlparse(url).path)) if url.startswith("file:") else Path(url)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"expected a data URL or a readable image file; {path}: "
                             f"{exc.strerror or exc}") from exc
    if image_format(data) is None:
        raise ValueError(f"expected PNG/JPEG/GIF/WebP/BMP image bytes, got {data[:8]!r}")
    return data


def as_data_url(data: bytes) -> str:
    return f"data:image/{image_format(data) or 'png'};base64," + base64.b64encode(data).decode("ascii")


def open_image(url: str, base_dir: str | Path | None = None):
    """A PIL RGB image of ``url`` (decoded fully, so no file handle stays open)."""
    from PIL import Image

    img = Image.open(io.BytesIO(image_bytes(url, base_dir)))
    return img.convert("RGB")


def part_url(part: Any) -> str | None:
    """The URL of an OpenAI ``image_url`` content part (``{'url': ...}`` or a bare string)."""
    if not isinstance(part, dict) or part.get("type") != "image_url":
        return None
    inner = part.get("image_url")
    return inner.get("url") if isinstance(inner, dict) else inner


def image_urls(messages: Any) -> Iterator[str]:
    """Every image URL of a chat message list, in prompt order."""
    for m in messages or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                url = part_url(part)
                if url is not None:
                    yield url
