"""What an imported chat-completions body keeps for its replay, field by field.

Every top-level field of a request body falls in one class, so nothing is dropped silently:

* **kept** (``KEPT``) — written to the trace line's ``request`` and sent on replay, because it
  changes what the engine computes: ``tools`` (rendered into the prompt by the chat template),
  ``tool_choice``, ``stop``, ``seed``, ``response_format`` and vLLM's structured-output fields,
  ``top_logprobs``, ``ignore_eos``. ``image_url.detail`` stays in its message part.
* **normalised** (``NORMALISED``) — recorded but replayed differently, for a stated reason:
  sampling (``temperature``, ``top_p``, ... -> greedy: arms are compared on greedy outputs), ``n``
  (-> 1: vLLM refuses n > 1 when greedy; the prompt and so the cache geometry are unchanged),
  ``stream`` / ``stream_options`` (-> one answer; the engine computes the same), and fields that do
  not reach the engine (``metadata``, ``user``, ``store``, ``logprobs``...).
* **refused** — anything else (``logit_bias``, ``functions``, a non-zero penalty, an unknown
  field): the import stops with one line naming the field.

``classify(body)`` returns ``(kept, normalised)`` or raises ``BadField``; ``ChatRequest`` is a
message list that carries the kept fields to a runner (a plain list for everything else), and
``kept_fields(prompt)`` reads them back. ``OFFLINE_UNSUPPORTED`` names the kept fields the
in-process runner cannot apply (it sends a prompt, not a body): a trace with them needs a server
runner, and ``check_trace`` says so before any engine starts.

What it deliberately does not do: validate a field's value beyond its type (the server does),
or read messages (``statescope.workload.log_lines``).
"""
from __future__ import annotations

from typing import Any

KEPT = ("tools", "tool_choice", "stop", "seed", "response_format", "top_logprobs", "ignore_eos",
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "stop_token_ids", "min_tokens")
# field -> why the replay may differ from the log there
NORMALISED = {
    "temperature": "replayed greedily (temperature 0): arms are compared on greedy outputs",
    "top_p": "replayed greedily", "top_k": "replayed greedily", "min_p": "replayed greedily",
    "n": "replayed with n=1: vLLM refuses n > 1 when greedy; the prompt (and the cache geometry) "
         "is the same",
    "stream": "replayed unstreamed: the engine computes the same tokens",
    "stream_options": "replayed unstreamed",
    "logprobs": "the replay always asks for top logprobs (for the margins)",
    "max_completion_tokens": "kept as max_tokens",
    "max_tokens": "kept as max_tokens",
    "parallel_tool_calls": "applied by the server's tool parser to the answer, not by the engine",
    "metadata": "does not reach the engine", "user": "does not reach the engine",
    "store": "does not reach the engine", "service_tier": "does not reach the engine",
    "model": "checked: one model per log", "messages": "kept (as the trace's messages)",
    "return_token_ids": "the replay always asks for token ids",
    "return_tokens_as_token_ids": "the replay always asks for token ids",
    "request_id": "kept as request_id",
}
# zero/neutral values of sampling-side fields that are then harmless to leave out
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1,
           "logit_bias": None, "best_of": 1, "echo": False}
# values of kept fields that mean "as if absent" (counted as normalised, not sent)
KEPT_DEFAULTS = {"ignore_eos": False, "stop": [], "min_tokens": 0, "stop_token_ids": []}
OFFLINE_UNSUPPORTED = ("stop", "response_format", "structured_outputs", "guided_json",
                       "guided_regex", "guided_choice", "guided_grammar", "stop_token_ids",
                       "min_tokens", "ignore_eos", "tool_choice")


class ChatRequest(list):
    """Chat messages plus the request's kept fields (``fields``), as a runner is given them."""

    def __init__(self, messages: Any = (), fields: dict | None = None) -> None:
        super().__init__(messages)
        self.fields = dict(fields or {})


def kept_fields(prompt: Any) -> dict:
    """The kept request fields a prompt carries (``{}`` for a plain prompt)."""
    return dict(getattr(prompt, "fields", None) or {})


def offline_blocked(fields: dict) -> str | None:
    """The first kept field the offline runner cannot apply, or None. ``tool_choice`` 'auto' and
    'none' only render the prompt, which the offline runner does."""
    for name in OFFLINE_UNSUPPORTED:
        if name not in fields:
            continue
        if name == "tool_choice" and fields[name] in ("auto", "none", None):
            continue
        return name
    return None


def classify(body: dict, metadata_names: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
    """(kept fields, names of normalised fields present) of a request body; ``BadField`` for a
    field that would change the engine's computation and cannot be replayed.
    ``metadata_names`` are names the importer reads as metadata (ids, times, status)."""
    from statescope.workload.log_lines import BadField

    kept, normalised = {}, []
    for name, value in body.items():
        if name in KEPT:
            if value is None or (name in KEPT_DEFAULTS and value == KEPT_DEFAULTS[name]):
                normalised.append(name)
            else:
                kept[name] = value
        elif name in NORMALISED or name in metadata_names:
            normalised.append(name)
        elif name in NEUTRAL and (value is None or value == NEUTRAL[name] or value == {}):
            normalised.append(name)
        elif name in ("functions", "function_call"):
            raise BadField(name, "the legacy 'functions' API is not replayed (send 'tools')")
        else:
            raise BadField(name, f"not replayed by statescope and may change what the engine "
                                 f"computes (value {type(value).__name__}); remove it from the log "
                                 "to replay without it")
    if "tools" in kept and (not isinstance(kept["tools"], list) or not kept["tools"]):
        raise BadField("tools", "expected a non-empty list of tool definitions")
    if "top_logprobs" in kept and (not isinstance(kept["top_logprobs"], int)
                                   or isinstance(kept["top_logprobs"], bool)):
        raise BadField("top_logprobs", "expected an integer")
    return kept, normalised
