"""The exit status every ``statescope`` subcommand keeps, and the ``--help`` text that says so.

What it does: ``EXIT_STATUS`` is the one rule (0 clean or no evidence; 1 corruption detected or a
problem found -- geometry not exercised, control or engine broken, a check failed; 2 bad input or a
design that cannot answer); ``exit_epilog(one=...)`` is the epilog a subparser shows (``one`` names
what "a problem" means for that command); ``verdict_exit(outcome)`` maps a verdict outcome
(``statescope.verdict.stats``) to its status; ``add_missing_epilogs(parser)`` gives every subparser
of a parser tree that has no epilog the shared one, so a command registered elsewhere still states
the rule.

What it deliberately does not do: decide outcomes (``statescope.verdict`` does) or exit itself.
"""
from __future__ import annotations

import argparse

OK, PROBLEM, BAD_INPUT = 0, 1, 2

EXIT_STATUS = ("exit status: 0 clean / no evidence; 1 corruption detected or a problem found "
               "(geometry not exercised, control or engine broken, a check failed); 2 bad input "
               "or a design that cannot answer (refused before any engine starts).")


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
    """Every subparser under ``parser`` without an epilog gets ``EXIT_STATUS``."""
    for sub in _subparsers(parser):
        if not sub.epilog:
            sub.epilog = EXIT_STATUS
