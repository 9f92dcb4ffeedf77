"""statescope's exception types: one base class and one subclass per kind of failure a user must tell apart.

What it does: names the failures (bad input, broken environment, detected corruption, untested geometry,
broken control) so callers can catch them separately. What it deliberately does not do: format
messages or carry data; the raiser writes a message that names the file/field and what was expected.
"""
from __future__ import annotations


class StatescopeError(Exception):
    """Base class for every error statescope raises on purpose."""


class InputError(StatescopeError, ValueError):
    """Bad user input; the message names the file or field and what was expected."""


class EnvironmentBroken(StatescopeError):
    """The environment or the engine is broken, so no verdict about the bug can be given."""


class EngineStartError(EnvironmentBroken):
    """vLLM raised while starting an engine or server; the message carries vLLM's first error,
    verbatim, and the engine arguments that were asked for."""


class CorruptionDetected(StatescopeError):
    """A bug was detected: the trigger arm produced corrupted state or output."""


class GeometryNotExercised(StatescopeError):
    """The run never reached the code path under test (no prefix-cache hits, no accepted drafts, ...)."""


class ControlBroken(StatescopeError):
    """The control arm failed too often, so it cannot serve as a baseline."""
