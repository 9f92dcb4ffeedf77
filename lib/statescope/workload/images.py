"""Images inside chat requests: read an ``image_url`` part safely, verify it, open it for vLLM.

What it does: ``image_bytes(url, roots=...)`` returns the encoded image of a
``data:image/...;base64`` URL, or of a file (a plain path or a local ``file://`` URL; relative
paths against the first root: where a request log lives) that lies inside one of ``roots``.
A file is read only when its real path (symlinks resolved) is inside a root, it is a regular file
(never a device, FIFO or socket: checked with ``lstat`` before and ``fstat`` after an ``O_NOFOLLOW``
open), and it is at most ``max_bytes`` long; the bytes must then *decode* as a PNG, JPEG, GIF,
WebP or BMP image with Pillow (a text file that happens to start with ``BM`` is refused) of at
most ``MAX_IMAGE_PIXELS`` pixels (a file is decoded in full; a data URL verified). Anything else is an ``ImageRefused`` (a ``ValueError``) saying
what was expected — never any of the refused file's bytes — which callers turn into an
``InputError`` naming the file, line and field. Without ``roots`` only data URLs are accepted
(a trace must be self-contained). ``as_data_url`` makes a data URL of verified bytes;
``open_image`` a PIL RGB image (what vLLM's offline ``multi_modal_data`` takes); ``image_urls``
lists a message list's image URLs in order.

What it deliberately does not do: fetch ``http(s)`` URLs or ``file://`` URLs of another host (a
replay must not depend on a machine somewhere else), resize, or re-encode.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import stat
from pathlib import Path
from typing import Any, Iterator, Sequence
from urllib.parse import unquote, urlparse

MAX_IMAGE_BYTES = 20 * 1024 * 1024      # one encoded image
MAX_IMAGE_PIXELS = 40_000_000           # decoded width x height (a decompression-bomb guard)
FORMATS = {"PNG": "png", "JPEG": "jpeg", "GIF": "gif", "WEBP": "webp", "BMP": "bmp"}


class ImageRefused(ValueError):
    """An image part that is not a readable, allowed, verified image (the message says why)."""


def verified_format(data: bytes, decode: bool = True) -> str:
    """'png', 'jpeg', 'gif', 'webp' or 'bmp' when Pillow reads ``data`` as such an image:
    its header parsed and its structure verified (PNG: every chunk's CRC), and with ``decode``
    every pixel decoded (a file; an inline data URL is only verified: decoding 20,000 screenshots
    would cost an import minutes, and its bytes are the log's own)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = FORMATS.get(img.format or "")
            if fmt is None:
                raise ImageRefused(f"expected a PNG/JPEG/GIF/WebP/BMP image, got a {img.format} image")
            w, h = img.size
            if w * h > MAX_IMAGE_PIXELS:
                raise ImageRefused(f"image of {w}x{h} pixels: expected at most {MAX_IMAGE_PIXELS:,}")
            img.verify()  # structure and checksums: a truncated or forged image fails here
        if decode:
            with Image.open(io.BytesIO(data)) as img:  # verify() leaves an image unusable
                img.load()
    except ImageRefused:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        # the bytes are not echoed: a refused "image" may be anybody's secret file
        raise ImageRefused("expected PNG/JPEG/GIF/WebP/BMP image bytes that decode as an image; "
                           "these do not") from None
    return fmt


def _inside(path: str, roots: Sequence[str]) -> bool:
    return any(os.path.commonpath([path, r]) == r for r in roots)


def _read_file(path: Path, roots: Sequence[str | Path], max_bytes: int) -> bytes:
    real_roots = [os.path.realpath(r) for r in roots]
    real = os.path.realpath(path)  # symlinks and '..' resolved: the file actually opened
    if not _inside(real, real_roots):
        raise ImageRefused(f"{path}: outside the folders images may be read from ({', '.join(real_roots)}"
                           "; add one with --allow-root DIR)")
    try:
        before = os.lstat(real)
        if not stat.S_ISREG(before.st_mode):
            raise ImageRefused(f"{path}: not a regular file (devices, FIFOs and sockets are refused)")
        if before.st_size > max_bytes:
            raise ImageRefused(f"{path}: {before.st_size:,} bytes, expected at most {max_bytes:,} "
                               "for one image")
        # O_NONBLOCK: a FIFO swapped in after lstat must not hang the open; O_NOFOLLOW: nor a link
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ImageRefused(f"expected a data URL or a readable image file; {path}: "
                           f"{exc.strerror or type(exc).__name__}") from None
    with os.fdopen(fd, "rb") as fh:
        now = os.fstat(fh.fileno())
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise ImageRefused(f"{path}: changed while being opened (expected a regular file)")
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ImageRefused(f"{path}: more than {max_bytes:,} bytes, expected at most that for one image")
    return data


def image_bytes(url: Any, roots: Sequence[str | Path] | None = None,
                max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The verified encoded image behind ``url``; ``ImageRefused`` saying what was expected."""
    if not isinstance(url, str) or not url:
        raise ImageRefused(f"expected a data:image/...;base64 URL or an image file, got {type(url).__name__}")
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
            raise ImageRefused("expected a data:image/<format>;base64,<data> URL")
        if len(payload) > (max_bytes * 4) // 3 + 4:
            raise ImageRefused(f"data URL of about {len(payload) * 3 // 4:,} bytes: expected at most "
                               f"{max_bytes:,} for one image")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageRefused("data URL payload is not valid base64") from None
    elif url.startswith(("http://", "https://")):
        raise ImageRefused(f"expected a data URL or an image file, got a web URL {url[:60]!r} "
                           "(statescope does not fetch images; save them and point at the files)")
    else:
        if not roots:
            raise ImageRefused("expected a data:image/...;base64 URL (image files are embedded "
                               "by 'statescope workload import', not read at replay)")
        if url.startswith("file:"):
            parsed = urlparse(url)
            if parsed.netloc not in ("", "localhost"):
                raise ImageRefused(f"file:// URL of another host {parsed.netloc!r}: expected a "
                                   "local file")
            path = Path(unquote(parsed.path))
        else:
            path = Path(url)
        if not path.is_absolute():
            path = Path(roots[0]) / path
        data = _read_file(path, roots, max_bytes)
        verified_format(data, decode=True)
        return data
    verified_format(data, decode=False)
    return data


def as_data_url(data: bytes) -> str:
    """A data URL of ``data`` (bytes ``image_bytes`` verified)."""
    return f"data:image/{verified_format(data, decode=False)};base64," + base64.b64encode(data).decode("ascii")


def open_image(url: str, roots: Sequence[str | Path] | None = None):
    """A PIL RGB image of ``url`` (decoded fully, so no file handle stays open)."""
    from PIL import Image

    img = Image.open(io.BytesIO(image_bytes(url, roots)))
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
