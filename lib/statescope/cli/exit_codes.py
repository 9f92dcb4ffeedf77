"""The conventions every ``statescope`` subcommand keeps: its exit status and the ``--help`` text
that says so, ``--json`` with one help text, and enum options that show their values.

What it does: ``EXIT_STATUS`` is the one rule (0 clean or no evidence; 1 corruption detected or a
problem found -- geometry not exercised, control or engine broken, a check failed; 2 bad input or a
design that cannot answer); ``exit_epilog(one=...)`` is the epilog a subparser shows (``one`` names
what "a problem" means for that command); ``verdict_exit(outcome)`` maps a verdict outcome
(``statescope.verdict.stats``) to its status; ``add_missing_epilogs(parser)`` gives every subparser
of a parser tree that has no epilog the shared one, so a command registered elsewhere still states
the rule (and every ``--json`` flag without a help text ``JSON_HELP``). ``add_json_flag(parser)``
adds the ``--json`` flag of a report; ``shown_choices(values)`` is the ``choices=`` of an enum
option whose value the library checks itself: ``--help`` shows ``{a,b}``, and a bad value still
gets the library's one-line error naming the field (exit 2) instead of argparse's.

What it deliberately does not do: decide outcomes (``statescope.verdict`` does) or exit itself.
"""
from __future__ import annotations

import argparse

OK, PROBLEM, BAD_INPUT = 0, 1, 2

EXIT_STATUS = ("exit status: 0 clean / no evidence; 1 corruption detected or a problem found "
               "(geometry not exercised, control or engine broken, a check failed); 2 bad input "
               "or a design that cannot answer (refused before any engine starts).")


JSON_HELP = "print the report as JSON on stdout"


def add_json_flag(parser: argparse.ArgumentParser, help: str = JSON_HELP) -> None:
    """The ``--json`` flag of a report command (``help``: when the JSON is more than the report)."""
    parser.add_argument("--json", action="store_true", help=help)


class _ShownChoices(tuple):
    """Values argparse lists in ``--help`` but does not enforce: ``in`` is always true, so the
    library's own check (an ``InputError`` naming the field, also what notebook callers get)
    stays the one that refuses a bad value."""

    def __contains__(self, value: object) -> bool:
        return True


def shown_choices(values) -> tuple:
    """``choices=`` for an option the library validates: shown in ``--help``, checked later."""
    return _ShownChoices(values)


def exit_epilog(one: str | None = None) -> str:
    """The shared epilog; ``one``: what status 1 means for this command, when more specific."""
    return EXIT_STATUS if one is None else f"{EXIT_STATUS} Here 1 means: {one}."


def verdict_exit(outcome: str) -> int:
    """0 for 'no evidence', 1 for every other verdict outcome (corruption detected, geometry not
    exercised, control broken, engine broken)."""
    from statescope.verdict.stats import NO_EVIDENCE

    return OK if outcome == NO_EVIDENCE else PROBLEM


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = []
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases share one parser
                out += [sub, *_subparsers(sub)]
    return out


def add_missing_epilogs(parser: argparse.ArgumentParser) -> None:
    """Every subparser under ``parser`` without an epilog gets ``EXIT_STATUS``, and every
    ``--json`` flag without a help text ``JSON_HELP`` (a command registered elsewhere still
    keeps both conventions)."""
    for sub in _subparsers(parser):
        if not sub.epilog:
            sub.epilog = EXIT_STATUS
        for action in sub._actions:
            if "--json" in action.option_strings and not action.help:
                action.help = JSON_HELP
