"""Scrubbing for sharing: what may leave this machine in a rendered report, and a last check.

What it does:

* ``allowed_env(environ)`` captures environment variables by **allowlist**: only the prefixes and
  names that change how vLLM/CUDA/torch/OpenMP behave (``VLLM_*``, ``CUDA_*``, ``OMP_*`` ...), and
  never a name that looks like a credential (``*TOKEN*``, ``*KEY*``, ``*SECRET*`` ...), whatever
  its prefix. Values are scrubbed too.
* ``Scrubber.scrub(text)`` replaces the values of credential-named environment variables (``[redacted:NAME]``;
  markers use brackets so they survive HTML, Markdown and JSON alike), any
  token-shaped string (``SECRET_PATTERNS``), the repository path (``[repo]``), the home directory
  (``~``), this machine's host names (``[host]``) and IPv4 addresses other than loopback
  (``[ip]``).
* ``find_secrets(text)`` / ``check_file`` / ``check_tree`` look for anything token-shaped that
  survived; ``check_tree`` raises ``SecretLeak`` naming the file and the pattern (never the value).

What it deliberately does not do: scrub binary images (PNG pixels are not searched, only their
bytes as text), guess at secrets without a recognisable shape, or decide what a report contains.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from statescope.errors import StatescopeError

REPO = Path(__file__).resolve().parents[3]

# Token-shaped strings that must never reach a shared report. Each name appears in errors.
SECRET_PATTERNS: dict[str, re.Pattern] = {
    "huggingface token (hf_...)": re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    "API key (sk-...)": re.compile(r"\bsk-[A-Za-z0-9_\-]{20,}"),
    "bearer token": re.compile(r"\b[Bb]earer\s+[A-Za-z0-9\-._~+/]{16,}=*"),
    "AWS access key id (AKIA...)": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "GitHub token (ghp_/gho_/ghs_...)": re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}"),
    "GitHub fine-grained token": re.compile(r"\bgithub_pat_[A-Za-z0-9_]{40,}"),
    "credential assignment": re.compile(
        r"\b(?:HF_TOKEN|HUGGING_FACE_HUB_TOKEN|HUGGINGFACE_TOKEN|OPENAI_API_KEY|VLLM_API_KEY|"
        r"AWS_SECRET_ACCESS_KEY|GITHUB_TOKEN|GH_TOKEN)['\"]?\s*[=:]\s*['\"]?(?!\[redacted)[^\s'\"<\[]{8,}"),
}
# Names that look like credentials: never captured, and their values are redacted everywhere.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_KEY|ACCESS_KEY|PRIVATE|CREDENTIAL|AUTH|COOKIE"
                         r"|(?:^|_)KEY(?:$|_)", re.I)
# Settings that change how the engine behaves: the only environment a report carries.
ENV_PREFIXES = ("VLLM_", "CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "TORCHINDUCTOR_", "TRITON_",
                "OMP_", "MKL_", "KMP_", "CUBLAS_", "CUDNN_", "NVIDIA_", "STATESCOPE_", "HF_HUB_",
                "TRANSFORMERS_", "TOKENIZERS_")
ENV_NAMES = ("LD_PRELOAD", "PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "HF_HUB_OFFLINE")
IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
KEEP_IPS = ("127.0.0.1", "0.0.0.0")
MIN_SECRET_LEN = 8  # shorter credential-named values ("1", "true") are not worth hunting for


class SecretLeak(StatescopeError):
    """A token-like secret survived scrubbing in a file that was about to be shared."""


def allowed_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The engine-relevant environment variables (allowlist), credential-named ones excluded."""
    environ = os.environ if environ is None else environ
    scrub = Scrubber.for_environment(environ)
    out = {}
    for name in sorted(environ):
        if SECRET_NAME.search(name):
            continue
        if name.startswith(ENV_PREFIXES) or name in ENV_NAMES:
            out[name] = scrub.scrub(environ[name])
    return out


def _host_names() -> list[str]:
    names = set()
    for fn in (socket.gethostname, socket.getfqdn):
        try:
            names.add(fn())
        except OSError:
            pass
    # Two-letter names ("vm") identify nothing and would eat ordinary words.
    return sorted((n for n in names if len(n) >= 3 and n not in ("localhost", "localhost.localdomain")),
                  key=len, reverse=True)


@dataclass
class Scrubber:
    """Replaces secrets, paths, host names and IPs in text. Build with ``for_environment``."""

    secret_values: dict[str, str] = field(default_factory=dict)  # value -> env var name
    paths: list[tuple[str, str]] = field(default_factory=list)  # (path, replacement), longest first
    hosts: list[str] = field(default_factory=list)

    @classmethod
    def for_environment(cls, environ: Mapping[str, str] | None = None,
                        extra_paths: Iterable[tuple[str, str]] = ()) -> "Scrubber":
        environ = os.environ if environ is None else environ
        secrets = {v: k for k, v in environ.items()
                   if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_LEN}
        paths = [(str(REPO), "[repo]"), (str(REPO.resolve()), "[repo]")]
        home = environ.get("HOME") or str(Path.home())
        if home and home not in ("/", ""):
            paths.append((home.rstrip("/"), "~"))
        paths += list(extra_paths)
        paths = sorted(set(paths), key=lambda p: len(p[0]), reverse=True)
        return cls(secrets, paths, _host_names())

    def scrub(self, text: str) -> str:
        # Known secret values first (longest first, so one value inside another cannot half-survive).
        for value in sorted(self.secret_values, key=len, reverse=True):
            text = text.replace(value, f"[redacted:{self.secret_values[value]}]")
        for name, pattern in SECRET_PATTERNS.items():
            text = pattern.sub(f"[redacted:{name.split(' (')[0]}]", text)
        for path, repl in self.paths:
            text = text.replace(path, repl)
        for host in self.hosts:
            text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", "[host]", text)
        return IPV4.sub(lambda m: m.group(0) if _keep_ip(m.group(0)) else "[ip]", text)

    def scrub_obj(self, obj):
        """``scrub`` applied to every string inside a JSON-like structure."""
        if isinstance(obj, str):
            return self.scrub(obj)
        if isinstance(obj, Mapping):
            return {self.scrub(str(k)): self.scrub_obj(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.scrub_obj(v) for v in obj]
        return obj


def _keep_ip(ip: str) -> bool:
    octets = [int(x) for x in ip.split(".")]
    if any(o > 255 for o in octets):
        return True  # not an address (a version or a number that looks like one)
    return ip in KEEP_IPS or octets[0] == 127


def find_secrets(text: str, known_values: Iterable[str] = ()) -> list[str]:
    """Names of the secret patterns (or env var values) present in ``text``; empty when clean."""
    hits = [name for name, pattern in SECRET_PATTERNS.items() if pattern.search(text)]
    hits += ["value of a credential-named environment variable" for v in known_values
             if len(v) >= MIN_SECRET_LEN and v in text]
    return hits


def check_file(path: str | Path, known_values: Iterable[str] = ()) -> None:
    """Raise ``SecretLeak`` naming ``path`` and the pattern when a secret is in the file."""
    path = Path(path)
    text = path.read_bytes().decode("utf-8", errors="ignore")
    hits = find_secrets(text, known_values)
    if hits:
        raise SecretLeak(f"{path}: a secret survived scrubbing ({', '.join(sorted(set(hits)))}); "
                         f"the render was stopped, nothing from it may be shared")


def check_tree(root: str | Path, environ: Mapping[str, str] | None = None) -> int:
    """``check_file`` on every file under ``root``; returns the number of files checked."""
    environ = os.environ if environ is None else environ
    known = [v for k, v in environ.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_LEN]
    n = 0
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            check_file(path, known)
            n += 1
    return n
