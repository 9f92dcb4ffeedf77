"""What a shared file says once decoded: escaped views of text, base64 runs, image metadata.

What it does: a secret can hide in a file behind an encoding a reader undoes without noticing —
HTML entities (``&#x2F;``, ``&amp;``), JSON and JavaScript escapes (``\\u002f``, ``\\/``), URL
encoding (``%2F``), a token wrapped over two lines or split by a tag, a reversed string, a base64
run, a compressed PNG text chunk. This module produces those views:

* ``unescaped(text)`` / ``joined(text)``: an ``EditView`` — the decoded text plus a map from any
  span of it back to the span of the original it came from, so the scrubber can replace a secret
  it found in the decoded text *in the original* (``EditView.to_source``). ``unescaped_levels``
  undoes up to ``MAX_LEVELS`` nested encodings (``&amp;#47;``).
* ``base64_runs(text)``: (span, decoded bytes) for each base64 run long enough to carry a token.
* ``png_texts(data)``: the text of a PNG's ``tEXt``, ``zTXt`` and ``iTXt`` chunks, decompressed.
* ``strip_image_metadata(data)``: a PNG without any chunk outside ``PNG_KEEP`` (text, EXIF, time,
  ICC profile names and private chunks go), a JPEG without its APP1..APP15 and comment segments;
  the pixels are left byte for byte as they were.

What it deliberately does not do: decide what is a secret (``statescope.share.scrub``), read
pixels (a secret drawn into an image can only be kept out by drawing it from scrubbed input:
``statescope.share.publish``), or decode formats other than the ones named here.
"""
from __future__ import annotations

import base64
import binascii
import html
import re
import struct
import zlib
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Iterator

MAX_LEVELS = 3  # nested encodings undone: "&amp;#47;" is two
# One escape each: an HTML entity, a run of \uXXXX (surrogate pairs decode together), \xHH, a
# backslash escape, a run of %HH (multi-byte UTF-8 decodes together).
# A Markdown backslash escape (``hf\\_...``: GitHub shows ``hf_...``) is one too.
ESCAPE = re.compile(r"&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});"
                    r"|(?:\\u[0-9a-fA-F]{4})+|\\x[0-9a-fA-F]{2}|\\[/\\\"'nrt]|\\[_*`~#+.!|\-]"
                    r"|(?:%[0-9a-fA-F]{2})+")
_BACKSLASH = {"/": "/", "\\": "\\", '"': '"', "'": "'", "n": "\n", "r": "\r", "t": "\t"}
# What splits a token without changing it for a reader: a line wrap (with the next line's
# indent), a tag, string-literal concatenation, zero-width characters and soft hyphens.
# Terminal (ANSI) escapes too: vLLM, tqdm and rich colour their logs, and a colour change inside
# a token must not hide it.
ANSI = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
SPLIT = re.compile(r"\r?\n[ \t]*|<[^<>\n]{0,200}>|['\"][ \t]*\+?[ \t]*['\"]"
                   "|[\u200b\u200c\u200d\u2060\ufeff\u00ad]|" + ANSI.pattern)
BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{24,}={0,2}")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
JPEG_MAGIC = b"\xff\xd8"
# Chunks that carry pixels or how to show them, and nothing a person wrote.
PNG_KEEP = {b"IHDR", b"PLTE", b"IDAT", b"IEND", b"tRNS", b"gAMA", b"cHRM", b"sRGB", b"pHYs",
            b"bKGD", b"sBIT"}
PNG_TEXT = {b"tEXt", b"zTXt", b"iTXt"}
MAX_INFLATE = 16 * 2**20  # a text chunk that inflates beyond this is a bomb, not metadata


@dataclass
class EditView:
    """``text`` after replacing spans of ``source``; ``to_source`` maps spans back."""

    source: str
    text: str
    # (start in text, end in text, start in source, end in source) per replaced span, in order
    marks: list[tuple[int, int, int, int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def build(cls, source: str, edits: list[tuple[int, int, str]]) -> "EditView":
        pieces, marks, pos, out = [], [], 0, 0
        for start, end, repl in edits:
            pieces.append(source[pos:start])
            out += start - pos
            marks.append((out, out + len(repl), start, end))
            pieces.append(repl)
            out += len(repl)
            pos = end
        pieces.append(source[pos:])
        return cls(source, "".join(pieces), marks, [m[0] for m in marks])

    @property
    def changed(self) -> bool:
        return bool(self.marks)

    def _point(self, p: int, end: bool) -> int:
        q = p - 1 if end else p  # an end is exclusive: locate its last character
        i = bisect_right(self.starts, q) - 1
        if i < 0:
            return p
        _ds, de, ss, se = self.marks[i]
        if q < de:  # inside a replaced span: the whole original span
            return se if end else ss
        return se + (p - de)

    def to_source(self, start: int, end: int) -> tuple[int, int]:
        """The span of ``source`` that ``text[start:end]`` came from (whole escapes included)."""
        return self._point(start, False), self._point(end, True)

    def source_pieces(self, start: int, end: int) -> list[tuple[int, int]]:
        """The spans of ``source`` that ``text[start:end]`` is made of, without the removed parts
        between them: replacing only these keeps the tags and escapes that split a token (a
        redaction must not eat the markup around it). For views made by removals (``joined``)."""
        pieces, cur = [], self._point(start, False)
        for ds, de, ss, se in self.marks:
            if ds == de and start < ds < end:  # a removal inside the span: a cut between pieces
                pieces.append((cur, ss))
                cur = se
        pieces.append((cur, self._point(end, True)))
        return [p for i, p in enumerate(pieces) if i == 0 or p[1] > p[0]]


def _decode_escape(raw: str) -> str:
    if raw[0] == "&":
        return html.unescape(raw)
    if raw.startswith("\\u"):
        units = [int(raw[i + 2:i + 6], 16) for i in range(0, len(raw), 6)]
        return struct.pack(f"<{len(units)}H", *units).decode("utf-16-le", "replace")
    if raw.startswith("\\x"):
        return chr(int(raw[2:], 16))
    if raw[0] == "\\":
        return _BACKSLASH.get(raw[1], raw[1])
    return bytes(int(raw[i + 1:i + 3], 16) for i in range(0, len(raw), 3)).decode("utf-8", "replace")


def unescaped(text: str) -> EditView:
    """One level of HTML entities, JSON/JS escapes and URL encoding undone."""
    edits = []
    for m in ESCAPE.finditer(text):
        repl = _decode_escape(m.group(0))
        if repl != m.group(0):
            edits.append((m.start(), m.end(), repl))
    return EditView.build(text, edits)


def unescaped_levels(text: str) -> list[EditView]:
    """Successive ``unescaped`` views (each of the previous one's text) until nothing changes."""
    views: list[EditView] = []
    current = text
    for _ in range(MAX_LEVELS):
        if not ESCAPE.search(current):
            break
        view = unescaped(current)
        if not view.changed:
            break
        views.append(view)
        current = view.text
    return views


def to_source(views: list[EditView], start: int, end: int) -> tuple[int, int]:
    """A span of the last view's text mapped back through every level to the original."""
    for view in reversed(views):
        start, end = view.to_source(start, end)
    return start, end


def joined(text: str) -> EditView:
    """Line wraps, tags, literal concatenation and invisible characters removed."""
    return EditView.build(text, [(m.start(), m.end(), "") for m in SPLIT.finditer(text)])


def base64_runs(text: str, min_len: int = 24) -> Iterator[tuple[tuple[int, int], bytes]]:
    """((start, end), decoded bytes) for each run of base64 (standard or URL-safe alphabet)."""
    for m in BASE64_RUN.finditer(text):
        run = m.group(0)
        if len(run) < min_len:
            continue
        body = run.rstrip("=")
        alt = "-" in body or "_" in body
        body = body[:len(body) - len(body) % 4] if len(body) % 4 == 1 else body
        try:
            data = (base64.urlsafe_b64decode if alt else base64.b64decode)(
                body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError):
            continue
        yield (m.start(), m.end()), data


def _chunks(data: bytes) -> Iterator[tuple[bytes, bytes, bytes]]:
    """(type, body, whole chunk bytes) of a PNG; stops at a truncated chunk."""
    pos = len(PNG_MAGIC)
    while pos + 12 <= len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, end = data[pos + 4:pos + 8], pos + 12 + n
        if end > len(data):
            return
        yield kind, data[pos + 8:pos + 8 + n], data[pos:end]
        pos = end


def _inflate(blob: bytes) -> bytes:
    d = zlib.decompressobj()
    try:
        out = d.decompress(blob, MAX_INFLATE)
    except zlib.error:
        return b""
    return out


def png_texts(data: bytes) -> list[str]:
    """Keyword and text of every text chunk (compressed ones inflated); [] for a non-PNG."""
    if not data.startswith(PNG_MAGIC):
        return []
    out = []
    for kind, body, _ in _chunks(data):
        if kind not in PNG_TEXT:
            continue
        key, _, rest = body.partition(b"\0")
        if kind == b"zTXt":
            rest = _inflate(rest[1:])
        elif kind == b"iTXt":  # flag, method, language\0, translated keyword\0, text
            flag, rest = rest[:1], rest[2:]
            rest = rest.split(b"\0", 2)[-1]
            if flag == b"\x01":
                rest = _inflate(rest)
        out.append(key.decode("latin-1") + ": " + rest.decode("utf-8", "replace"))
    return out


def _strip_jpeg(data: bytes) -> bytes:
    out, pos = bytearray(data[:2]), 2
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xDA:  # start of scan: the compressed pixels follow, copied as they are
            break
        (n,) = struct.unpack(">H", data[pos + 2:pos + 4])
        if not (0xE1 <= marker <= 0xEF or marker == 0xFE):  # APP1..15 (EXIF, XMP...), COM
            out += data[pos:pos + 2 + n]
        pos += 2 + n
    return bytes(out + data[pos:])


def strip_image_metadata(data: bytes) -> bytes:
    """The image without metadata (see the module docstring); other bytes are returned unchanged."""
    if data.startswith(PNG_MAGIC):
        return PNG_MAGIC + b"".join(whole for kind, _, whole in _chunks(data) if kind in PNG_KEEP)
    if data.startswith(JPEG_MAGIC):
        return _strip_jpeg(data)
    return data


# -- numbers that spell text: a token's bytes drawn as bar heights --------------------------------
def is_typed_array(obj: object) -> bool:
    """plotly's typed array: ``{"dtype": "u1", "bdata": base64, ["shape": ...]}``."""
    return isinstance(obj, dict) and "bdata" in obj and "dtype" in obj and set(obj) <= {"dtype", "bdata", "shape"}


def typed_array_values(obj: dict) -> tuple[bytes, list] | None:
    """(raw bytes, numbers) of a plotly typed array; None when it does not decode."""
    import numpy as np

    try:
        raw = base64.b64decode(obj["bdata"], validate=False)
        values = np.frombuffer(raw, dtype=np.dtype(str(obj["dtype"]).rstrip("c"))).tolist()
    except (binascii.Error, ValueError, TypeError):
        return None
    return raw, values


def numbers_text(values: list) -> str:
    """The text a list of numbers spells when read as character codes (others become a NUL)."""
    out = []
    for v in values:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer() \
            and 9 <= v <= 0x10FFFF
        out.append(chr(int(v)) if ok else "\0")
    return "".join(out)


def number_texts(obj: dict | list) -> list[str]:
    """What a typed array or a list of numbers says as text: its bytes, and its values as codes."""
    if isinstance(obj, dict):
        decoded_array = typed_array_values(obj)
        if decoded_array is None:
            return []
        raw, values = decoded_array
        return [raw.decode("latin-1"), numbers_text(values)]
    if len(obj) >= 8 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in obj):
        return [numbers_text(obj)]
    return []
