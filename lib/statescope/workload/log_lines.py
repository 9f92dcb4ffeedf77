"""One line of a request log: the body inside it, its messages checked and images embedded, metadata.

What it does: ``body_of(obj, fmt)`` finds the chat-completions body of a line (a bare body, one
wrapped as ``{"body": ...}`` / ``{"request": ...}``, or an OpenAI Batch API line); ``messages_of``
checks and normalises its messages (roles, text and ``image_url`` parts with their ``detail``,
assistant ``tool_calls`` and ``tool`` results; image files embedded as data URLs through a small
cache of checked images, ``ImageCache``, read only from its allowed folders); ``check_depth`` and
``surrogate_field`` find a too-deep nesting and a lone surrogate; ``first_field`` / ``lookup``
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

from statescope.workload.images import MAX_IMAGE_BYTES, ImageRefused, as_data_url, image_bytes

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_DEPTH = 64  # JSON nesting of one line (a chat body needs < 10; tool schemas a few more)


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
    Data URLs are remembered as checked (20 bytes each); files' data URLs are kept up to
    ``file_bytes`` in all, so the cache stays small whatever the log holds. Files are read only
    inside ``roots`` (``statescope.workload.images``); ``drop_images`` removes every image part
    instead (a text-only model: the replay is then labelled so)."""

    def __init__(self, roots: list[Path] | None = None, size: int = 4096,
                 file_bytes: int = 48 * 1024 * 1024, max_image_bytes: int = MAX_IMAGE_BYTES,
                 drop_images: bool = False) -> None:
        self.roots = [Path(r) for r in (roots or [])]
        self.size, self.seen = size, OrderedDict()
        self.file_bytes, self.file_urls, self.held = file_bytes, OrderedDict(), 0
        self.max_image_bytes, self.drop_images = max_image_bytes, drop_images
        self.dropped = 0

    def data_url(self, url: Any, field_name: str) -> str:
        key = hashlib.sha1(url.encode("utf-8", "surrogatepass")).digest() \
            if isinstance(url, str) else None
        if key is not None and key in self.seen:
            self.seen.move_to_end(key)
            return url
        if key is not None and key in self.file_urls:
            self.file_urls.move_to_end(key)
            return self.file_urls[key]
        try:
            data = image_bytes(url, self.roots, self.max_image_bytes)
        except ImageRefused as exc:
            raise BadField(field_name, str(exc)) from None
        if url.startswith("data:"):
            self.seen[key] = None
            if len(self.seen) > self.size:
                self.seen.popitem(last=False)
            return url
        out = as_data_url(data)
        self.file_urls[key] = out
        self.held += len(out)
        while self.held > self.file_bytes and len(self.file_urls) > 1:
            self.held -= len(self.file_urls.popitem(last=False)[1])
        return out


def _content(content: Any, where: str, images: ImageCache) -> tuple[Any, int]:
    """Normalised content (image parts as {'url': data URL[, 'detail']}) and its images."""
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
            if images.drop_images:
                images.dropped += 1
                continue
            inner = part.get("image_url")
            url = inner.get("url") if isinstance(inner, dict) else inner
            image = {"url": images.data_url(url, pw + ".image_url.url")}
            if isinstance(inner, dict) and inner.get("detail") is not None:
                if inner["detail"] not in ("auto", "low", "high"):
                    raise BadField(pw + ".image_url.detail", "expected 'auto', 'low' or 'high'")
                image["detail"] = inner["detail"]  # sent as recorded (vLLM ignores it, and says so)
            out.append({"type": "image_url", "image_url": image})
            n_images += 1
        else:
            raise BadField(pw + ".type", f"expected 'text' or 'image_url', got {kind!r} (other "
                                     "modalities are not replayed)")
    return out, n_images


def _tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list) or not calls:
        raise BadField(where, "expected a non-empty list of tool calls")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", ""), (str, dict)):
            raise BadField(f"{where}[{j}]", "expected {'id', 'type': 'function', 'function': "
                                            "{'name': str, 'arguments': str}}")


def messages_of(body: dict, images: ImageCache) -> tuple[list[dict], int]:
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
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise BadField(f"messages[{i}].tool_calls", "only an assistant message calls tools")
            _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        elif "content" not in m:
            raise BadField(f"messages[{i}].content", "missing")
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise BadField(f"messages[{i}].tool_call_id", "expected the id of the call it answers")
        content, k = _content(m.get("content"), f"messages[{i}].content", images)
        out.append({**m, "content": content})
        n_images += k
    return out, n_images


def check_depth(obj: Any, limit: int = MAX_DEPTH) -> None:
    """BadField when ``obj`` nests deeper than ``limit`` (iterative: no recursion to exhaust).
    Message ``content`` is not walked: ``messages_of`` rebuilds it from checked strings, so
    nothing nested in it is kept (and a screenshot-heavy line stays cheap to check)."""
    stack = [(obj, 0, "(line)")]
    while stack:
        cur, depth, where = stack.pop()
        if depth > limit:
            raise BadField(where, f"nested deeper than {limit} levels")
        if isinstance(cur, dict):
            stack.extend((v, depth + 1, k if where == "(line)" else where) for k, v in cur.items()
                         if isinstance(v, (dict, list)) and k != "content")
        elif isinstance(cur, list):
            stack.extend((v, depth + 1, where) for v in cur if isinstance(v, (dict, list)))


def surrogate_field(obj: Any, where: str = "") -> str | None:
    """The path of the first string (key or value) of ``obj`` holding a lone surrogate."""
    def bad(s: str) -> bool:
        try:
            s.encode("utf-8")
            return False
        except UnicodeEncodeError:
            return True

    stack = [(obj, where)]
    while stack:
        cur, path = stack.pop()
        if isinstance(cur, str) and bad(cur):
            return path or "(line)"
        if isinstance(cur, dict):
            for k, v in cur.items():
                sub = f"{path}.{k}" if path else str(k)
                if bad(str(k)):
                    return sub
                stack.append((v, sub))
        elif isinstance(cur, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(cur))
    return None


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
