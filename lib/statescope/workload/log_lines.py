"""One line of a request log: the body inside it, its messages checked and images embedded, metadata.

What it does: ``body_of(obj, fmt)`` finds the chat-completions body of a line (a bare body, one
wrapped as ``{"body": ...}`` / ``{"request": ...}``, or an OpenAI Batch API line); ``messages_of``
checks and normalises its messages (roles, text and ``image_url`` parts; image files embedded as
data URLs through a small cache of checked images, ``ImageCache``); ``first_field`` / ``lookup``
read metadata (ids, times) at the top level, in the body or in ``metadata``; ``timestamp`` reads
epoch seconds, milliseconds or ISO 8601. Problems raise ``BadField(field, what)``, which the
importer turns into an ``InputError`` with the file and line.

What it deliberately does not do: group requests into episodes or write anything
(``statescope.workload.importer``).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

from statescope.workload.images import as_data_url, image_bytes

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadField(Exception):
    """A field-level problem inside one line; the importer adds file and line."""

    def __init__(self, field: str, what: str) -> None:
        super().__init__(what)
        self.field, self.what = field, what


def timestamp(value: Any, field_name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise BadField(field_name, f"expected a number (epoch seconds) or an ISO 8601 string, got {value!r}")
    if isinstance(value, (int, float)):
        return value / 1000.0 if value > 1e11 else float(value)  # epoch milliseconds
    if isinstance(value, str):
        try:
            t = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise BadField(field_name, f"expected an ISO 8601 time, got {value!r}") from None
        if t.tzinfo is None:
            t = t.replace(tzinfo=_dt.timezone.utc)
        return t.timestamp()
    raise BadField(field_name, f"expected a number or an ISO 8601 string, got {value!r}")


def first_field(obj: dict, meta: dict, names: tuple[str, ...]) -> tuple[str | None, Any]:
    for name in names:
        for where, src in (("", obj), ("metadata.", meta)):
            if name in src and src[name] is not None:
                return where + name, src[name]
    return None, None


class ImageCache:
    """Recently checked image URLs (by sha1): an agent log repeats a screenshot across steps.
    Data URLs are remembered as checked (20 bytes each); a file's data URL is kept for the last
    ``files`` files only, so the cache stays small whatever the log holds."""

    def __init__(self, size: int = 4096, files: int = 32) -> None:
        self.size, self.seen = size, OrderedDict()
        self.files, self.file_urls = files, OrderedDict()

    def data_url(self, url: Any, base_dir: Path, field_name: str) -> str:
        key = hashlib.sha1(url.encode()).digest() if isinstance(url, str) else None
        if key is not None and key in self.seen:
            self.seen.move_to_end(key)
            return url
        if key is not None and key in self.file_urls:
            self.file_urls.move_to_end(key)
            return self.file_urls[key]
        try:
            data = image_bytes(url, base_dir)
        except ValueError as exc:
            raise BadField(field_name, str(exc)) from None
        if url.startswith("data:"):
            self.seen[key] = None
            if len(self.seen) > self.size:
                self.seen.popitem(last=False)
            return url
        self.file_urls[key] = as_data_url(data)
        if len(self.file_urls) > self.files:
            self.file_urls.popitem(last=False)
        return self.file_urls[key]


def _content(content: Any, where: str, images: ImageCache, base_dir: Path) -> tuple[Any, int]:
    """Normalised content (image parts as {'url': data URL}) and its number of images."""
    if content is None or isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        raise BadField(where, f"expected a string or a list of content parts, got {type(content).__name__}")
    out, n_images = [], 0
    for i, part in enumerate(content):
        pw = f"{where}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise BadField(pw + ".text", "expected a string")
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            inner = part.get("image_url")
            url = inner.get("url") if isinstance(inner, dict) else inner
            out.append({"type": "image_url",
                        "image_url": {"url": images.data_url(url, base_dir, pw + ".image_url.url")}})
            n_images += 1
        else:
            raise BadField(pw + ".type", f"expected 'text' or 'image_url', got {kind!r} (other "
                                     "modalities are not replayed)")
    return out, n_images


def messages_of(body: dict, images: ImageCache, base_dir: Path) -> tuple[list[dict], int]:
    msgs = body.get("messages")
    if msgs is None:
        raise BadField("messages", "missing (expected an OpenAI chat-completions request body)")
    if not isinstance(msgs, list) or not msgs:
        raise BadField("messages", "expected a non-empty list of {'role', 'content'} messages")
    out, n_images = [], 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadField(f"messages[{i}].role", f"expected one of {ROLES}, got "
                                              f"{(m.get('role') if isinstance(m, dict) else m)!r}")
        if "content" not in m:
            raise BadField(f"messages[{i}].content", "missing")
        content, k = _content(m["content"], f"messages[{i}].content", images, base_dir)
        out.append({**m, "content": content})
        n_images += k
    return out, n_images


def body_of(obj: dict, fmt: str) -> tuple[dict, str]:
    """(request body, format of this line)."""
    if fmt in ("auto", "openai-batch") and isinstance(obj.get("body"), dict) and (
            "custom_id" in obj or "url" in obj or fmt == "openai-batch"):
        url = obj.get("url", "/v1/chat/completions")
        if not str(url).rstrip("/").endswith("/chat/completions"):
            raise BadField("url", f"expected '/v1/chat/completions', got {url!r}")
        return obj["body"], "openai-batch"
    if fmt == "openai-batch":
        raise BadField("body", "missing (expected an OpenAI Batch API line: custom_id, url, body)")
    for wrapper in ("body", "request"):
        if "messages" not in obj and isinstance(obj.get(wrapper), dict):
            return obj[wrapper], "openai-chat"
    return obj, "openai-chat"


def lookup(obj: dict, body: dict, meta: dict, name: str) -> Any:
    for src in (obj, body, meta):
        cur: Any = src
        for piece in name.split("."):
            cur = cur.get(piece) if isinstance(cur, dict) else None
        if cur is not None:
            return cur
    return None
