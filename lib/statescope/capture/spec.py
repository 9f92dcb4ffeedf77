"""The capture spec: what to record inside vLLM, for which requests and steps, and how much.

What it does: ``CaptureSpec`` is read from a JSON file (env ``STATESCOPE_CAPTURE`` = its path) or a
dict, validated field by field (an ``InputError`` names the file and field), and answers the two
questions the recorder asks in the step: ``selects(request)`` — is this request recorded at all —
and ``wants_snapshot(request, step)`` — does this (request, request-local step) get a full state
snapshot. Selection uses only what is stable across runs and processes (the prompt token ids and
vLLM's request id), so two runs of one workload select the same requests.

Spec fields (all optional except ``output_dir``)::

    {"output_dir": "captures", "run_id": null, "mode": "digest",      # off | digest | full
     "requests": {"all": true} | {"sample": 0.25, "seed": 0} | {"ids": ["3", "7-ab12"]}
                 | {"prompt_prefixes": ["goal: "]} | {"episode_tags": ["[ep:3]"]},
     "full": {"pairs": [["3", 0], ["7", 2]], "first_steps": 2},       # request-local steps
     "max_bytes": 1000000000, "projections": 3, "digest_seed": 0, "census": true,
     "draft_columns": false, "flush_every_steps": 64, "flush_interval_s": 2.0,
     "emit": "auto", "defer_max_steps": 1024, "accelerator_path": false}

``draft_columns``: also digest the speculative columns after the running one (the candidate
states after each scheduled draft token), as digest rows with ``column_offset`` 1..drafts. Off
by default: with MTP(2) it triples the state bytes digested per step (docs/benchmarks.md has the
measured cost). Without it the capture still digests, per request with drafts, the one column
its next step resumes from (``statescope.capture.resume``; digest column ``resume``).

``accelerator_path``: on a CPU engine, take the accelerator's launch path anyway (reductions in the
step, one packed host copy, the post-process's staged launch decisions) — what a GPU run executes,
so a CPU run can show it; the digest numbers are the same either way.

``emit``: when finished steps become table rows. ``"background"``: at once, by the flusher thread;
``"idle"``: the flusher only appends them to the run's spool, rows are made when no engine step has
started for a quarter second, when ``defer_max_steps`` steps wait, or at flush/close
(``statescope.capture.spool``); ``"auto"`` (default): idle on an accelerator, background on CPU.

A request id matches an ``ids`` entry when equal, or when the part before vLLM's random ``-suffix``
is equal (offline requests are ``"<n>-<hex>"``). ``prompt_prefixes`` / ``episode_tags`` are text,
tokenized once in the worker with the model's tokenizer; a prefix must open the prompt (after an
optional BOS token), a tag may occur anywhere in it.

What it deliberately does not do: touch vLLM or tensors (``statescope.capture.recorder`` does) or decide
where bytes go (``statescope.capture.store``).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from statescope.errors import InputError
from statescope.workload.trace import prompt_sha

ENV_CAPTURE = "STATESCOPE_CAPTURE"
MODES = ("off", "digest", "full")
REQUEST_KEYS = ("all", "sample", "seed", "ids", "prompt_prefixes", "episode_tags")
TOP_KEYS = ("output_dir", "run_id", "mode", "requests", "full", "max_bytes", "projections",
            "digest_seed", "census", "draft_columns", "flush_every_steps", "flush_interval_s", "emit",
            "accelerator_path",
            "defer_max_steps")
EMIT = ("auto", "background", "idle")


def _fraction(seed: int, key: str) -> float:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _contains(haystack: Sequence[int], needle: Sequence[int]) -> bool:
    n = len(needle)
    if n == 0:
        return True
    first = needle[0]
    return any(haystack[i] == first and list(haystack[i:i + n]) == list(needle)
               for i in range(len(haystack) - n + 1))


@dataclass(frozen=True)
class CaptureSpec:
    output_dir: str
    mode: str = "digest"
    run_id: str | None = None
    requests: dict = field(default_factory=lambda: {"all": True})
    full: dict = field(default_factory=dict)
    max_bytes: int = 2 * 2**30
    projections: int = 3
    digest_seed: int = 0
    census: bool = True
    draft_columns: bool = False
    accelerator_path: bool = False
    flush_every_steps: int = 64
    flush_interval_s: float = 2.0
    emit: str = "auto"
    defer_max_steps: int = 1024
    source: str = "<dict>"  # where the spec came from, for error messages and the manifest

    @classmethod
    def from_dict(cls, raw: Any, source: str = "<dict>") -> "CaptureSpec":
        if not isinstance(raw, dict):
            raise InputError(f"capture spec {source}: expected a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(TOP_KEYS))
        if unknown:
            raise InputError(f"capture spec {source}: unknown field(s) {unknown}; expected {TOP_KEYS}")
        if not isinstance(raw.get("output_dir"), str) or not raw["output_dir"]:
            raise InputError(f"capture spec {source}: field 'output_dir' must be a non-empty string")
        kw = {k: v for k, v in raw.items() if k in TOP_KEYS}
        spec = cls(**kw, source=source)
        spec._validate()
        return spec

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CaptureSpec":
        p = Path(path)
        try:
            raw = json.loads(p.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise InputError(f"capture spec {p}: file not found ({ENV_CAPTURE} names it)") from None
        except IsADirectoryError:
            raise InputError(f"capture spec {p}: is a directory, expected a JSON file") from None
        except UnicodeDecodeError as exc:
            raise InputError(f"capture spec {p}: not UTF-8 text (byte {exc.start}); expected a "
                             "JSON file") from None
        except OSError as exc:
            raise InputError(f"capture spec {p}: cannot be read ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"capture spec {p}: not valid JSON ({exc})") from None
        spec = cls.from_dict(raw, source=str(p))
        if not Path(spec.output_dir).is_absolute():  # relative to the spec file, not the cwd
            spec = spec.replace(output_dir=str((p.parent / spec.output_dir).resolve()))
        return spec

    @classmethod
    def from_env(cls) -> "CaptureSpec | None":
        path = os.environ.get(ENV_CAPTURE, "").strip()
        return cls.load(path) if path else None

    def replace(self, **changes: Any) -> "CaptureSpec":
        import dataclasses

        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in TOP_KEYS}

    def write(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=2))
        return p

    def _bad(self, name: str, expected: str) -> None:
        raise InputError(f"capture spec {self.source}: field {name!r}={getattr(self, name, None)!r}: "
                         f"expected {expected}")

    def _validate(self) -> None:
        if self.mode not in MODES:
            self._bad("mode", f"one of {MODES}")
        if self.emit not in EMIT:
            self._bad("emit", f"one of {EMIT}")
        for name in ("max_bytes", "flush_every_steps", "defer_max_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                self._bad(name, "a positive integer")
        if isinstance(self.projections, bool) or not isinstance(self.projections, int) \
                or not 0 <= self.projections <= 16:
            self._bad("projections", "an integer in 0..16")
        if isinstance(self.flush_interval_s, bool) or not isinstance(self.flush_interval_s, (int, float)) \
                or not self.flush_interval_s > 0:
            self._bad("flush_interval_s", "a positive number of seconds")
        for name in ("census", "draft_columns", "accelerator_path"):
            if not isinstance(getattr(self, name), bool):
                self._bad(name, "true or false")
        if self.run_id is not None and (not isinstance(self.run_id, str) or "/" in self.run_id):
            self._bad("run_id", "null or a name without '/'")
        self._validate_requests()
        self._validate_full()

    def _validate_requests(self) -> None:
        r = self.requests
        if not isinstance(r, dict) or not r or set(r) - set(REQUEST_KEYS):
            self._bad("requests", f"an object with keys from {REQUEST_KEYS}")
        if "sample" in r and (isinstance(r["sample"], bool) or not isinstance(r["sample"], (int, float))
                              or not 0 < r["sample"] <= 1):
            raise InputError(f"capture spec {self.source}: field 'requests.sample'={r['sample']!r}: "
                             "expected a fraction in (0, 1]")
        for key in ("ids", "prompt_prefixes", "episode_tags"):
            if key in r and (not isinstance(r[key], list) or not r[key]
                             or not all(isinstance(x, str) and x for x in r[key])):
                raise InputError(f"capture spec {self.source}: field 'requests.{key}': expected a "
                                 "non-empty list of non-empty strings")
        if "seed" in r and (isinstance(r["seed"], bool) or not isinstance(r["seed"], int)):
            raise InputError(f"capture spec {self.source}: field 'requests.seed': expected an int")

    def _validate_full(self) -> None:
        f = self.full
        if not isinstance(f, dict) or set(f) - {"pairs", "first_steps"}:
            self._bad("full", "an object with keys 'pairs' and/or 'first_steps'")
        pairs = f.get("pairs", [])
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                and isinstance(p[1], int) and p[1] >= 0 for p in pairs):
            raise InputError(f"capture spec {self.source}: field 'full.pairs': expected a list of "
                             "[request id, request-local step >= 0] pairs")
        k = f.get("first_steps", 0)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InputError(f"capture spec {self.source}: field 'full.first_steps': expected an "
                             "integer >= 0")

    # ---- questions asked in the worker -------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def selects(self, req_id: str, prompt_ids: Sequence[int],
                tokenize: Callable[[str], list[int]] | None = None) -> bool:
        """Whether ``req_id`` (with these prompt token ids) is recorded; criteria are OR-ed."""
        r = self.requests
        if r.get("all"):
            return True
        if "sample" in r and _fraction(int(r.get("seed", 0)), prompt_sha(prompt_ids)) < r["sample"]:
            return True
        if "ids" in r and any(_id_matches(req_id, k) for k in r["ids"]):
            return True
        if ("prompt_prefixes" in r or "episode_tags" in r) and tokenize is None:
            raise InputError(f"capture spec {self.source}: prompt_prefixes/episode_tags need the "
                             "model's tokenizer, which the worker could not load")
        ids = list(prompt_ids)
        for text in r.get("prompt_prefixes", []):
            pre = tokenize(text)
            if ids[:len(pre)] == pre or ids[1:1 + len(pre)] == pre:
                return True
        return any(_contains(ids, tokenize(tag)) for tag in r.get("episode_tags", []))

    def wants_snapshot(self, req_id: str, step: int) -> bool:
        """Full snapshot for this request-local step? Only in mode 'full'."""
        if self.mode != "full":
            return False
        pairs, first = self.full.get("pairs", []), self.full.get("first_steps", 0)
        if not pairs and not first:
            return True  # mode 'full' without a selection: every step (bounded by max_bytes)
        return step < first or any(s == step and _id_matches(req_id, k) for k, s in pairs)


def _id_matches(req_id: str, key: str) -> bool:
    return req_id == key or req_id.split("-", 1)[0] == key
