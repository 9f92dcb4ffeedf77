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

Bad input raises one ``InputError`` naming the file, line and field: not JSON, no ``messages``, an
image that is neither a data URL nor a readable file, a model different from the first line's
(mixed models), a missing id field when grouping by one. Nothing is written on error.

What it deliberately does not do: contact any server, replay arrival times (a replay keeps the
order and bounds the concurrency by what the log shows), or keep responses that a log may carry.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statescope.errors import InputError
from statescope.workload.log_lines import (
    BadField,
    ImageCache,
    body_of,
    first_field,
    lookup,
    messages_of,
    timestamp,
)
from statescope.workload.trace import REPLAYS, TRACE_VERSION

FORMATS = ("auto", "openai-chat", "openai-batch")
ID_FIELDS = ("episode_id", "episode", "session_id", "conversation_id", "trace_id", "thread_id")
REQUEST_ID_FIELDS = ("request_id", "id", "custom_id")
START_FIELDS = ("timestamp", "start_time", "started_at", "arrival_time", "created")
END_FIELDS = ("end_timestamp", "end_time", "finished_at", "completed_at")
DEFAULT_MAX_TOKENS = 64


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


def agent_loop_turns(messages: list[dict], step: int) -> tuple[str | None, Any] | None:
    """(system, user turn) when ``messages`` is ``[system] + step × (user, assistant) + user``
    with a text-only system prompt; else None (the request cannot be rebuilt as an agent loop)."""
    system, rest = None, messages
    if rest and rest[0]["role"] == "system":
        c = rest[0]["content"]
        if isinstance(c, list):
            if any(p["type"] != "text" for p in c):
                return None
            c = "".join(p["text"] for p in c)
        if not isinstance(c, str):
            return None
        system, rest = c, rest[1:]
    if len(rest) != 2 * step + 1:
        return None
    if any(m["role"] != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(rest)):
        return None
    if rest[-1]["content"] is None or rest[-1]["content"] == "":
        return None
    return system, rest[-1]["content"]


def _digest(prev: bytes, message: dict) -> bytes:
    """Chain digest of a message by role and *text*: images are left out, because agents commonly
    drop older screenshots from the history they resend (the text history stays the same)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\x01".join(p["text"] for p in content if p.get("type") == "text")
    text = f"{message.get('role')}\x00{content if content is not None else ''}"
    return hashlib.sha1(prev + text.encode("utf-8", "surrogatepass")).digest()


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

    def assign(self, messages: list[dict], key: Any) -> tuple[str, int]:
        if self.mode == "field":
            label = str(key)
            if label not in self.by_key:
                self.by_key[label] = self._new(label)
            ep = self.by_key[label]
        elif self.mode == "root":
            head = [m for m in messages[:2] if m["role"] == "system"]
            first_user = next((m for m in messages if m["role"] == "user"), messages[0])
            root = _digest(_digest(b"", head[0]) if head else b"", first_user)
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


def import_request_log(source: str | Path, out: str | Path, *, fmt: str = "auto",
                       group_by: str = "auto", replay: str = "as_logged",
                       default_max_tokens: int = DEFAULT_MAX_TOKENS) -> dict:
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
        raise InputError(f"{source}: request log does not exist")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    sha = hashlib.sha256()
    grouper: _Grouper | None = None
    images = ImageCache()
    stats = {"requests": 0, "images": 0, "temperature_nonzero": 0, "max_tokens_defaulted": 0,
             "formats": set(), "agent_loop_shaped": 0}
    model, model_line, t_first = None, None, None
    intervals: list[tuple[float, float]] = []
    lineno = 0
    try:
        with source.open("rb") as fh, tmp.open("w") as dst:
            for lineno, raw in enumerate(fh, 1):
                sha.update(raw)
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise InputError(f"{source}:{lineno}: not valid JSON "
                                     f"({getattr(exc, 'msg', exc)})") from None
                try:
                    if not isinstance(obj, dict):
                        raise BadField("(line)", "expected a JSON object (one request per line)")
                    body, line_fmt = body_of(obj, fmt)
                    stats["formats"].add(line_fmt)
                    meta = {**(body.get("metadata") or {}), **(obj.get("metadata") or {})} \
                        if isinstance(body.get("metadata") or {}, dict) else {}
                    messages, n_images = messages_of(body, images, source.parent)
                    if grouper is None:
                        grouper = _grouper_for(group_by, obj, body, meta)
                    key = None
                    if grouper.mode == "field":
                        key = lookup(obj, body, meta, grouper.field_name)
                        if key is None:
                            raise BadField(grouper.field_name, "missing (the log is grouped into "
                                       f"episodes by {grouper.field_name!r}, found on line 1)")
                    line_model = body.get("model")
                    if line_model is not None:
                        if model is None:
                            model, model_line = line_model, lineno
                        elif line_model != model:
                            raise BadField("model", f"expected {model!r} (as on line {model_line}), "
                                       f"got {line_model!r}: mixed models (split the log by model)")
                    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
                    if max_tokens is None:
                        max_tokens = default_max_tokens
                        stats["max_tokens_defaulted"] += 1
                    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                        raise BadField("max_tokens", f"expected an integer >= 1, got {max_tokens!r}")
                    temperature = body.get("temperature")
                    if temperature is not None and not isinstance(temperature, (int, float)):
                        raise BadField("temperature", f"expected a number, got {temperature!r}")
                    start_name, start = first_field(obj, meta, START_FIELDS)
                    end_name, end = first_field(obj, meta, END_FIELDS)
                    start = timestamp(start, start_name or "timestamp")
                    end = timestamp(end, end_name or "end_time")
                    _, request_id = first_field(obj, meta, REQUEST_ID_FIELDS)
                except BadField as bad:
                    raise InputError(f"{source}:{lineno}: field {bad.field!r}: {bad.what}") from None
                episode, step = grouper.assign(messages, key)
                shaped = agent_loop_turns(messages, step)
                if replay == "agent_loop" and shaped is None:
                    raise InputError(
                        f"{source}:{lineno}: field 'messages': step {step} of episode {episode!r} "
                        f"is not [system] + {step} x (user, assistant) + user, so it cannot be "
                        "rebuilt as an agent loop (import with --replay as_logged)")
                if t_first is None and start is not None:
                    t_first = start
                if start is not None and end is not None and end >= start:
                    intervals.append((start, end))
                line = {"trace_version": TRACE_VERSION, "episode": episode, "step": step,
                        "replay": replay, "system": shaped[0] if shaped else None,
                        "user": shaped[1] if shaped else None, "max_tokens": max_tokens}
                if replay == "as_logged":
                    line["messages"] = messages
                line["log_line"] = lineno
                if request_id is not None:
                    line["request_id"] = str(request_id)
                if start is not None:
                    line["arrival_s"] = round(start - t_first, 6)
                if temperature is not None:
                    line["temperature"] = temperature
                dst.write(json.dumps(line, ensure_ascii=False) + "\n")
                stats["requests"] += 1
                stats["images"] += n_images
                stats["temperature_nonzero"] += bool(temperature)
                stats["agent_loop_shaped"] += shaped is not None
        if stats["requests"] == 0:
            raise InputError(f"{source}: no requests (expected one JSON request body per line)")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    manifest = {
        "kind": "statescope request-log import", "trace": str(out), "trace_version": TRACE_VERSION,
        "source": str(source), "source_sha256": sha.hexdigest(), "source_lines": lineno,
        "format": sorted(stats["formats"])[0] if len(stats["formats"]) == 1 else sorted(stats["formats"]),
        "group_by": grouper.mode + (f":{grouper.field_name}" if grouper.mode == "field" else ""),
        "replay": replay, "requests": stats["requests"], "episodes": len(grouper.steps),
        "images": stats["images"], "model": model,
        "agent_loop_possible": stats["agent_loop_shaped"] == stats["requests"],
        "temperature_nonzero": stats["temperature_nonzero"],
        "max_tokens_defaulted": stats["max_tokens_defaulted"],
        "max_concurrency": max_overlap(intervals) if intervals else None,
        "timed_requests": len(intervals),
        "notes": ["replayed greedily (temperature 0): statescope compares arms on greedy outputs"]
        if stats["temperature_nonzero"] else [],
    }
    mp = manifest_path(out)
    mp.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


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
