"""Trace files: the GUI-agent workload as JSONL, one request (episode step) per line.

Schema (``trace_version`` 1), one JSON object per line:

    {"trace_version": 1, "episode": "ep0007", "step": 2,
     "replay": "agent_loop" | "as_logged",   # how the step's request is built (absent: agent_loop)
     "system": "..." | null,          # same text on every line of an episode; null: no system turn
     "user": "..." | [parts],         # this step's user turn: text, or OpenAI content parts
                                      #   {"type": "text", "text": ...} and
                                      #   {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
     "messages": [...],               # as_logged only: the request's whole message list, as recorded
     "max_tokens": 24,
     "request": {...},                # optional: the request's other fields sent on replay (tools,
                                      #   tool_choice, stop, ...: statescope.workload.request_fields)
     "expected": "click(id=12)",      # optional: the correct action, for grading
     "geometry": null | {"align": "before"|"at"|"after"|"image_across", "offset": 0}}   # optional

Two replay modes. *agent_loop*: a step's request is built at run time from system + every earlier
user turn and the *answer the engine actually gave* + this user turn, so the prompt grows by a
shared prefix (``build_messages``) — what presets do. *as_logged*: the step sends its recorded
``messages`` unchanged (an imported request log: ``statescope.workload.importer``); ``system`` and
``user`` are then optional (an import leaves them null: the messages hold the turns, and an
agent-loop replay derives them from there when the messages are shaped so). All lines of
a trace share one mode. Steps of an episode are numbered 0..n-1 without gaps. The metadata keys
``request_id``, ``arrival_s``, ``temperature`` and ``log_line`` are kept as ``extra``; any other
key is an error (a misspelt field must not be ignored).

What it does: write traces from presets (``statescope.workload.episodes.preset_trace``), read and validate
them (one ``InputError`` naming the file, line number and field), build chat messages.
What it deliberately does not do: run anything or apply geometry (the runner knows the resolved
Mamba block size; ``statescope.workload.geometry`` pads prompts).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from statescope.errors import InputError

TRACE_VERSION = 1
ALIGNS = ("before", "at", "after", "image_across")
REPLAYS = ("agent_loop", "as_logged")
# optional per-request metadata an imported log carries (kept in ``TraceStep.extra``); any other
# key is refused, so a misspelt field is not ignored
METADATA = ("request_id", "arrival_s", "temperature", "log_line")


@dataclass
class TraceStep:
    episode: str
    step: int
    system: str | None
    user: Any  # str or list of content parts (None: an as_logged step without a user turn)
    max_tokens: int = 24
    expected: str | None = None
    geometry: dict | None = None
    extra: dict = field(default_factory=dict)
    replay: str = "agent_loop"
    messages: list | None = None  # as_logged: the recorded request
    request: dict | None = None   # kept request fields sent on replay (tools, stop, ...)
    # where the step was read ("trace.jsonl:12"), for errors; not part of the step itself
    source: str | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict:
        out = {"trace_version": TRACE_VERSION, "episode": self.episode, "step": self.step,
               "replay": self.replay, "system": self.system, "user": self.user,
               "max_tokens": self.max_tokens}
        if self.messages is not None:
            out["messages"] = self.messages
        if self.request is not None:
            out["request"] = self.request
        if self.expected is not None:
            out["expected"] = self.expected
        if self.geometry is not None:
            out["geometry"] = self.geometry
        out.update(self.extra)
        return out

    @property
    def n_images(self) -> int:
        """Images of this step's own turn (as_logged: of its whole recorded request)."""
        if self.messages is not None:
            return sum(1 for m in self.messages if isinstance(m.get("content"), list)
                       for p in m["content"] if p.get("type") == "image_url")
        if not isinstance(self.user, list):
            return 0
        return sum(1 for p in self.user if p.get("type") == "image_url")


def agent_loop_turns(messages: list[dict], step: int) -> tuple[str | None, Any] | None:
    """(system, user turn) when ``messages`` is ``[system] + step × (user, assistant) + user``
    with a text-only system prompt; else None (the request cannot be rebuilt as an agent loop)."""
    if any(m.get("tool_calls") for m in messages):
        return None  # tool calls are answers an agent loop would have to re-create
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


def _fail(path: Path | str, lineno: int, what: str) -> None:
    raise InputError(f"{path}:{lineno}: {what}")


def _base64_ok(url: str) -> bool:
    """A ``data:image/...;base64,PAYLOAD`` URL whose payload is valid base64 (strict alphabet)."""
    import base64
    import binascii

    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        return False
    try:
        base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _check_parts(path, lineno, parts: Any, where: str = "user") -> None:
    if isinstance(parts, str):
        return
    if not isinstance(parts, list) or not parts:
        _fail(path, lineno, f"field {where!r}: expected a string or a non-empty list of content parts")
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "image_url" and isinstance(part.get("image_url"), dict) \
                and str(part["image_url"].get("url", "")).startswith(("data:image/", "http", "file:")):
            url = str(part["image_url"]["url"])
            if url.startswith("data:image/") and not _base64_ok(url):
                _fail(path, lineno, f"field '{where}[{i}]': the image's data URL is not "
                                    "'data:image/TYPE;base64,' followed by valid base64")
            continue
        _fail(path, lineno, f"field '{where}[{i}]': expected {{'type': 'text', 'text': str}} or "
                            "{'type': 'image_url', 'image_url': {'url': 'data:image/...'}}")


def _check_messages(path, lineno, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        _fail(path, lineno, "field 'messages': expected a non-empty list of chat messages "
                            "(an as_logged step)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            _fail(path, lineno, f"field 'messages[{i}]': expected {{'role': str, 'content': ...}}")
        if m["content"] is not None and not (m["role"] == "assistant" and m["content"] == ""):
            _check_parts(path, lineno, m["content"], f"messages[{i}].content")


def parse_line(obj: Any, path: Path | str = "<trace>", lineno: int = 1) -> TraceStep:
    """Validate one decoded line; raises InputError naming ``path:lineno`` and the field."""
    if not isinstance(obj, dict):
        _fail(path, lineno, "expected a JSON object")
    if obj.get("trace_version") != TRACE_VERSION:
        _fail(path, lineno, f"field 'trace_version': expected {TRACE_VERSION}, "
                            f"got {obj.get('trace_version')!r}")
    for key, typ, desc in (("episode", str, "a string"), ("step", int, "an integer >= 0"),
                           ("max_tokens", int, "an integer >= 1")):
        value = obj.get(key)
        if not isinstance(value, typ) or isinstance(value, bool):
            _fail(path, lineno, f"field {key!r}: expected {desc}, got {value!r}")
    if obj["step"] < 0 or obj["max_tokens"] < 1:
        _fail(path, lineno, "field 'step' must be >= 0 and 'max_tokens' >= 1")
    if obj.get("expected") is not None and not isinstance(obj["expected"], str):
        _fail(path, lineno, f"field 'expected': expected a string or null, got {obj['expected']!r}")
    replay = obj.get("replay", "agent_loop")
    if replay not in REPLAYS:
        _fail(path, lineno, f"field 'replay': expected one of {REPLAYS}, got {replay!r}")
    if replay == "as_logged":
        _check_messages(path, lineno, obj.get("messages"))
    if replay == "agent_loop" or obj.get("user") is not None:
        if "system" not in obj:
            _fail(path, lineno, "field 'system': missing (expected a string or null)")
        if "user" not in obj:
            _fail(path, lineno, "field 'user': missing")
        _check_parts(path, lineno, obj["user"])
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        _fail(path, lineno, f"field 'system': expected a string or null, got {system!r}")
    geo = obj.get("geometry")
    if geo is not None and (not isinstance(geo, dict) or geo.get("align") not in ALIGNS
                            or not isinstance(geo.get("offset", 0), int)):
        _fail(path, lineno, f"field 'geometry': expected null or {{'align': one of {ALIGNS}, "
                            "'offset': int}")
    request = obj.get("request")
    if request is not None and not isinstance(request, dict):
        _fail(path, lineno, f"field 'request': expected an object of request fields, got "
                            f"{type(request).__name__}")
    known = {"trace_version", "episode", "step", "system", "user", "max_tokens", "expected",
             "geometry", "replay", "messages", "request", *METADATA}
    unknown = sorted(set(obj) - known)
    if unknown:  # a misspelt field ("max_token") must not be ignored silently
        _fail(path, lineno, f"unknown field(s) {unknown}; expected fields from {sorted(known)}")
    if obj.get("temperature") is not None and (not isinstance(obj["temperature"], (int, float))
                                               or isinstance(obj["temperature"], bool)):
        _fail(path, lineno, f"field 'temperature': expected a number or null, got "
                            f"{obj['temperature']!r}")
    core = known - set(METADATA)
    return TraceStep(obj["episode"], obj["step"], system, obj.get("user"), obj["max_tokens"],
                     obj.get("expected"), geo, {k: v for k, v in obj.items() if k not in core},
                     replay=replay, messages=obj.get("messages"), request=request,
                     source=f"{path}:{lineno}")


def read_trace(path: str | Path) -> list[TraceStep]:
    """Read and validate a whole trace (steps of each episode must be 0..n-1, in order)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected a trace file (JSON lines)")
    if not path.is_file():
        raise InputError(f"{path}: trace file does not exist")
    steps: list[TraceStep] = []
    next_step: dict[str, int] = {}
    try:
        lines = path.read_bytes().decode("utf-8").split("\n")  # JSON strings may hold U+2028
    except UnicodeDecodeError as exc:
        lineno = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise InputError(f"{path}:{lineno}: not UTF-8 text (byte {exc.start}); expected JSON "
                         "lines") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            _fail(path, lineno, f"not valid JSON ({exc.msg} at column {exc.colno})")
        except (ValueError, RecursionError) as exc:  # an integer of > 4300 digits; nesting too deep
            _fail(path, lineno, f"not valid JSON ({type(exc).__name__}: {str(exc)[:120]})")
        step = parse_line(obj, path, lineno)
        want = next_step.get(step.episode, 0)
        if step.step != want:
            _fail(path, lineno, f"field 'step': episode {step.episode!r} expected step {want}, "
                                f"got {step.step}")
        next_step[step.episode] = want + 1
        if steps and step.replay != steps[0].replay:
            _fail(path, lineno, f"field 'replay': {step.replay!r}, but line 1 says "
                                f"{steps[0].replay!r} (one replay mode per trace)")
        steps.append(step)
    if not steps:
        raise InputError(f"{path}: trace is empty (expected one JSON object per line)")
    return steps


def write_trace(steps: Iterable[TraceStep], path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected the trace file to write")
    if path.parent.exists() and not path.parent.is_dir():
        raise InputError(f"{path}: {path.parent} is a file, expected a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as fh:
        for s in steps:
            fh.write(json.dumps(s.to_json()) + "\n")
    tmp.replace(path)
    return path


def episodes_of(steps: list[TraceStep]) -> dict[str, list[TraceStep]]:
    out: dict[str, list[TraceStep]] = {}
    for s in steps:
        out.setdefault(s.episode, []).append(s)
    return out


def build_messages(episode_steps: list[TraceStep], step: int, answers: list[str]) -> list[dict]:
    """Chat messages for ``step``: system, earlier user turns with the real answers, this turn."""
    if len(answers) < step:
        raise InputError(f"episode {episode_steps[0].episode!r} step {step}: needs {step} earlier "
                         f"answers, got {len(answers)}")
    turns = [_turns(s) for s in episode_steps[:step + 1]]
    missing = [s.step for s, t in zip(episode_steps, turns) if t is None]
    if missing:
        raise InputError(f"episode {episode_steps[0].episode!r} step {missing[0]}: no 'user' turn "
                         "recorded (nor messages shaped [system] (user assistant)* user), so it "
                         "cannot be replayed as an agent loop (replay it as_logged)")
    system = turns[0][0]
    msgs = [] if system is None else [{"role": "system", "content": system}]
    for k in range(step):
        msgs += [{"role": "user", "content": turns[k][1]},
                 {"role": "assistant", "content": answers[k]}]
    msgs.append({"role": "user", "content": turns[step][1]})
    return msgs


def _turns(s: TraceStep) -> tuple[str | None, Any] | None:
    """(system, user turn) of a step: as written, or derived from its recorded messages."""
    if s.user is not None:
        return s.system, s.user
    return agent_loop_turns(s.messages, s.step) if s.messages else None


def trace_sha(trace: Sequence[TraceStep]) -> str:
    """16 hex digits identifying a trace: every step's episode, step, messages (images included),
    max_tokens, geometry and extra fields, in order. Two arms are only comparable on one trace."""
    # the default replay mode is left out, so a preset trace keeps the sha it had before the
    # field existed (committed runs are compared by it)
    lines = [{k: v for k, v in s.to_json().items() if (k, v) != ("replay", "agent_loop")}
             for s in trace]
    canon = json.dumps(lines, sort_keys=True, separators=(",", ":"),
                       ensure_ascii=False, default=str)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def step_messages(episode_steps: list[TraceStep], step: int, answers: list[str],
                  replay: str | None = None) -> list[dict]:
    """The request of ``step`` in ``replay`` mode (default: the trace's own): the recorded messages
    (as_logged) or the agent loop rebuilt from the engine's ``answers`` (agent_loop); a
    ``ChatRequest`` carrying the step's ``request`` fields when it has any."""
    from statescope.workload.request_fields import ChatRequest

    mode = replay or episode_steps[step].replay
    if mode not in REPLAYS:
        raise InputError(f"replay={mode!r}: expected one of {REPLAYS}")
    if mode == "as_logged":
        recorded = episode_steps[step].messages
        if recorded is None:
            raise InputError(f"episode {episode_steps[0].episode!r} step {step}: no recorded "
                             "'messages' (a preset trace replays as agent_loop only)")
        msgs = [dict(m) for m in recorded]
    else:
        msgs = build_messages(episode_steps, step, answers)
    fields = episode_steps[step].request
    return ChatRequest(msgs, fields) if fields else msgs


def prompt_sha(token_ids: Sequence[int]) -> str:
    """16 hex digits identifying a prompt by its token ids (stable across runs and processes)."""
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:16]
