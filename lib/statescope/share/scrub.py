"""Scrubbing for sharing: what may leave this machine in a rendered report.

What it does:

* ``allowed_env(environ)`` captures environment variables by **allowlist**: only the prefixes and
  names that change how vLLM/CUDA/torch/OpenMP behave (``VLLM_*``, ``CUDA_*``, ``OMP_*`` ...), and
  never a name that looks like a credential or a proxy (``*TOKEN*``, ``*KEY*``, ``*PASS*``,
  ``*PROXY*`` ...), whatever its prefix. Values are scrubbed too.
* ``Scrubber.scrub(text)`` replaces the values of credential-named environment variables
  (``[redacted:NAME]``; markers use brackets so they survive HTML, Markdown and JSON alike), every
  token shape in ``SECRET_PATTERNS`` (API keys of the common services, PEM private keys, JWTs,
  credentials in URLs, ``password=...``-style assignments to credential-named fields), the
  repository path (``[repo]``), the home directory (``~``), the temporary folder (``[tmp]``, for a
  notebook's contents: its scratch runs live there), this machine's host names (``[host]``)
  and IP addresses other than loopback (``[ip]``, IPv4 and IPv6). It looks in the text as written
  and in what the text says once decoded (``statescope.share.decoded``: HTML entities, JSON and URL
  escapes, line-wrapped or reversed tokens, base64 runs), and replaces a secret found in a decoded
  view at its encoded place in the original.
* ``Scrubber.scrub_obj(obj)`` does the same to every string of a JSON-like structure, and redacts
  the value of any key named like a credential.
* ``SecretLeak`` is what the final check (``statescope.share.leakcheck``) raises.

What it deliberately does not do: read pixels, guess at secrets without a recognisable shape or a
credential-like name, or decide what a report contains.
"""
from __future__ import annotations

import ipaddress
import os
import re
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from statescope.errors import StatescopeError
from statescope.share import decoded

REPO = Path(__file__).resolve().parents[3]

# Field names that hold credentials: the strong words alone, the weak ones only as the last part
# of a longer name (``DB_PASS``, ``api.token``; not ``max_tokens``, ``bypass`` or a bare ``token``).
_STRONG = r"password|passwd|passphrase|secret|api[_-]?key|access[_-]?key|secret[_-]?key|private[_-]?key|credentials?"
_WEAK = r"token|pass|pwd|auth|cookie"
CREDENTIAL_FIELD = re.compile(rf"(?i)^(?:(?:[a-z0-9]+[_.-])*(?:{_STRONG})|(?:[a-z0-9]+[_.-])+(?:{_WEAK}))$")
# Values that are not a secret however their field is named.
_NOT_A_VALUE = r"(?!\[redacted|\[repo\]|None\b|null\b|true\b|false\b|undefined\b|\$|%\(|os\.|getenv|\*{3})"

# Token-shaped strings that must never reach a shared report. Each name appears in errors; a
# pattern with a group named ``s`` redacts only that group (the field name or scheme stays).
SECRET_PATTERNS: dict[str, re.Pattern] = {
    "huggingface token (hf_...)": re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    "API key (sk-...)": re.compile(r"\bsk-[A-Za-z0-9_\-]{20,}"),
    "Stripe key (sk_live_...)": re.compile(r"\b[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"),
    "bearer token": re.compile(r"\b[Bb]earer\s+(?P<s>(?!\[redacted)[A-Za-z0-9\-._~+/]{16,}=*)"),
    "AWS access key id (AKIA...)": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "GitHub token (ghp_/gho_/ghs_...)": re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}"),
    "GitHub fine-grained token": re.compile(r"\bgithub_pat_[A-Za-z0-9_]{40,}"),
    "GitLab token (glpat-...)": re.compile(r"\bglpat-[A-Za-z0-9_\-]{20,}"),
    "Slack token (xoxb-...)": re.compile(r"\bxox[abposre]-[A-Za-z0-9\-]{10,}"),
    "Google API key (AIza...)": re.compile(r"\bAIza[0-9A-Za-z_\-]{35}"),
    "npm token (npm_...)": re.compile(r"\bnpm_[A-Za-z0-9]{36}"),
    "JSON web token": re.compile(r"\beyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{4,}\.[A-Za-z0-9_\-]*"),
    "private key (PEM)": re.compile(
        r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----(?:[\s\S]*?-----END [A-Z0-9 ]*PRIVATE "
        r"KEY(?: BLOCK)?-----|[A-Za-z0-9+/=\s:,-]*)"),
    "credentials in a URL": re.compile(
        r"\b[a-zA-Z][a-zA-Z0-9+.\-]{1,15}://(?P<s>(?!\[redacted)[^\s/@:<>\"'\[\]]+:[^\s/@<>\"'\[\]]+)@"),
    "credential assignment": re.compile(
        rf"(?i)(?<![a-z0-9_.-])(?:(?:[a-z0-9]+[_.-])*(?:{_STRONG})|(?:[a-z0-9]+[_.-])+(?:{_WEAK}))"
        rf"(?![a-z0-9_])['\"]?[ \t]*[:=][ \t]*['\"]?(?P<s>{_NOT_A_VALUE}[^\s'\"<>\[\]{{}},;&]{{4,}})"),
}
# Literal text each pattern needs (checked before the pattern runs: a substring test is ~50x
# cheaper than a regex scan, and most text holds none of these); lower-cased where marked.
HINTS: dict[str, tuple[str, ...]] = {
    "huggingface token (hf_...)": ("hf_",), "API key (sk-...)": ("sk-",),
    "Stripe key (sk_live_...)": ("k_live_", "k_test_"), "bearer token": ("earer",),
    "AWS access key id (AKIA...)": ("AKIA", "ASIA"), "GitHub token (ghp_/gho_/ghs_...)": ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
    "GitHub fine-grained token": ("github_pat_",), "GitLab token (glpat-...)": ("glpat-",),
    "Slack token (xoxb-...)": ("xox",), "Google API key (AIza...)": ("AIza",),
    "npm token (npm_...)": ("npm_",), "JSON web token": ("eyJ",), "private key (PEM)": ("PRIVATE KEY",),
    "credentials in a URL": ("://",),
}
LOWER_HINTS = {"credential assignment": ("pass", "secret", "key", "credential", "token", "pwd",
                                         "auth", "cookie")}
# Environment variable names that look like credentials (or proxies, whose URLs carry them):
# never captured, and their values are redacted everywhere.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|_PASS$|PASSPHRASE|API_KEY|ACCESS_KEY|PRIVATE|CREDENTIAL"
                         r"|AUTH|COOKIE|PROXY|(?:^|_)KEY(?:$|_)", re.I)
# Settings that change how the engine behaves: the only environment a report carries.
ENV_PREFIXES = ("VLLM_", "CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "TORCHINDUCTOR_", "TRITON_",
                "OMP_", "MKL_", "KMP_", "CUBLAS_", "CUDNN_", "NVIDIA_", "STATESCOPE_", "HF_HUB_",
                "TRANSFORMERS_", "TOKENIZERS_")
ENV_NAMES = ("LD_PRELOAD", "PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "HF_HUB_OFFLINE")
IPV4 = re.compile(r"(?<![\d.])\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}(?![\d.])")
IPV6_CANDIDATE = re.compile(r"(?<![0-9A-Za-z:.])(?:[0-9a-fA-F]{1,4}|:)(?::[0-9a-fA-F]{0,4}){2,7}(?![0-9A-Za-z:])")
KEEP_IPS = ("127.0.0.1", "0.0.0.0")
MIN_SECRET_LEN = 8  # shorter credential-named values ("1", "true") are not worth hunting for
# A ``-p`` parameter named like a credential (``db_password``, ``token``, ``ssh_key``): its value is
# a secret wherever the notebook prints it. Shorter values than this cannot be hunted for without
# eating ordinary words: the render refuses them (``parameter_secrets``).
CREDENTIAL_PARAMETER = re.compile(rf"(?i)^(?:[a-z0-9]+[_.-])*(?:{_STRONG}|{_WEAK}|key)$")
MIN_PARAMETER_SECRET_LEN = 4
Span = tuple[int, int, str]  # (start, end, replacement)


class SecretLeak(StatescopeError):
    """A token-like secret survived scrubbing in a file that was about to be shared."""


def marker(pattern_name: str) -> str:
    return f"[redacted:{pattern_name.split(' (')[0]}]"


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


def parameter_secrets(parameters: Mapping[str, Any] | None) -> dict[str, str]:
    """``{name: value}`` of the credential-named parameters (``-p db_password=...``), whose values
    the scrubber then removes wherever they appear; a value too short to hunt for is an
    ``InputError`` (refused before anything runs, never a silent leak)."""
    from statescope.errors import InputError

    out = {}
    for name, value in (parameters or {}).items():
        if not CREDENTIAL_PARAMETER.match(str(name)) or value is None or isinstance(value, bool):
            continue
        text = value if isinstance(value, str) else str(value)
        if len(text) < MIN_PARAMETER_SECRET_LEN:
            raise InputError(f"-p {name}: a credential-named parameter's value must have at least "
                             f"{MIN_PARAMETER_SECRET_LEN} characters to be scrubbed from a render "
                             f"(got {len(text)}); pass the secret through an environment variable "
                             "named like a credential instead")
        out[str(name)] = text
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


def _keep_ip(ip: str) -> bool:
    octets = [int(x) for x in ip.split(".")]
    if any(o > 255 for o in octets):
        return True  # not an address (a version or a number that looks like one)
    return ip in KEEP_IPS or octets[0] == 127


def _is_ipv6(text: str) -> bool:
    """An address worth hiding: valid, not loopback/unspecified, and not a slice like ``1::2``."""
    try:
        addr = ipaddress.IPv6Address(text)
    except ValueError:
        return False
    groups = [g for g in text.split(":") if g]
    return not (addr.is_loopback or addr.is_unspecified) and len(groups) >= 3


def shape_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, pattern name) of every token shape in ``text``."""
    out = []
    lower = None
    for name, pattern in SECRET_PATTERNS.items():
        if name in HINTS and not any(h in text for h in HINTS[name]):
            continue
        if name in LOWER_HINTS:
            lower = text.lower() if lower is None else lower
            if not any(h in lower for h in LOWER_HINTS[name]):
                continue
        for m in pattern.finditer(text):
            start, end = m.span("s") if "s" in pattern.groupindex else m.span()
            out.append((start, end, name))
    return out


def _piece_spans(pieces: list[tuple[int, int]], replacement: str) -> list[Span]:
    """The first piece of a split secret gets the marker, the others are emptied."""
    return [(a, b, replacement if i == 0 else "") for i, (a, b) in enumerate(pieces)]


def apply_spans(text: str, spans: Iterable[Span]) -> str:
    """Replace ``spans`` (overlaps merged; the longest span at a start gives the replacement)."""
    merged: list[list] = []
    for start, end, repl in sorted(spans, key=lambda s: (s[0], -s[1])):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
            continue
        merged.append([start, end, repl])
    for start, end, repl in reversed(merged):
        text = text[:start] + repl + text[end:]
    return text


@dataclass
class Scrubber:
    """Replaces secrets, paths, host names and IPs in text. Build with ``for_environment``."""

    secret_values: dict[str, str] = field(default_factory=dict)  # value -> env var name
    paths: list[tuple[str, str]] = field(default_factory=list)  # (path, replacement), longest first
    hosts: list[str] = field(default_factory=list)

    @classmethod
    def for_environment(cls, environ: Mapping[str, str] | None = None,
                        extra_paths: Iterable[tuple[str, str]] = (),
                        scratch: bool = False,
                        secrets: Mapping[str, str] | None = None) -> "Scrubber":
        """``scratch``: also the temporary folder (what a notebook shows of its scratch runs);
        off for results whose paths a caller opens (where the render was written). ``secrets``:
        ``{name: value}`` known to be secret whatever their length (``parameter_secrets``)."""
        environ = os.environ if environ is None else environ
        secrets_by_value = {v: k for k, v in environ.items()
                            if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_LEN}
        secrets_by_value.update({v: k for k, v in (secrets or {}).items() if v})
        paths = [(str(REPO), "[repo]"), (str(REPO.resolve()), "[repo]")]
        home = environ.get("HOME") or str(Path.home())
        if home and home not in ("/", ""):
            paths.append((home.rstrip("/"), "~"))
        tmp = tempfile.gettempdir().rstrip("/")
        if scratch and tmp:  # notebooks' scratch runs (tempfile.mkdtemp): random machine-local names
            paths.append((tmp + "/", "[tmp]/"))
        paths += list(extra_paths)
        paths = sorted(set(paths), key=lambda p: len(p[0]), reverse=True)
        return cls(secrets_by_value, paths, _host_names())

    @property
    def host_pattern(self) -> re.Pattern | None:
        if not self.hosts:
            return None
        alts = "|".join(re.escape(h) for h in self.hosts)
        return re.compile(rf"(?<![\w.-])(?:{alts})(?![\w-])")

    def value_spans(self, text: str) -> list[Span]:
        """Known secret values and token shapes."""
        out = []
        for value, name in self.secret_values.items():
            start = text.find(value)
            while start >= 0:
                out.append((start, start + len(value), f"[redacted:{name}]"))
                start = text.find(value, start + len(value))
        out += [(s, e, marker(name)) for s, e, name in shape_spans(text)]
        return out

    def identity_spans(self, text: str) -> list[Span]:
        """The repository and home paths, host names, IP addresses."""
        out = []
        for path, repl in self.paths:
            start = text.find(path)
            while start >= 0:
                out.append((start, start + len(path), repl))
                start = text.find(path, start + len(path))
        hosts = self.host_pattern
        if hosts is not None:
            out += [(m.start(), m.end(), "[host]") for m in hosts.finditer(text)]
        out += [(m.start(), m.end(), "[ip]") for m in IPV4.finditer(text) if not _keep_ip(m.group(0))]
        out += [(m.start(), m.end(), "[ip]") for m in IPV6_CANDIDATE.finditer(text)
                if _is_ipv6(m.group(0))]
        return out

    def spans(self, text: str) -> list[Span]:
        return self.value_spans(text) + self.identity_spans(text)

    def scrub(self, text: str) -> str:
        if not isinstance(text, str) or not text:
            return text
        text = apply_spans(text, self.spans(text))
        levels = decoded.unescaped_levels(text)
        if levels:  # escaped: find in the decoded text, replace the escaped original
            found = self.spans(levels[-1].text)
            text = apply_spans(text, [(*decoded.to_source(levels, s, e), r) for s, e, r in found])
        text = apply_spans(text, self.split_spans(text))
        n, backwards = len(text), text[::-1]
        text = apply_spans(text, [(n - e, n - s, r) for s, e, r in self.value_spans(backwards)])
        runs = [(span, r) for span, data in decoded.base64_runs(text)
                if (r := self._hidden_in(data)) is not None]
        return apply_spans(text, [(s, e, r) for (s, e), r in runs])

    def split_spans(self, text: str) -> list[Span]:
        """Secrets split by a line wrap, a tag, an ANSI colour code (also once unescaped): the
        token's own pieces get the marker, the markup between them stays (no unbalanced HTML)."""
        out: list[Span] = []
        view = decoded.joined(text)
        if view.changed:
            for s, e, r in self.value_spans(view.text):
                out += _piece_spans(view.source_pieces(s, e), r)
        levels = decoded.unescaped_levels(text)
        if levels:  # split and escaped (``hf\\_ab<span>cd``): joined in the decoded text
            inner = decoded.joined(levels[-1].text)
            if inner.changed:
                for s, e, r in self.value_spans(inner.text):
                    pieces = [decoded.to_source(levels, a, b) for a, b in inner.source_pieces(s, e)]
                    out += _piece_spans(pieces, r)
        return out

    def _hidden_in(self, data: bytes) -> str | None:
        """The replacement for a base64 run whose decoded bytes carry a secret, else None."""
        texts = [data.decode("utf-8", "replace")] + decoded.png_texts(data)
        for t in texts:
            found = self.value_spans(t)
            if found:
                return f"[redacted:base64 holding {found[0][2].strip('[]').split(':', 1)[-1]}]"
        return None

    def _numbers(self, obj: Any) -> Any:
        """A typed array or list of numbers, zeroed when its bytes or its values read as
        character codes spell a secret (plotly would draw the token's bytes as bar heights)."""
        for text in decoded.number_texts(dict(obj) if isinstance(obj, Mapping) else list(obj)):
            if self.value_spans(text) or self.split_spans(text):
                return _zeroed(obj)
        return dict(obj) if isinstance(obj, Mapping) else list(obj)

    def scrub_obj(self, obj: Any) -> Any:
        """``scrub`` applied to every string inside a JSON-like structure; the value of a key named
        like a credential is redacted whatever it looks like; plotly's typed arrays and lists of
        numbers are zeroed when they spell a secret (``_numbers``)."""
        if isinstance(obj, str):
            return self.scrub(obj)
        if decoded.is_typed_array(obj) or (isinstance(obj, (list, tuple)) and obj
                                           and not any(isinstance(v, (str, Mapping, list)) for v in obj)):
            return self._numbers(obj)
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                key = self.scrub(str(k))
                secret = CREDENTIAL_FIELD.match(str(k)) and isinstance(v, str) and len(v) >= 4
                out[key] = f"[redacted:{key}]" if secret else self.scrub_obj(v)
            return out
        if isinstance(obj, (list, tuple)):
            return [self.scrub_obj(v) for v in obj]
        return obj


def _zeroed(obj: Any) -> Any:
    """The same array with every value 0 (a figure keeps its shape, not the secret)."""
    if isinstance(obj, Mapping):
        import base64

        n = len(base64.b64decode(obj["bdata"], validate=False))
        return {**obj, "bdata": base64.b64encode(bytes(n)).decode()}
    return [0] * len(obj)


def find_secrets(text: str, known_values: Iterable[str] = ()) -> list[str]:
    """Names of the secret patterns (or env var values) present in ``text`` as written."""
    hits = [name for _s, _e, name in shape_spans(text)]
    hits += ["value of a credential-named environment variable" for v in known_values
             if len(v) >= MIN_SECRET_LEN and v in text]
    return sorted(set(hits))
