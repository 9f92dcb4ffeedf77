"""How a capture run ended: planned against captured, and the engine's error, in its manifest.

Why: a capture whose engine raised mid-run used to read ``status: complete``, and a comparison
of it against a reference then said "0 of 12 requests diverge" — true of the two steps it had,
silent about the four it lacked. ``run_ending`` makes the manifest's ``ended`` record at close
(``statescope.capture.recorder``): who closed the run, the engine steps captured, hook errors,
what the workload driver planned (``workload``: ``requests_planned``, ``max_tokens``, a
description) and what it reported (``requests_finished``, ``engine_error``), and ``complete``
with the reason. ``ending(manifest)`` reads it back, and gives an older capture without the
record its best reading of ``status``.

``require_complete(run, allow, command)`` is the refusal every reader of a capture makes first.

What it deliberately does not do: decide what a comparison does with an incomplete run
(``statescope.diverge.report`` refuses it unless told to go on), or count a run's rows.
"""
from __future__ import annotations

from typing import Any, Mapping


def run_ending(workload: dict | None, outcome: dict | None, closed_by: str, engine_steps: int,
               hook_errors: int) -> dict:
    """The manifest's ``ended`` record; ``complete`` is False when the engine raised, fewer
    requests finished than were planned, or a planned workload never reported its outcome."""
    planned = (workload or {}).get("requests_planned")
    out = dict(outcome or {})
    finished, error = out.get("requests_finished"), out.get("engine_error")
    short = planned is not None and finished is not None and finished < planned
    unreported = planned is not None and outcome is None
    if error:
        why = f"the engine raised: {error}"
    elif unreported:
        why = f"closed ({closed_by}) before the workload reported how it ended"
    elif short:
        why = f"{finished} of {planned} planned requests finished"
    elif workload is None:
        why = "no workload plan recorded: completeness not known"
    else:
        why = "the workload ran to its end"
    return {"complete": not (error or unreported or short), "why": why, "closed_by": closed_by,
            "requests_planned": planned, "requests_finished": finished, "engine_error": error,
            "engine_steps_captured": int(engine_steps), "hook_errors": int(hook_errors),
            "workload": dict(workload) if workload else None,
            **{k: v for k, v in out.items() if k not in ("requests_finished", "engine_error")}}


def ending(manifest: Mapping[str, Any]) -> dict:
    """``{"complete": bool, "why": str, "recorded": bool, ...}`` for a run's manifest: its
    ``ended`` record, with hook errors counted against it; for an older capture, from
    ``status`` (``complete`` counts as complete, with ``recorded: False``)."""
    status = manifest.get("status")
    rec = manifest.get("ended")
    if rec is not None:
        out = dict(rec, recorded=True, status=status)
        if out.get("complete") and status == "complete_with_errors":
            out.update(complete=False, why=f"{manifest.get('error_count', '?')} capture hook "
                                           "error(s): steps may be missing")
        return out
    if status == "complete":
        return {"complete": True, "recorded": False, "status": status,
                "why": "status complete (an older capture: planned vs captured not recorded)"}
    why = {"running": "never closed: the capturing process died or is still writing",
           "complete_with_errors": f"{manifest.get('error_count', '?')} capture hook error(s): "
                                   "steps may be missing"}.get(status, f"status {status!r}")
    return {"complete": False, "recorded": False, "status": status, "why": why}


def require_complete(run: Any, allow_incomplete: bool, command: str) -> str | None:
    """What every reader of a capture does first: an incomplete run (killed mid-run, the engine
    raised, fewer requests finished than planned, never closed) raises ``InputError`` naming the
    run and the reason, unless ``allow_incomplete``; then the returned warning says so (None for
    a complete run)."""
    from statescope.errors import InputError

    end = run.ending()
    if end["complete"]:
        return None
    msg = (f"{command}: capture {run.path} is incomplete: {end['why']} (manifest status "
           f"{end.get('status')!r})")
    if not allow_incomplete:
        raise InputError(msg + "; read a complete capture, run `statescope capture-recover` on a "
                               "killed one, or pass --allow-incomplete to read the steps it has")
    return "INCOMPLETE: " + msg + "; only the steps it captured are read"
