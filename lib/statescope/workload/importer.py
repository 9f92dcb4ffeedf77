"""Import a user's own request log (OpenAI chat-completions bodies, JSONL) as a statescope trace.

What it does: ``import_request_log(FILE, OUT)`` streams the log line by line — memory holds one
request plus a few hashes per open episode, never the log — and writes a trace
(``statescope.workload.trace``) and ``OUT``'s manifest (``manifest_path``: source and its sha256,
format, grouping, replay mode, counts, model, the concurrency the log's timestamps show).

* Formats: ``openai-chat`` (each line a request body: ``messages``, ``max_tokens`` or
  ``max_completion_tokens``, ``temperature``, ``model``; optionally wrapped as ``{"body": ...}`` or
  ``{"request": ...}`` beside metadata), ``openai-batch`` (OpenAI Batch API input lines:
  ``custom_id``, ``url`` = ``/v1/chat/completions``, ``body``), ``auto`` (either, per line).
* Episodes: by an id field when the log has one (``--group-by field:NAME``; ``auto`` looks for
  ``episode_id``, ``episode``, ``session_id``, ``conversation_id``, ``trace_id``, ``thread_id`` at
  the top level or in ``metadata``), else by shared message prefix (``prefix``: a request joins the
  episode whose latest request's messages are a prefix of its own — an agent loop; ``root``: same
  system + first user turn). Both match text only — images are left out, since agents commonly drop
  older screenshots from the history they resend. Steps keep the log's order.
* Images: ``image_url`` parts must be ``data:image/...;base64`` URLs or readable files (a path or
  ``file://`` URL, relative to the log's folder); files are embedded as data URLs so the trace is
  self-contained. Web URLs are refused (the replay must not depend on them).
* Replay: ``as_logged`` (every step keeps its recorded messages) or ``agent_loop`` (steps keep
  system + their own user turn and later turns are rebuilt from this engine's answers, as presets
  do — needs requests shaped ``[system] (user assistant)* user``). Either way the mode is written
  on every trace line and in the manifest.
* Request metadata kept per step: ``request_id``, ``arrival_s`` (from the first request),
  ``temperature`` (replays are greedy: the manifest counts non-zero ones), ``log_line``.

* Request fields: kept (sent on replay), normalised or refused, per
  ``statescope.workload.request_fields``; the manifest's ``fields`` counts them. Lines logged
  with ``status`` >= 400 are skipped and counted. Images come only from the log's folder and
  ``allow_roots`` (``statescope.workload.images``); ``drop_images`` leaves them out, counted.
  Caps: one image, one line (read no further than the cap) and the trace written.

Bad input raises one ``InputError`` naming the file, line and field: not JSON, no ``messages``, an
image that is neither a data URL nor an allowed image file, a model different from the first
line's (mixed models), a missing id field when grouping by one, a refused field, a lone
surrogate, nesting deeper than ``MAX_DEPTH``, a request id on two lines, one episode id on two
conversations, a cap exceeded. Nothing is written on error.

What it deliberately does not do: contact any server, replay arrival times (a replay keeps the
order and bounds the concurrency by what the log shows), or keep responses that a log may carry.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from statescope.errors import InputError
from statescope.workload.images import MAX_IMAGE_BYTES
from statescope.workload.log_lines import (
    MAX_DEPTH,
    BadField,
    ImageCache,
    body_of,
    check_depth,
    first_field,
    lookup,
    messages_of,
    surrogate_field,
    timestamp,
)
from statescope.workload.trace import REPLAYS, TRACE_VERSION, agent_loop_turns

FORMATS = ("auto", "openai-chat", "openai-batch")
ID_FIELDS = ("episode_id", "episode", "session_id", "conversation_id", "trace_id", "thread_id")
REQUEST_ID_FIELDS = ("request_id", "id", "custom_id")
START_FIELDS = ("timestamp", "start_time", "started_at", "arrival_time", "created")
END_FIELDS = ("end_timestamp", "end_time", "finished_at", "completed_at")
STATUS_FIELDS = ("status", "status_code", "http_status")
# top-level names of a bare body line that are the log's metadata, not request fields
METADATA_NAMES = (*ID_FIELDS, *REQUEST_ID_FIELDS, *START_FIELDS, *END_FIELDS, *STATUS_FIELDS,
                  "response", "latency", "latency_s", "duration", "duration_s", "episode_step")
DEFAULT_MAX_TOKENS = 64
MAX_LINE_BYTES = 256 * 1024 * 1024     # one request line (1-3 screenshots are a few MB)
MAX_TRACE_BYTES = 8 * 1024 ** 3        # the whole trace written


def manifest_path(trace_path: str | Path) -> Path:
    """Where a trace's import manifest lives: ``trace.jsonl`` -> ``trace.manifest.json``."""
    p = Path(trace_path)
    return p.with_name(p.name.rsplit(".", 1)[0] + ".manifest.json")


def read_manifest(trace_path: str | Path) -> dict | None:
    """The import manifest beside a trace, or None (a preset trace has none)."""
    p = manifest_path(trace_path)
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{p}: not valid JSON ({exc.msg})") from exc


def _digest(prev: bytes, message: dict) -> bytes:
    """Chain digest of a message by role and *text*: images are left out, because agents commonly
    drop older screenshots from the history they resend (the text history stays the same)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\x01".join(p["text"] for p in content if p.get("type") == "text")
    text = f"{message.get('role')}\x00{content if content is not None else ''}"
    return hashlib.sha1(prev + text.encode("utf-8", "surrogatepass")).digest()


def _root(messages: list[dict]) -> bytes:
    """Digest of a conversation's root: its system prompt and first user turn (text only)."""
    head = [m for m in messages[:2] if m["role"] == "system"]
    first_user = next((m for m in messages if m["role"] == "user"), messages[0])
    return _digest(_digest(b"", head[0]) if head else b"", first_user)


@dataclass
class _Grouper:
    """Assigns each request to an episode; holds a few bytes per open episode, no messages."""

    mode: str                 # 'prefix' | 'root' | 'field'
    field_name: str | None = None
    by_key: dict = field(default_factory=dict)      # field/root key -> [episode, next step]
    open_tips: dict = field(default_factory=dict)   # prefix: digest of latest messages -> episode
    steps: dict = field(default_factory=dict)       # episode -> next step
    count: int = 0

    def _new(self, label: str | None = None) -> str:
        ep = label if label is not None else f"ep{self.count:05d}"
        if ep in self.steps:  # an id that collides with a generated name
            ep = f"{ep}~{self.count}"
        self.count += 1
        self.steps[ep] = 0
        return ep

    def assign(self, messages: list[dict], key: Any, lineno: int = 0) -> tuple[str, int]:
        if self.mode == "field":
            label = str(key)
            root = _root(messages)
            if label not in self.by_key:
                self.by_key[label] = (self._new(label), root, lineno)
            ep, first_root, first_line = self.by_key[label]
            if root != first_root:  # one id, two conversations: a log the replay would garble
                raise BadField(self.field_name, f"{label!r} names the conversation of line "
                               f"{first_line}, but this request has another system prompt or "
                               "first user turn (expected one conversation per id)")
        elif self.mode == "root":
            root = _root(messages)
            if root not in self.by_key:
                self.by_key[root] = self._new()
            ep = self.by_key[root]
        else:
            digests, d = [], b""
            for m in messages:
                d = _digest(d, m)
                digests.append(d)
            ep = None
            for d in reversed(digests[:-1]):  # the longest strict prefix that is an episode's tip
                if d in self.open_tips:
                    ep = self.open_tips.pop(d)
                    break
            if ep is None:
                ep = self._new()
            self.open_tips[digests[-1]] = ep
        step = self.steps[ep]
        self.steps[ep] = step + 1
        return ep, step


def _read_lines(fh, max_line_bytes: int):
    """(line number, raw bytes) of ``fh``; InputError-worthy ``ValueError`` for a too-long line,
    read no further than the cap (so one huge line never lands in memory)."""
    lineno = 0
    while True:
        raw = fh.readline(max_line_bytes + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            raise ValueError(f"{lineno}: line longer than {max_line_bytes:,} bytes (the cap of one "
                             "request; raise it with --max-line-bytes)")
        yield lineno, raw


def _status(obj: dict, meta: dict) -> int | None:
    """The HTTP status a log recorded for the request (``status``, ``status_code``)."""
    for name in STATUS_FIELDS:
        for src in (obj, meta, obj.get("response") if isinstance(obj.get("response"), dict) else {}):
            value = src.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def import_request_log(source: str | Path, out: str | Path, *, fmt: str = "auto",
                       group_by: str = "auto", replay: str = "as_logged",
                       default_max_tokens: int = DEFAULT_MAX_TOKENS,
                       allow_roots: Sequence[str | Path] = (), drop_images: bool = False,
                       max_image_bytes: int = MAX_IMAGE_BYTES,
                       max_line_bytes: int = MAX_LINE_BYTES,
                       max_trace_bytes: int = MAX_TRACE_BYTES) -> dict:
    """Stream ``source`` into the trace ``out`` and its manifest; returns the manifest."""
    source, out = Path(source), Path(out)
    if fmt not in FORMATS:
        raise InputError(f"workload import --format {fmt!r}: expected one of {FORMATS}")
    if replay not in REPLAYS:
        raise InputError(f"workload import --replay {replay!r}: expected one of {REPLAYS}")
    if group_by not in ("auto", "prefix", "root") and not group_by.startswith("field:"):
        raise InputError(f"workload import --group-by {group_by!r}: expected auto, prefix, root "
                         "or field:NAME")
    if not source.is_file():
        raise InputError(f"{source}: request log does not exist (expected a regular file)")
    for root in allow_roots:
        if not Path(root).is_dir():
            raise InputError(f"workload import --allow-root {root}: expected a directory")
    roots = [source.resolve().parent, *(Path(r).resolve() for r in allow_roots)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    sha = hashlib.sha256()
    grouper_box: list = [None]  # the grouper, chosen from the first request
    images = ImageCache(roots, max_image_bytes=max_image_bytes, drop_images=drop_images)
    stats = {"requests": 0, "images": 0, "temperature_nonzero": 0, "max_tokens_defaulted": 0,
             "formats": set(), "agent_loop_shaped": 0, "failed_skipped": 0}
    kept_counts: Counter = Counter()
    normalised_counts: Counter = Counter()
    request_lines: dict[bytes, int] = {}  # sha1 of a request id -> its line (ids are unique)
    model, model_line, t_first = None, None, None
    intervals: list[tuple[float, float]] = []
    lineno, written = 0, 0
    try:
        with source.open("rb") as fh, tmp.open("wb") as dst:
            try:
                for lineno, raw in _read_lines(fh, max_line_bytes):
                    sha.update(raw)
                    if not raw.strip():
                        continue
                    line = _import_line(raw, lineno, source, fmt, replay, default_max_tokens,
                                        images, stats, kept_counts, normalised_counts,
                                        request_lines, grouper_box, group_by)
                    if line is None:
                        continue
                    encoded, parsed = line
                    if parsed["model"] is not None:
                        if model is None:
                            model, model_line = parsed["model"], lineno
                        elif parsed["model"] != model:
                            raise InputError(
                                f"{source}:{lineno}: field 'model': expected {model!r} (as on line "
                                f"{model_line}), got {parsed['model']!r}: mixed models (split the "
                                "log by model)")
                    start, end = parsed["start"], parsed["end"]
                    if t_first is None and start is not None:
                        t_first = start
                    if start is not None and end is not None and end >= start:
                        intervals.append((start, end))
                    if start is not None:
                        encoded = encoded[:-2] + b', "arrival_s": ' + \
                            json.dumps(round(start - t_first, 6)).encode() + b"}\n"
                    written += len(encoded)
                    if written > max_trace_bytes:
                        raise InputError(f"{source}:{lineno}: the trace would exceed "
                                         f"{max_trace_bytes:,} bytes (raise --max-trace-bytes, or "
                                         "split the log)")
                    dst.write(encoded)
            except ValueError as exc:  # a too-long line (from _read_lines)
                raise InputError(f"{source}:{exc}") from None
        if stats["requests"] == 0:
            raise InputError(f"{source}: no requests (expected one JSON request body per line"
                             + (f"; {stats['failed_skipped']} failed requests skipped)"
                                if stats["failed_skipped"] else ")"))
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    from statescope.workload.request_fields import KEPT, NORMALISED

    grouper = grouper_box[0]
    notes = []
    if stats["temperature_nonzero"]:
        notes.append("replayed greedily (temperature 0): statescope compares arms on greedy outputs")
    if normalised_counts.get("n"):
        notes.append(f"n > 1 on {normalised_counts['n']} requests: {NORMALISED['n']}")
    if stats["failed_skipped"]:
        notes.append(f"{stats['failed_skipped']} requests logged with HTTP status >= 400 skipped")
    if images.dropped:
        notes.append(f"{images.dropped} images dropped (--drop-images): a text-only replay")
    manifest = {
        "kind": "statescope request-log import", "trace": str(out), "trace_version": TRACE_VERSION,
        "source": str(source), "source_sha256": sha.hexdigest(), "source_lines": lineno,
        "format": sorted(stats["formats"])[0] if len(stats["formats"]) == 1 else sorted(stats["formats"]),
        "group_by": grouper.mode + (f":{grouper.field_name}" if grouper.mode == "field" else ""),
        "replay": replay, "requests": stats["requests"], "episodes": len(grouper.steps),
        "images": stats["images"], "images_dropped": images.dropped,
        "image_roots": [str(r) for r in roots], "model": model,
        "agent_loop_possible": stats["agent_loop_shaped"] == stats["requests"],
        "temperature_nonzero": stats["temperature_nonzero"],
        "max_tokens_defaulted": stats["max_tokens_defaulted"],
        "failed_skipped": stats["failed_skipped"],
        # per field of the request bodies: kept (sent on replay), normalised (how, and how often);
        # a refused field stops the import, so a written manifest has none
        "fields": {"kept": dict(sorted(kept_counts.items())),
                   "normalised": {k: {"requests": v, "how": NORMALISED.get(k) or (
                       "its default value: the same as leaving it out" if k in KEPT
                       else "the log's metadata: not sent")}
                                  for k, v in sorted(normalised_counts.items())},
                   "refused": {}},
        "max_concurrency": max_overlap(intervals) if intervals else None,
        "timed_requests": len(intervals),
        "notes": notes,
    }
    mp = manifest_path(out)
    mp.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _import_line(raw: bytes, lineno: int, source: Path, fmt: str, replay: str,
                 default_max_tokens: int, images: ImageCache, stats: dict, kept_counts: Counter,
                 normalised_counts: Counter, request_lines: dict, grouper_box: list,
                 group_by: str) -> tuple[bytes, dict] | None:
    """One log line as an encoded trace line (without ``arrival_s``) and what the caller checks
    across lines; None for a skipped (failed) request."""
    from statescope.workload.request_fields import classify

    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{source}:{lineno}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
    except RecursionError:
        raise InputError(f"{source}:{lineno}: field '(line)': nested too deeply (expected a chat "
                         f"request body, at most {MAX_DEPTH} levels deep)") from None
    try:
        if not isinstance(obj, dict):
            raise BadField("(line)", "expected a JSON object (one request per line)")
        check_depth(obj)
        meta_src = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        status = _status(obj, meta_src)
        if status is not None and status >= 400:
            stats["failed_skipped"] += 1
            return None
        body, line_fmt = body_of(obj, fmt)
        stats["formats"].add(line_fmt)
        meta = {**(body.get("metadata") or {}), **meta_src} \
            if isinstance(body.get("metadata") or {}, dict) else {}
        kept, normalised = classify(body, () if body is not obj else METADATA_NAMES)
        messages, n_images = messages_of(body, images)
        grouper = grouper_box[0]
        if grouper is None:
            grouper = grouper_box[0] = _grouper_for(group_by, obj, body, meta)
        key = None
        if grouper.mode == "field":
            key = lookup(obj, body, meta, grouper.field_name)
            if key is None:
                raise BadField(grouper.field_name, "missing (the log is grouped into "
                               f"episodes by {grouper.field_name!r}, found on line 1)")
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is None:
            max_tokens = default_max_tokens
            stats["max_tokens_defaulted"] += 1
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadField("max_tokens", f"expected an integer >= 1, got {max_tokens!r}")
        temperature = body.get("temperature")
        if temperature is not None and (not isinstance(temperature, (int, float))
                                        or isinstance(temperature, bool)):
            raise BadField("temperature", f"expected a number, got {temperature!r}")
        n = body.get("n", 1)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise BadField("n", f"expected an integer >= 1, got {n!r}")
        start_name, start = first_field(obj, meta, START_FIELDS)
        end_name, end = first_field(obj, meta, END_FIELDS)
        start = timestamp(start, start_name or "timestamp")
        end = timestamp(end, end_name or "end_time")
        id_name, request_id = first_field(obj, meta, REQUEST_ID_FIELDS)
        if request_id is not None:
            rid = hashlib.sha1(str(request_id).encode("utf-8", "surrogatepass")).digest()
            if rid in request_lines:
                raise BadField(id_name, f"request id already on line {request_lines[rid]}: "
                                        "expected one line per request")
            request_lines[rid] = lineno
        episode, step = grouper.assign(messages, key, lineno)
    except BadField as bad:
        raise InputError(f"{source}:{lineno}: field {bad.field!r}: {bad.what}") from None
    shaped = agent_loop_turns(messages, step)
    if replay == "agent_loop" and shaped is None:
        raise InputError(
            f"{source}:{lineno}: field 'messages': step {step} of episode {episode!r} "
            f"is not [system] + {step} x (user, assistant) + user, so it cannot be "
            "rebuilt as an agent loop (import with --replay as_logged)")
    # as_logged: the messages hold the turns, so system/user are not stored a second time
    # (``statescope.workload.trace`` derives them for an agent-loop replay of such a trace)
    line: dict[str, Any] = {"trace_version": TRACE_VERSION, "episode": episode, "step": step,
                            "replay": replay}
    if replay == "agent_loop":
        line.update(system=shaped[0], user=shaped[1])
    else:
        line.update(system=None, user=None)
    line["max_tokens"] = max_tokens
    if replay == "as_logged":
        line["messages"] = messages
    if kept:
        line["request"] = kept
    line["log_line"] = lineno
    if request_id is not None:
        line["request_id"] = str(request_id)
    if temperature is not None:
        line["temperature"] = temperature
    try:
        encoded = (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        where = surrogate_field(line) or "(line)"
        raise InputError(f"{source}:{lineno}: field {where!r}: holds a lone UTF-16 surrogate "
                         "(expected valid Unicode text)") from None
    stats["requests"] += 1
    stats["images"] += n_images
    stats["temperature_nonzero"] += bool(temperature)
    stats["agent_loop_shaped"] += shaped is not None
    kept_counts.update(list(kept))
    normalised_counts.update(k for k in normalised if k != "n" or (body.get("n") or 1) > 1)
    return encoded, {"model": body.get("model"), "start": start, "end": end}


def _grouper_for(group_by: str, obj: dict, body: dict, meta: dict) -> _Grouper:
    if group_by.startswith("field:"):
        return _Grouper("field", group_by.split(":", 1)[1])
    if group_by == "auto":
        for name in ID_FIELDS:
            if lookup(obj, body, meta, name) is not None:
                return _Grouper("field", name)
        return _Grouper("prefix")
    return _Grouper(group_by)


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals [start, end) open at one time (a request's in-flight concurrency)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals],
                    key=lambda ev: (ev[0], ev[1]))  # ends before starts at the same instant
    best = cur = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best
