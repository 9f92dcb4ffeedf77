"""Notebooks: jupytext pairs in sync and stripped; each notebook executes headless and renders."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from statescope.share.render import NOTEBOOKS, run_notebook

PAIRS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def test_there_are_notebooks():
    assert PAIRS, "notebooks/ has no NN_name.py notebooks"


@pytest.mark.parametrize("py_path", PAIRS, ids=lambda p: p.stem)
def test_pair_in_sync_and_stripped(py_path: Path):
    import jupytext

    ipynb = py_path.with_suffix(".ipynb")
    assert ipynb.is_file(), f"{ipynb.name} missing: run `statescope workbook {py_path.stem}`"
    raw = json.loads(ipynb.read_text())
    assert not any(c.get("outputs") for c in raw["cells"] if c["cell_type"] == "code")
    src = [c.source for c in jupytext.read(py_path).cells]
    paired = [c.source for c in jupytext.read(ipynb).cells]
    assert src == paired, f"{ipynb.name} is out of sync with {py_path.name}"


@pytest.mark.parametrize("py_path", PAIRS, ids=lambda p: p.stem)
def test_code_cells_are_thin(py_path: Path):
    import jupytext

    for cell in jupytext.read(py_path).cells:
        if cell.cell_type == "code":
            lines = [l for l in cell.source.splitlines() if l.strip() and not l.startswith("#")]
            assert len(lines) <= 6, f"{py_path.name}: a code cell has {len(lines)} lines:\n{cell.source}"


# What each rendered notebook must show (beyond executing without an error).
NEEDLES = {
    "00_quickstart": ("resolved configuration", "prefix_cache_hits", "spec_accepted_tokens",
                      "Qwen3_5MTP", "CPUModelRunner"),
    "01_reproduce": ("prefix_cache_engaged", "PLANTED FAULT", "corruption detected"),
    "02_config_matrix": ("ASYNC SCHEDULING FORCED OFF", "failure rate"),
    "04_where_state_diverges": ("EMULATED", "H-copy"),
    "05_bisect_builds": ("SIMULATED", "fused_conv_copy_ordered", "H-accept predicted", "cannot tell"),
    "07_teach_failure_mode": ("PASS</b> · <b>prefill state equals", "PASS</b> · <b>PLANTED poisoned"),
    "06_hypotheses": ("EMULATED (PLANTED permute_accepted)", "H-lostcopy", "tolerance units"),
    "08_gpu_h200": ("control broken", "GPUModelRunner", "0.26.0 + overlap-safe", "same_tokens",
                    "capture_host_ms_per_step", "corruption detected", "differ_from_eager_no_async",
                    "host_ms_flusher", "fisher_p_one_sided", "accept_sync", "graph_vs_eager_identical"),
}


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("py_path", PAIRS, ids=lambda p: p.stem)
def test_notebook_executes_and_renders(tmp_path, py_path):
    result = run_notebook(py_path, tmp_path)
    assert result["ok"], result["error"]
    html = Path(result["html"]).read_text()
    for needle in NEEDLES.get(py_path.stem, ()):
        assert needle in html, f"{py_path.stem}: {needle!r} not in the rendered notebook"
    assert "Traceback (most recent call last)" not in html
    from statescope import quiet  # no stderr box for known-benign library warnings

    assert not [k for k, pattern in quiet.BENIGN.items() if __import__("re").search(pattern, html)]
