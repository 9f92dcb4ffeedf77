"""Turn what the device returned into data/results/gpu/e2e/ (no device time; run here).

    .venv/bin/python scripts/gpu_collect.py RETURNED_DIR [RETURNED_DIR ...] --manifest-extra FILE.json

Copies each returned folder through ``statescope.results.files.collect`` (records compacted, logs cut),
then writes ``verdicts.json`` (``gpu_results.verdict_table``: recomputed from the records with
``reproduce.label_rows``/``summarize_arm`` and ``stats.decide``), ``summary.json`` (trigger summary, guard
counters, kernel agreement, the build decision, overhead) and ``manifest.json`` (versions, GPU and
driver read from the jobs' environment parts, plus the commands and device seconds given in
``--manifest-extra``; ``statescope.share.envmanifest.device_manifest``). Run with the package importable
(the venv's ``statescope``, or ``PYTHONPATH=lib``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    from statescope.results import e2e
    from statescope.results import files
    from statescope.share.envmanifest import device_manifest

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("returned", nargs="*")
    p.add_argument("--manifest-extra", required=True)
    a = p.parse_args()
    dest = e2e.E2E_DIR
    for d in a.returned:
        print(d, files.collect(d, dest))
    (dest / "verdicts.json").write_text(json.dumps(e2e.verdict_table(), indent=1) + "\n")
    summary = {"trigger": e2e.trigger_summary(), "guards_from_vllm_counters": e2e.guard_table(),
               "kernel_agreement": e2e.kernel_table(), "decision": e2e.decision_summary(),
               "overhead": e2e.overhead_table(), "sweep": e2e.sweep_table()}
    if (dest.parent / "e2e_capture_off").is_dir():  # the trigger re-run with capture off
        summary["capture_on_off"] = e2e.capture_on_off(dest)
    (dest / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    env = [x["result"] for x in files.parts(dest) if x["part"] == "environment" and x["status"] == "ok"]
    if not env:
        raise SystemExit("no environment part in the returned files")
    manifest = device_manifest(env[-1])
    manifest.update(json.loads(Path(a.manifest_extra).read_text()))
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(e2e.verdict_table(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
