"""Everything ``reproduce`` is given, checked before the first engine or server starts.

Why: an engine start costs 20-60 s on a CPU and minutes on a GPU, and a run of both arms much
more; a bad unit, alpha or store that is only noticed after both arms ran wastes all of it (and
a corrupt records file noticed after the control arm ran leaves a half-written run). Each check
raises one ``InputError`` naming the argument, file or trace line and what was expected.

What it does: ``check_reproduce`` checks the unit, alpha, concurrency, engine lifetimes, the
runner (and that planted faults and emulated copy semantics have a runner statescope launches),
each arm's copy semantics and model directory, the trace (every step's ``max_tokens``, and a
lower bound of its prompt length from the model's tokenizer, against the arm's
``max_model_len``), and the results store (root a directory; an existing run's records and
manifest readable). ``parse_copy_semantics`` and ``parse_fault`` read the command line's
``NAME[:TILE_BYTES]`` and ``KIND[:RATE]``.

What it deliberately does not do: start anything, or change the verdict's rules
(``statescope.verdict.reproduce`` and ``statescope.verdict.stats`` own those).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from statescope.errors import InputError

RUNNERS = ("offline", "server")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_copy_semantics(text: str | None, where: str = "--copy-semantics") -> tuple[str, int] | None:
    """``NAME[:TILE_BYTES]`` -> (name, tile bytes); None for None."""
    from statescope.patches.cpu_kernels_copy import COPY_SEMANTICS, DEFAULT_TILE_BYTES

    if text is None:
        return None
    name, sep, tile = str(text).partition(":")
    if name not in COPY_SEMANTICS:
        raise InputError(f"{where} {text!r}: expected NAME[:TILE_BYTES] with NAME one of {COPY_SEMANTICS}")
    if not sep:
        return name, DEFAULT_TILE_BYTES
    if not tile.isdigit() or int(tile) <= 0:
        raise InputError(f"{where} {text!r}: TILE_BYTES must be a positive integer, got {tile!r}")
    return name, int(tile)


def parse_fault(text: str, where: str = "--fault") -> tuple[str, float]:
    """``KIND[:RATE]`` -> (kind, rate in [0, 1]); the kind is checked by ``FaultSpec``."""
    kind, sep, rest = text.partition(":")
    if not kind:
        raise InputError(f"{where} {text!r}: expected KIND[:RATE]")
    if not sep:
        return kind, 1.0
    try:
        rate = float(rest)
    except ValueError:
        raise InputError(f"{where} {text!r}: RATE must be a number in [0, 1], got {rest!r}") from None
    if not 0.0 <= rate <= 1.0 or math.isnan(rate):
        raise InputError(f"{where} {text!r}: RATE must be in [0, 1], got {rate}")
    return kind, rate


def check_runner(runner: Any, arms: Sequence[Any]) -> None:
    if not isinstance(runner, str):
        raise InputError(f"reproduce runner={runner!r}: expected 'offline', 'server' or an http(s) URL")
    if runner.startswith(("http://", "https://")):
        from urllib.parse import urlparse

        if not urlparse(runner).hostname:
            raise InputError(f"reproduce runner={runner!r}: the URL names no host")
        planted = [a.name for a in arms if getattr(a, "fault", None) or getattr(a, "copy_semantics", None)]
        if planted:
            raise InputError(f"reproduce runner={runner!r}: arm(s) {planted} carry a planted fault or "
                             "emulated copy semantics, which need a runner statescope launches "
                             "('offline' or 'server'), not a URL")
        return
    if runner not in RUNNERS:
        raise InputError(f"reproduce runner={runner!r}: expected 'offline', 'server' or an http(s) URL")


def _tokenizer(model: str):
    """The model's fast tokenizer (``tokenizer.json``), or None where there is none."""
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    except Exception:  # a tokenizer this library cannot read: the engine will say what is wrong
        return None


def _texts(user: Any) -> list[str]:
    """The text parts of a turn (none for a turn without content: an assistant's tool calls)."""
    if user is None:
        return []
    if isinstance(user, str):
        return [user]
    return [p.get("text", "") for p in user if isinstance(p, dict) and p.get("type") == "text"]


def _step_texts(step: Any) -> list[str]:
    """Texts a step adds to its episode's prompt: its user turn, or (an imported as_logged step
    without one) its recorded request's last message."""
    if step.user is not None or not step.messages:
        return _texts(step.user)
    return _texts(step.messages[-1].get("content"))


def check_trace_runner(trace: Sequence[Any], arms: Sequence[Any], runner: Any) -> None:
    """A trace's images need a vision model and its request fields a runner that applies them:
    the same refusal on every runner, before anything starts."""
    from statescope.workload.model_files import is_multimodal
    from statescope.workload.request_fields import offline_blocked

    if runner == "offline":
        for s in trace:
            blocked = offline_blocked(s.request or {})
            if blocked:
                raise InputError(f"{s.source or 'trace'}: field 'request.{blocked}': the offline "
                                 "runner gives the engine a prompt, not a request body, so it "
                                 "cannot apply it; replay with --runner server (or your server's "
                                 "URL)")
    if runner not in RUNNERS:
        return  # a URL serves a model statescope does not know: the server itself refuses
    with_images = next((s for s in trace if s.n_images), None)
    if with_images is None:
        return
    for arm in arms:
        if not is_multimodal(arm.config.model):
            n = sum(s.n_images for s in trace)
            raise InputError(f"{with_images.source or 'trace'}: the trace holds {n} images, but "
                             f"arm {arm.name!r}'s model {arm.config.model} is text-only (it would "
                             "never read them; a server refuses them with HTTP 400): use a vision "
                             "model (--model tiny-vl), or import the log with --drop-images")


def check_trace(trace: Sequence[Any], arms: Sequence[Any], *, prompts: bool = True) -> None:
    """Each step's ``max_tokens`` and prompt (a lower bound: its text turns, no answers, no
    images, no chat template) must fit every arm's ``max_model_len``."""
    from statescope.workload.trace import TraceStep, episodes_of

    if not isinstance(trace, (list, tuple)) or not trace:
        raise InputError("reproduce trace: expected a non-empty list of trace steps")
    if not all(isinstance(s, TraceStep) for s in trace):
        raise InputError("reproduce trace: expected TraceStep items (statescope.workload.trace)")
    limit = min(a.config.max_model_len for a in arms)
    for s in trace:
        if s.max_tokens >= limit:
            raise InputError(f"{s.source or 'trace'}: field 'max_tokens'={s.max_tokens}: expected "
                             f"fewer than the engines' max_model_len ({limit}) tokens")
    tok = _tokenizer(arms[0].config.model) if prompts else None
    if tok is None:
        return
    for steps in episodes_of(list(trace)).values():
        tokens = len(tok.encode(steps[0].system).ids) if steps[0].system else 0
        for s in steps:
            tokens += sum(len(tok.encode(t).ids) for t in _step_texts(s) if t)
            if tokens + s.max_tokens > limit:
                raise InputError(
                    f"{s.source or 'trace'}: episode {s.episode!r} step {s.step}: its prompt has at "
                    f"least {tokens} tokens, which with max_tokens={s.max_tokens} exceeds the "
                    f"engines' max_model_len ({limit}); shorten the episode or raise max_model_len")


def check_store(store_root: Any, run_id: Any) -> None:
    """The results root is a directory (or can be made one), and an existing run is readable."""
    from statescope.records import MANIFEST_FILE, RECORDS_FILE, load_manifest, load_records

    root = Path(store_root)
    for parent in [root, *root.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"results root {root}: {parent} is a file, expected a directory")
            break
    if run_id is None:
        return
    if not isinstance(run_id, str) or not run_id or "/" in run_id or run_id in (".", ".."):
        raise InputError(f"reproduce run_id: expected a non-empty name without '/', got {run_id!r}")
    run_dir = root / run_id
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"run {run_dir}: is a file, expected a run directory")
    if (run_dir / RECORDS_FILE).exists():
        load_records(run_dir)  # a corrupt line (not a torn last one) is an InputError naming it
    if (run_dir / MANIFEST_FILE).exists():
        load_manifest(run_dir)


def check_reproduce(trigger: Any, control: Any, trace: Sequence[Any], *, store_root: Any,
                    run_id: Any, runner: Any, unit: Any, concurrency: Any,
                    episodes_per_lifetime: Any, alpha: Any) -> None:
    """Every check of the module docstring, in the order a user would fix them."""
    from statescope.engine.modeldir import check_model_dir
    from statescope.verdict.units import UNITS

    if unit not in UNITS:
        raise InputError(f"reproduce unit={unit!r}: expected one of {UNITS}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise InputError(f"reproduce alpha={alpha!r}: expected a significance level in (0, 1)")
    if not _is_int(concurrency) or concurrency < 1:
        raise InputError(f"reproduce concurrency={concurrency!r}: expected an integer >= 1")
    if episodes_per_lifetime is not None and (not _is_int(episodes_per_lifetime)
                                              or episodes_per_lifetime < 1):
        raise InputError(f"reproduce episodes_per_lifetime={episodes_per_lifetime!r}: expected "
                         "None or an integer >= 1")
    arms = [trigger, control]
    if trigger.name == control.name:
        raise InputError("reproduce: trigger and control arms need different names")
    check_runner(runner, arms)
    for arm in arms:
        parse_copy_semantics(arm.copy_semantics, f"arm {arm.name!r} copy_semantics")
        if runner in RUNNERS:  # a URL runner serves its own model
            check_model_dir(arm.config.model)
    check_trace(trace, arms, prompts=runner in RUNNERS)
    check_trace_runner(trace, arms, runner)
    check_store(store_root, run_id)
