"""Progress on stderr and the benign-warning filter: bars, ETA, lines off a terminal, what is dropped
and what never is (terminal, child processes, rendered notebooks), ``--verbose``."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import pytest

from statescope import quiet
from statescope.progress import NullProgress, Progress

NUMA = ("[W1201 09:56:35.952109098 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for "
        "memory allocation on the NUMA nodes (0). Memory allocations will be strictly bound to "
        "these NUMA nodes. (function init_cpu_memory_env)")
TRANSPORT = ("[IPKernelApp] WARNING | Kernel is running over TCP without encryption. All "
             "communication (including code and outputs) is sent in plain text and is susceptible "
             "to eavesdropping. Use IPC transport or launch with kernel manager-provisioned "
             "CurveZMQ keys to enable transport encryption.")
NANOBIND = ("nanobind: leaked 4 instances!\n - leaked instance 0x7f of type \"triton.ir.attribute\"\n"
            " - leaked type \"ATOMIC_OP\"\n - ... skipped remainder\n"
            "nanobind: this is likely caused by a reference counting issue in the binding code.\n"
            "See https://nanobind.readthedocs.io/en/latest/refleaks.html\n")
REAL = "ValueError: something the user must see"


def test_piped_progress_prints_a_line_per_tenth_and_a_final_one():
    out = io.StringIO()
    bar = Progress(40, "reproduce", stream=out, tty=False)
    for _ in range(40):
        bar.advance()
    bar.close()
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 12  # 0%, 10%, ..., 100%: not one line per request
    assert lines[-1].startswith("reproduce: [########################]  40/40 requests  100%")
    assert "ETA" not in lines[-1]


def test_terminal_progress_redraws_in_place_with_an_eta():
    out = io.StringIO()
    bar = Progress(10, "x", stream=out, tty=True)
    bar.start_from(2)  # a resumed run: 2 done before, not used for the rate
    bar.advance(1)     # starts the rate's clock
    bar.advance(2)
    bar._draw(force=True)
    text = out.getvalue()
    assert "\n" not in text and text.count("\r\x1b[2K") >= 2
    assert "5/10 requests" in text and "ETA ~" in text
    bar.note("control arm: starting the engine")
    assert "x: control arm: starting the engine\n" in out.getvalue()
    bar.close()
    assert out.getvalue().endswith("\n")


def test_eta_leaves_out_the_engine_start_between_arms(monkeypatch):
    import statescope.progress as progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    bar = Progress(20, stream=io.StringIO(), tty=False)
    now[0] = 60.0      # the first engine took a minute to start
    bar.advance()      # clock starts: this request's own time is not known
    for _ in range(9):
        now[0] += 1.0
        bar.advance()  # one request a second
    assert bar.eta_s() == pytest.approx(9 / 9 * 10)  # 9 clocked requests in 9 s, 10 left
    bar.note("trigger arm: starting the engine")
    now[0] += 100.0    # the second engine: not work
    bar.advance()
    assert bar.eta_s() == pytest.approx(9 / 10 * 9)  # the 100 s start is not in the rate


def test_null_progress_does_nothing():
    with NullProgress() as p:
        p.advance(3)
        p.note("x")
        p.start_from(9)


@pytest.mark.parametrize("line", [NUMA, TRANSPORT,
                                  "WARNING 12-01 09:30:48 [cpu_worker.py:153] CPU backend doesn't "
                                  "allow to use `torch.set_num_threads` after the thread binding, skip it.",
                                  "Loading safetensors checkpoint shards: 100% Completed | 1/1"])
def test_known_benign_lines_are_recognised(line):
    assert quiet.is_benign(line)


def test_drop_benign_keeps_everything_else():
    text = f"{NUMA}\nresult: 3 of 16 failed\n{TRANSPORT}\n{NANOBIND}{REAL}\n"
    assert quiet.drop_benign(text) == f"result: 3 of 16 failed\n{REAL}\n"
    assert not quiet.is_benign(REAL) and not quiet.is_benign("WARNING something new")


def test_clean_notebook_removes_benign_stderr_boxes():
    nb = {"cells": [{"cell_type": "code", "outputs": [
        {"output_type": "stream", "name": "stderr", "text": NUMA + "\n"},
        {"output_type": "stream", "name": "stderr", "text": [NUMA + "\n", REAL + "\n"]},
        {"output_type": "stream", "name": "stdout", "text": "kept\n"},
        {"output_type": "display_data", "data": {"text/plain": NUMA}}]}]}
    assert quiet.clean_notebook(nb) == 2
    outs = nb["cells"][0]["outputs"]
    assert [o.get("name") for o in outs] == ["stderr", "stdout", None]
    assert outs[0]["text"] == REAL + "\n"


CHILD = textwrap.dedent(f"""
    import atexit, os, subprocess, sys
    from statescope.quiet import filtered_stderr
    # runs after the filter's own exit handler, as the interpreter's teardown (nanobind) does
    atexit.register(lambda: os.write(2, {NANOBIND!r}.encode()))
    with filtered_stderr():
        os.write(2, {NUMA!r}.encode() + b"\\n")          # C++-style, straight to fd 2
        print({REAL!r}, file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-c",           # a child inheriting fd 2 (a kernel)
                        "import sys; print({TRANSPORT!r}, file=sys.stderr); print('child ok', file=sys.stderr)"])
    print("after the filter", file=sys.stderr, flush=True)
    print("stdout untouched")
""")


def test_filtered_stderr_drops_benign_lines_of_the_process_and_its_children():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "stdout untouched\n"
    assert r.stderr.splitlines() == [REAL, "child ok", "after the filter"]


def test_cli_json_stays_clean_and_verbose_is_accepted(tmp_path):
    cmd = [sys.executable, "-m", "statescope.cli.main", "workload", "--preset", "smoke", "--out",
           str(tmp_path / "t.jsonl"), "--json"]
    quiet_run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    loud = subprocess.run(cmd + ["--verbose"], capture_output=True, text=True, timeout=120)
    for r in (quiet_run, loud):
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["requests"] == 16


BENIGN_NOTEBOOK = f'''# %%
import os, sys
numa = {NUMA.replace("NUMA binding", "NUMA" + "@")!r}.replace("@", " binding")  # not in the source
print(numa, file=sys.stderr)   # a stderr stream output, as the kernel forwards PyTorch's
print({REAL!r}, file=sys.stderr)
print("result line")

# %%
import time
time.sleep(1.0)  # the kernel forwards file-descriptor output from a thread
'''


@pytest.mark.parametrize("keep", [False, True])
def test_rendered_notebooks_carry_no_stderr_box_for_benign_warnings(tmp_path, keep):
    from statescope.share.render import run_notebook

    src = tmp_path / "benign.py"
    src.write_text(BENIGN_NOTEBOOK)
    lines = io.StringIO()
    result = run_notebook(src, tmp_path / "out", progress=Progress(2, "benign", "cells",
                                                                    stream=lines, tty=True),
                          keep_warnings=keep)
    assert result["ok"], result["error"]
    html = (tmp_path / "out" / "benign.html").read_text()
    assert "result line" in html and "something the user must see" in html
    assert ("NUMA binding" in html) is keep  # --verbose keeps it
    assert "2/2 cells" in lines.getvalue()  # the cell bar advanced


KERNEL_NOTEBOOK = f'''# %%
import os, subprocess, sys
from statescope import quiet
from statescope.progress import NotebookProgress
assert quiet.in_notebook()
numa = {NUMA.replace("NUMA binding", "NUMA" + "@")!r}.replace("@", " binding")  # not in the source

# %%
os.write(2, (numa + "\\\\n").encode())  # C++-style, straight to the kernel's fd 2
subprocess.run([sys.executable, "-c", f"import sys; print({{numa!r}}, file=sys.stderr)"])  # a child
print(numa, file=sys.stderr)
print({REAL!r}, file=sys.stderr, flush=True)
bar = NotebookProgress(4, "work")
bar.note("starting")
for _ in range(4):
    bar.advance()
bar.close()

# %%
import time
time.sleep(1.0)  # the kernel forwards file-descriptor output from a thread
'''


def test_in_notebook_filters_the_live_kernel_and_notebook_progress_draws_html(tmp_path):
    """A real kernel (nbclient), outputs not cleaned afterwards (keep_warnings): what the live
    notebook shows. Benign lines of the kernel, its fd 2 and a child are gone; a real one is kept;
    the progress bar is one HTML output in its final state, nothing on stderr."""
    import nbformat

    from statescope.share.render import run_notebook

    src = tmp_path / "kernel.py"
    src.write_text(KERNEL_NOTEBOOK)
    result = run_notebook(src, tmp_path / "out", keep_warnings=True)
    assert result["ok"], result["error"]
    html = (tmp_path / "out" / "kernel.html").read_text()
    assert "NUMA binding" not in html
    assert "something the user must see" in html
    assert "work: [########################]  4/4 requests  100%" in html
    assert "starting" in html and "<progress" in html
    assert quiet.in_notebook() is False  # not in a kernel here
