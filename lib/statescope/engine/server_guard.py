"""Watchdog wrapper that keeps a launched server from outliving the process that launched it.

Usage: ``python -m statescope.engine.server_guard PARENT_PID [--grace S] [--orphan-log PATH]
-- CMD ...``. The guard is meant to
be started as the leader of a fresh process group (``start_new_session=True``); it runs CMD as a
child in that same group and then watches three things:

- the parent: when PARENT_PID is gone (the guard gets re-parented), it tears the whole group down;
- its own SIGTERM/SIGINT (the launcher's normal shutdown): same teardown;
- the child: when CMD exits on its own, whatever CMD left behind in the group is removed and the
  guard exits with CMD's status.

Teardown = SIGTERM to CMD alone first, so a server that shuts its own children down (vLLM's API
server stops its engine core, which stops its workers) can do so in its own order; once CMD is gone,
or ``FIRST_RESERVE_S`` before the ``--grace`` seconds run out, SIGTERM to every other member of the
group; at the end of the grace SIGKILL whatever is left. SIGTERM-ing the whole group at one
instant made vLLM's API server SIGKILL its engine core and the worker at once (its shutdown
timeout of 0), cutting a capture's close short in the worker. ``--orphan-log PATH``: a log in the temp folder that only the launcher would
have read; when the launcher is gone, the guard removes it after the teardown (nobody is left to
read it, and logs of killed drivers must not pile up in the temp folder). The child also gets ``PR_SET_PDEATHSIG(SIGTERM)`` so it is told to stop even if
the guard itself is SIGKILLed.

What it deliberately does not do: restart anything, read the server's output, or touch processes
outside its own process group (members are found by process-group id in /proc, never by name).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.2
FIRST_RESERVE_S = 2.0  # of the grace, left to the rest of the group after CMD's own shutdown
PR_SET_PDEATHSIG = 1


def group_members(pgid: int, *, exclude: int | None = None) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``, read from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        # Field 2 (comm) may contain spaces and parentheses: split after its closing ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        state, process_group = fields[0], int(fields[2])
        pid = int(entry.name)
        if process_group == pgid and state not in ("Z", "X") and pid != exclude:
            pids.append(pid)
    return pids


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def teardown_group(pgid: int, grace_s: float, *, exclude: int | None = None,
                   first: int | None = None) -> None:
    """SIGTERM ``first`` (when given and still a member) and wait for it to end, then SIGTERM
    every other member of the group (but ``exclude``), and SIGKILL what is left ``grace_s`` after
    the start. The whole group always goes: ``first`` only orders the SIGTERMs."""
    deadline = time.monotonic() + grace_s
    if first is not None and first in group_members(pgid, exclude=exclude):
        _signal_all([first], signal.SIGTERM)
        # the rest of the group keeps a share of the grace for its own SIGTERM handlers
        first_deadline = deadline - min(FIRST_RESERVE_S, grace_s / 4)
        while time.monotonic() < first_deadline and first in group_members(pgid, exclude=exclude):
            time.sleep(POLL_S)
    _signal_all(group_members(pgid, exclude=exclude), signal.SIGTERM)
    while time.monotonic() < deadline:
        if not group_members(pgid, exclude=exclude):
            return
        time.sleep(POLL_S)
    for _ in range(3):  # another pass catches anything forked while the previous one ran
        left = group_members(pgid, exclude=exclude)
        if not left:
            return
        _signal_all(left, signal.SIGKILL)
        time.sleep(POLL_S)


def _ask_for_sigterm_on_parent_death() -> None:
    # Runs in the child between fork and exec. The guard is single-threaded, so the "parent
    # thread" PR_SET_PDEATHSIG watches is the guard's only thread: the signal means the guard died.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the guard's own watch still applies
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m statescope.engine.server_guard",
                                     usage="%(prog)s PARENT_PID [--grace S] -- CMD ...")
    parser.add_argument("parent_pid", type=int)
    parser.add_argument("--grace", type=float, default=15.0)
    parser.add_argument("--orphan-log", default=None)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("expected a command after '--'")
    split = argv.index("--")
    args, cmd = parser.parse_args(argv[:split]), argv[split + 1:]

    stop: dict[str, int | None] = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    me, pgid = os.getpid(), os.getpgrp()
    child = subprocess.Popen(cmd, preexec_fn=_ask_for_sigterm_on_parent_death)
    while True:
        code = child.poll()
        if code is not None:  # the server ended by itself: clear out what it left behind
            teardown_group(pgid, min(args.grace, 5.0), exclude=me)
            return code
        # Polling instead of PR_SET_PDEATHSIG on the guard: that signal fires when the launching
        # *thread* ends, which would kill servers started from a short-lived worker thread.
        parent_gone = os.getppid() != args.parent_pid or not _alive(args.parent_pid)
        if parent_gone or stop["signal"] is not None:
            teardown_group(pgid, args.grace, exclude=me, first=child.pid)
            child.poll()  # reap it so it does not linger as a zombie
            if parent_gone and args.orphan_log:
                Path(args.orphan_log).unlink(missing_ok=True)
            return 0 if stop["signal"] is not None else 1
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
