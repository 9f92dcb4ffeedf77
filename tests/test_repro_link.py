"""``statescope render ... --repro DIR`` (``statescope.share.repro_link``): the exported plain-vLLM
script goes beside the render and ``summary.md`` links it under the verdict table; a folder that
is not an export-repro folder is refused before any notebook executes. Uses the committed H200
reproducer (3 requests) as the folder; no notebook is executed here."""
from pathlib import Path

import pytest

from statescope.cli.main import main
from statescope.errors import InputError
from statescope.share.repro_link import MAX_BYTES, attach_repro, check_repro_dir

REPRO = Path(__file__).resolve().parents[1] / "data/results/gpu/minimal_reproducer_0.26.0/at_two_seqs/repro"


def test_the_summary_links_the_script_under_the_verdicts(tmp_path):
    (tmp_path / "summary.md").write_text(
        "### statescope: `nb`\n\n| what | verdict | detail |\n|---|---|---|\n| x | PASS | y |\n\n"
        "Full render: `nb.html`\n\n<details><summary>Cell output log</summary>\n\n```text\nlog\n"
        "```\n\n</details>\n")
    got = attach_repro({"dir": str(tmp_path), "notebook": "nb"}, REPRO)
    body = (tmp_path / "summary.md").read_text()
    assert body.index("Minimal reproducer") < body.index("Full render:")
    assert "[`repro/repro.py`](repro/repro.py)" in body and "max_num_seqs=2" in body
    assert "vLLM 0.26.0 on cuda" in body and got["summary_chars"] == len(body)
    # the committed script carries no machine path: the scrubbed copy is the script itself
    assert (tmp_path / "repro" / "repro.py").read_text() == (REPRO / "repro.py").read_text()


def test_a_folder_without_the_script_or_too_large_is_refused(tmp_path):
    with pytest.raises(InputError, match="no repro.py"):
        check_repro_dir(tmp_path)
    (tmp_path / "repro.py").write_text("x" * (MAX_BYTES["repro.py"] + 1))
    (tmp_path / "README.md").write_text("r")
    with pytest.raises(InputError, match="more than"):
        check_repro_dir(tmp_path)


def test_the_command_refuses_a_bad_folder_before_executing(tmp_path, capsys):
    assert main(["render", "00_quickstart", "--repro", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "export-repro" in capsys.readouterr().err
    assert not (tmp_path / "00_quickstart").exists()
