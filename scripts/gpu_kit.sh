#!/usr/bin/env bash
# gpu_kit.sh: transfer glue for the lent H200. Packs torch 2.13 / 2.14, several vLLM releases and the
# statescope CLI/notebook tools into chunks of at most CHUNK_BYTES, one chunk per device call, and
# writes the installers that run there. Nothing here uses device time.
#
# Why chunks: the device machine starts bare at each lease and can reach no registry. One call carries
# the working tree plus its `carry` paths, 64 MiB (67,108,864 bytes) at most, and /tmp is reclaimed
# 30 s after a call ends. So one lease makes back-to-back calls, each copying ONE chunk into /tmp/gk,
# and the last call runs install_all.sh.
#
#   gpu_kit.sh release VERSION PINS [CHUNK_BYTES]   vLLM VERSION + pinned wheels -> .gk-vVERSION-NN
#                                                   installs into /tmp/vllm-VERSION (+ env.sh)
#   gpu_kit.sh torch213 [CHUNK_BYTES]               torch 2.13.0 + NCCL 2.29.7 -> .gk-torch213-NN
#                                                   installs into /tmp/torch213 (vLLM 0.27.x-0.32.0)
#   gpu_kit.sh torch214 [CHUNK_BYTES]               torch 2.14.0 + NCCL 2.30.7 + triton 3.8.0
#                                                   -> .gk-torch214-NN, into /tmp/torch214 (vLLM 0.33.0)
#   gpu_kit.sh tools [CHUNK_BYTES]                  what `statescope` and `statescope render` need
#                                                   beyond the image -> .gk-tools-NN, into /tmp/sstools
#   gpu_kit.sh plan [NAME ...]                      transfer order, sizes, the exact per-call commands
#                                                   (payloads' last chunks packed together); (re)writes
#                                                   install_all.sh into the final call's chunk. NAME:
#                                                   torch213, torch214, vVERSION, tools (default: all built)
#   gpu_kit.sh resolve VERSION [OUT]                candidate pin list for a release (see gpu_pins/)
#   gpu_kit.sh pytest [VENV]                        pure-Python pytest (+ pluggy, iniconfig, packaging,
#                                                   pygments) copied from VENV (default .venv) into
#                                                   .gk-pytest/site, carried as is (gpu_cli.sh
#                                                   cuda_checks appends it to PYTHONPATH)
#   gpu_kit.sh check VERSION|tools                  local test: pip --no-index --no-deps --target of
#                                                   every shipped wheel in a Python 3.12 venv, then
#                                                   every shipped dist's Requires-Dist is looked up
#
# CHUNK_BYTES defaults to 52000000: with a working tree of ~12 MB a call stays under 64 MiB (plan
# checks chunk + 15 MB < 67,108,864). Chunk folders are git-ignored through .git/info/exclude.
# Environment: GK_CACHE (download cache, default ~/.cache/statescope-gpu-kit), GK_VENV312 (the
# Python 3.12 venv `check` and the resolver use, default /work/gpukit/venv312), GK_XZ_LEVEL (xz
# preset, default -0), GK_KEEP=1 (keep the scratch dir), GK_ROOT (project root).
# Heavy steps (xz) run under nice -n 10: the machine's 2 cores are shared.
#
# On the device, for each call in `plan` order, back to back, a call carrying its chunk folder(s) runs
#     mkdir -p /tmp/gk && cp .gk-NAME-NN/* [.gk-OTHER-NN/*] /tmp/gk/
# and the final call appends `&& bash /tmp/gk/install_all.sh`. Afterwards, in any
# later call of the same lease:  . /tmp/vllm-0.32.0/env.sh   (or another release's env.sh)
set -euo pipefail

ROOT=${GK_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}   # the project root
PINS_DIR="$ROOT/scripts/gpu_pins"
CACHE=${GK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/statescope-gpu-kit}
VENV312=${GK_VENV312:-/work/gpukit/venv312}
DEFAULT_CHUNK=52000000
LIMIT=67108864          # one device call: tree + carried paths
TREE_ALLOWANCE=15000000 # what plan assumes travels of the stripped working tree
PY=${GK_PYTHON:-python3}
# Resolving (pip install --dry-run) needs a Python 3.12 interpreter: pip checks Requires-Python
# against the running one.
RPY=${GK_RESOLVE_PYTHON:-$VENV312/bin/python}

# Wheels for the device: CPython 3.12, manylinux x86_64 (pip matches each manylinux tag exactly).
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
      --platform manylinux_2_18_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_35_x86_64)

WORK=""
trap '[ -z "$WORK" ] || [ -n "${GK_KEEP:-}" ] || rm -rf "$WORK"' EXIT  # GK_KEEP=1 keeps the scratch dir

die() { echo "gpu_kit: $*" >&2; exit 2; }
log() { echo "gpu_kit: $*" >&2; }

# ---------------------------------------------------------------------------------------------
# Python helper (written into each payload; runs here and on the device). Subcommands:
#   check   look up every Requires-Dist of the dists in --target dirs (earlier dirs win) against
#           those dirs + the live interpreter (--live) or a model of the image (--image-model)
#   cond    print the conditional wheels whose requirement the image does not satisfy
#   report  pip's --report JSON -> the wheels the image lacks (used by `tools` and `resolve`)
#   requires / stub   a wheel's Requires-Dist; an empty stand-in wheel (torch) for resolving
# ---------------------------------------------------------------------------------------------
helper_py() {
cat <<'PYEOF'
#!/usr/bin/env python3
"""gk_helper.py: helper of scripts/gpu_kit.sh (generated by it; do not edit the copy)."""
import argparse, email.parser, json, os, sys, zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon

# The device's marker environment (Python 3.12.3, Linux x86_64), whatever runs this helper.
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "platform_python_implementation": "CPython", "implementation_name": "cpython",
           "implementation_version": "3.12.3", "platform_release": "", "platform_version": ""}

# The device image's Python packages (KINDS.md, read 2026-11-17); versions where a session read them
# (the 'pip list' row, README for cudnn/nccl/nvshmem), None where nobody has.
IMAGE_NAMES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
IMAGE_VERSIONS = {
    "accelerate": "1.15.0", "botorch": "0.18.1", "cupy-cuda13x": "14.2.0", "gpytorch": "1.15.2",
    "huggingface-hub": "1.33.0", "jax": "0.11.2", "jax-cuda13-pjrt": "0.11.2",
    "jax-cuda13-plugin": "0.11.2", "jaxlib": "0.11.2", "jaxtyping": "0.3.11", "numpy": "2.5.2",
    "numpyro": "0.21.0", "onnx": "1.23.1", "onnx-ir": "1.0.0", "onnxruntime": "1.30.0",
    "onnxscript": "0.7.2", "pytorch-lightning": "2.6.6", "safetensors": "0.8.0",
    "sentence-transformers": "6.0.1", "sentencepiece": "0.2.2", "tiktoken": "0.14.0",
    "tokenizers": "0.23.2", "torch": "2.11.0", "torch-geometric": "2.8.0.post1",
    "torchaudio": "2.11.0", "torchdiffeq": "0.2.5", "torchmetrics": "1.9.0", "torchvision": "0.26.0",
    "transformers": "5.17.0", "triton": "3.6.0", "nvidia-nccl-cu13": "2.28.9",
    "nvidia-nvshmem-cu13": "3.4.5"}

# The torch kits (gpu_kit.sh torch213 / torch214): what each puts ahead of the image.
TORCH_KITS = {
    "2.13.0": {"torch": "2.13.0", "nvidia-nccl-cu13": "2.29.7"},
    "2.14.0": {"torch": "2.14.0", "nvidia-nccl-cu13": "2.30.7", "triton": "3.8.0"},
}

# Not shipped on purpose (kernels we do not use, CUDA-12/other-torch wheels, front-end extras);
# `check` lists them apart instead of failing.
DROPPED = {
    "flashinfer-python": "kernels: VLLM_USE_FLASHINFER_SAMPLER=0, gdn_prefill_backend=triton",
    "flashinfer-cubin": "kernels", "flashinfer-jit-cache": "kernels",
    "tilelang": "kernels (DeepSeek sparse attention)", "nvidia-cutlass-dsl": "kernels (CuTe DSL)",
    "nvidia-cutlass-dsl-libs-base": "kernels", "nvidia-cutlass-dsl-libs-cu13": "kernels",
    "quack-kernels": "kernels", "tokenspeed-mla": "kernels (MLA)", "humming-kernels": "kernels",
    "nvidia-cudnn-frontend": "kernels", "nvtx": "profiling ranges only",
    "fastsafetensors": "optional GDS loader", "instanttensor": "optional weight loader",
    "torchcodec": "video decoding", "pynvvideocodec": "video decoding",
    "torchaudio": "audio models; the image's 2.11 is kept", "xformers": "kernels",
    "kaleido": "figure PNG export needs a Chrome the device lacks",
    "jupyterlab": "serves live notebooks; the device only executes them",
    "z3-solver": "tilelang",
}
# Version mismatches measured to be harmless (README: torch 2.13 on the image's CUDA 13.0 libraries).
ACCEPTED = {
    ("torch", "triton"): "torch 2.13 wants 3.7.1; the image's 3.6.0 ran torch.compile",
    ("torch", "nvidia-cudnn-cu13"): "9.20 (2.13) / 9.24 (2.14) wanted, the image's 9.19 ran 2.13's convolutions",
    ("torch", "cuda-toolkit"): "the image's CUDA 13.0 libraries load",
    ("torch", "cuda-bindings"): "the image's", ("torch", "nvidia-cusparselt-cu13"): "the image's",
    ("torch", "nvidia-nvshmem-cu13"): "the image's 3.4.5",
    ("mistral-common", "numpy"): "wants numpy<2.4 on Python <= 3.12; vLLM 0.28.0 ran on the image's 2.5.2",
}


def read_meta(text):
    msg = email.parser.Parser().parsestr(text)
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def dists_in(path):
    for d in sorted(Path(path).glob("*.dist-info")):
        m = d / "METADATA"
        if m.is_file():
            yield (*read_meta(m.read_text(errors="replace")), str(d))


def wheel_meta(whl):
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return read_meta(z.read(name).decode(errors="replace"))


def applies(req, extras):
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**MARKERS, "extra": e}) for e in ("", *extras))


def cmd_check(a):
    env, meta = {}, {}       # canon name -> (version or None, where); canon name -> requires
    for t in a.target:
        for name, ver, reqs, where in dists_in(t):
            n = canon(name)
            if n not in env:
                env[n] = (ver, t)
                meta[n] = (name, reqs)
    if a.live:
        import importlib.metadata as md
        for d in md.distributions():
            n = canon(d.metadata["Name"] or "")
            if n and n not in env:
                env[n] = (d.version, "live")
                meta[n] = (d.metadata["Name"], d.requires or [])
    if a.image_model:
        for n in IMAGE_NAMES:
            env.setdefault(canon(n), (IMAGE_VERSIONS.get(n), "image"))
        kit = "2.13.0" if a.torch213 else a.torch_kit
        for n, v in TORCH_KITS.get(kit, {}).items():   # what the torch kit puts ahead of the image
            env[canon(n)] = (v, f"torch{kit.rsplit('.', 1)[0].replace('.', '')} kit")
    if a.pins:   # "# gk-not-shipped: NAME ..." lines of a pin list: left out on purpose
        for line in Path(a.pins).read_text().splitlines():
            if line.startswith("# gk-not-shipped:"):
                for n in line.split(":", 1)[1].split():
                    DROPPED.setdefault(canon(n), "not in this release's pin list (measured without it)")
    roots = [canon(n) for t in a.target for n, *_ in dists_in(t)] if not a.root else [canon(r) for r in a.root]
    seen, work = set(), [(r, ()) for r in roots]
    missing, conflict, unknown, dropped, accepted = [], [], [], {}, []
    while work:
        n, extras = work.pop()
        if (n, extras) in seen or n not in meta:
            continue
        seen.add((n, extras))
        who = meta[n][0]
        for line in meta[n][1]:
            req = Requirement(line)
            if not applies(req, extras):
                continue
            r = canon(req.name)
            if r in DROPPED:
                dropped.setdefault(r, set()).add(who)
                continue
            if r not in env:
                missing.append(f"{req.name} (required by {who}: {line})")
                continue
            ver, where = env[r]
            if req.extras:
                work.append((r, tuple(sorted(req.extras))))
            if ver is None:
                if req.specifier:
                    unknown.append(f"{req.name}{req.specifier} (image version unknown; by {who})")
                continue
            if req.specifier and not req.specifier.contains(ver, prereleases=True):
                key = (canon(who), r)
                msg = f"{req.name} {ver} [{where}] but {who} wants {req.specifier}"
                (accepted if key in ACCEPTED else conflict).append(
                    msg + (f"  -- accepted: {ACCEPTED[key]}" if key in ACCEPTED else ""))
    print(f"checked {len(seen)} dists ({', '.join(a.target)})")
    for title, rows in (("MISSING", missing), ("CONFLICT", conflict), ("ACCEPTED", accepted),
                        ("UNKNOWN", unknown)):
        for row in sorted(set(rows)):
            print(f"  {title:8s} {row}")
    if dropped:
        print("  dropped on purpose: " + ", ".join(f"{k} ({DROPPED[k]})" for k in sorted(dropped)))
    bad = len(set(missing)) + len(set(conflict))
    print("check: " + ("OK" if not bad else f"{bad} problem(s)"))
    return 1 if (bad and a.strict) else 0


def cmd_cond(a):
    """Lines 'WHEELFILE REQUIREMENT': print WHEELFILE when the running interpreter (the image,
    PYTHONPATH unset) lacks REQUIREMENT's package or has a version outside it."""
    import importlib.metadata as md
    for line in Path(a.spec).read_text().splitlines():
        if not line.strip():
            continue
        whl, spec = line.split(None, 1)
        req = Requirement(spec)
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            print(os.path.join(a.dir, whl))
            print(f"cond: image has {req.name} {have}, wants {req.specifier}: shipping {whl}", file=sys.stderr)
        else:
            print(f"cond: image's {req.name} {have} satisfies {req.specifier}", file=sys.stderr)


def cmd_report(a):
    """pip's --report JSON -> 'name==version' of what the image lacks (or needs newer)."""
    rep = json.loads(Path(a.report).read_text())
    img = {canon(n) for n in IMAGE_NAMES}
    keep = {canon(k) for k in (a.keep or [])}
    out, drop_img, drop_skip = [], [], []
    for item in rep["install"]:
        n, v = item["metadata"]["name"], item["metadata"]["version"]
        c = canon(n)
        if c in DROPPED or c in {canon(s) for s in (a.skip or [])}:
            drop_skip.append(f"{n}=={v}")
        elif c in img and c not in keep:
            drop_img.append(f"{n}=={v}")
        else:
            out.append(f"{n}=={v}")
    Path(a.out).write_text("\n".join(sorted(out, key=str.lower)) + "\n")
    print(f"resolved {len(rep['install'])}: ship {len(out)}, image has {len(drop_img)}, dropped {len(drop_skip)}")
    print("  image has: " + " ".join(sorted(drop_img, key=str.lower)))
    if drop_skip:
        print("  dropped: " + " ".join(sorted(drop_skip, key=str.lower)))


def cmd_requires(a):
    """Requires-Dist of a wheel (no extras), one per line."""
    _, _, reqs = wheel_meta(a.wheel)
    for line in reqs:
        if applies(Requirement(line), ()):
            print(line)


def cmd_stub(a):
    """An empty wheel NAME-VERSION+gkstub (no requirements): lets pip resolve around torch without
    pulling torch's CUDA wheels (the image or the torch213 kit provides the real one)."""
    ver = f"{a.version}+gkstub"
    tag = a.name.replace("-", "_")
    whl = Path(a.dir) / f"{tag}-{ver}-py3-none-any.whl"
    di = f"{tag}-{ver}.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {a.name}\nVersion: {ver}\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: gk\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{di}/RECORD", "")
    print(whl)


def main():
    p = argparse.ArgumentParser()
    s = p.add_subparsers(dest="cmd", required=True)
    c = s.add_parser("check")
    c.add_argument("--target", action="append", required=True)
    c.add_argument("--root", action="append")
    c.add_argument("--live", action="store_true")
    c.add_argument("--image-model", action="store_true")
    c.add_argument("--torch213", action="store_true")    # = --torch-kit 2.13.0 (kept for old callers)
    c.add_argument("--torch-kit", metavar="TORCH_VERSION", help="model the torch kit of that torch too")
    c.add_argument("--strict", action="store_true")
    c.add_argument("--pins")
    c.set_defaults(f=cmd_check)
    c = s.add_parser("cond"); c.add_argument("spec"); c.add_argument("dir"); c.set_defaults(f=cmd_cond)
    c = s.add_parser("report"); c.add_argument("report"); c.add_argument("out")
    c.add_argument("--skip", action="append"); c.add_argument("--keep", action="append")
    c.set_defaults(f=cmd_report)
    c = s.add_parser("requires"); c.add_argument("wheel"); c.set_defaults(f=cmd_requires)
    c = s.add_parser("stub"); c.add_argument("name"); c.add_argument("version"); c.add_argument("dir")
    c.set_defaults(f=cmd_stub)
    a = p.parse_args()
    sys.exit(a.f(a) or 0)


if __name__ == "__main__":
    main()
PYEOF
}

# ---------------------------------------------------------------------------------------------
# Device-side installer of one payload (install_NAME.sh, in the payload's last chunk). The values
# block in front of this template is filled in by write_installer.
# ---------------------------------------------------------------------------------------------
installer_body() {
cat <<'SHEOF'
set -euo pipefail
GK=${GK_DIR:-/tmp/gk}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$GK"
[ "$here" = "$GK" ] || cp -n "$here"/* "$GK"/ 2>/dev/null || true
man="$GK/$NAME.manifest"
[ -f "$man" ] || { echo "$NAME: no $NAME.manifest in $GK (its last chunk did not arrive)"; exit 3; }
want=$(awk '$1=="md5"{print $2}' "$man")
if [ -f "$DEST/.gk-installed" ] && [ "$(cat "$DEST/.gk-installed")" = "$want" ]; then
  echo "$NAME: already installed in $DEST"; exit 0
fi
# every part present and intact? name the chunk folders that are not
bad=0
while read -r tag part md5 bytes folder; do
  [ "$tag" = part ] || continue
  if [ ! -f "$GK/$part" ]; then echo "$NAME: MISSING $folder ($part): carry it and run mkdir -p /tmp/gk && cp $folder/* /tmp/gk/"; bad=1
  elif [ "$(md5sum "$GK/$part" | cut -d' ' -f1)" != "$md5" ]; then echo "$NAME: CORRUPT $folder ($part): copy it again"; bad=1; fi
done < "$man"
[ "$bad" = 0 ] || exit 3
work="$GK/work-$NAME"
rm -rf "$work" && mkdir -p "$work"
payload="$work/payload"
cat $(awk '$1=="part"{print "'"$GK"'/"$2}' "$man") > "$payload"
[ "$(md5sum "$payload" | cut -d' ' -f1)" = "$want" ] || { echo "$NAME: payload checksum mismatch"; exit 4; }
rm -rf "$DEST" && mkdir -p "$DEST"
case "$KIND" in
torch2[0-9]*)     # a torch kit (torch213, torch214): torch + its companion wheels, unpacked as is
  xz -T0 -dc "$payload" | tar x -C "$DEST"
  [ -x "$DEST/torch/bin/torch_shm_manager" ] || { echo "$NAME: torch/bin/torch_shm_manager missing"; exit 4; }
  tri=""; [ -d "$DEST/triton" ] && tri="; import triton; print('triton', triton.__version__, triton.__file__)"
  PYTHONPATH="$DEST${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'cuda', torch.cuda.is_available())$tri"
  ;;
release)
  kit=""
  if [ "$TORCH" != image ]; then
    kit="torch$(v=${TORCH%.*}; echo "${v//./}")"      # torch 2.14.0 -> the torch214 kit in /tmp/torch214
    [ -f "/tmp/$kit/.gk-installed" ] || { echo "$NAME: needs torch $TORCH: install $kit first (install_all.sh does)"; exit 5; }
  fi
  tar xf "$payload" -C "$work"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$DEST" "$work"/whl/*.whl
  if [ -s "$work/cond.txt" ]; then     # wheels shipped only for an image that is too old for them
    extra=$(env -u PYTHONPATH python3 "$work/gk_helper.py" cond "$work/cond.txt" "$work/cond")
    [ -z "$extra" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$DEST" $extra
  fi
  xz -T0 -dc "$work/vllm.tar.xz" | tar x -C "$DEST"
  tp=""; [ "$TORCH" = image ] || tp=":/tmp/$kit"
  cat > "$DEST/env.sh" <<ENV
# vLLM $VERSION on the H200 (torch $TORCH), written by gpu_kit.sh's installer. Source it: . $DEST/env.sh
# Puts $DEST${tp} (and /tmp/sstools when installed) ahead of the image's packages; another
# release's entries are removed first, so releases can be switched in one shell.
_gk_pp=\$(printf '%s' "\${PYTHONPATH:-}" | tr ':' '\n' | grep -vE '^/tmp/(vllm-[^/]+|torch2[0-9]+|sstools)/?\$' | paste -sd: - || true)
_gk_st=""; [ -d /tmp/sstools ] && _gk_st=":/tmp/sstools"
export PYTHONPATH="$DEST${tp}\${_gk_st}\${_gk_pp:+:\$_gk_pp}"
[ -d /tmp/sstools/bin ] && case ":\$PATH:" in *:/tmp/sstools/bin:*) ;; *) export PATH="/tmp/sstools/bin:\$PATH";; esac
[ -d /tmp/sstools/share/jupyter ] && export JUPYTER_PATH=/tmp/sstools/share/jupyter
unset _gk_pp _gk_st
# FlashInfer is not carried: vLLM's own sampler (also pass additional_config={"gdn_prefill_backend": "triton"}).
export VLLM_USE_FLASHINFER_SAMPLER=0
# The packed recurrent GDN decode kernel rejected non-contiguous a/b in runs without speculation.
export VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0
ENV
  cp "$work/gk_helper.py" "$DEST/.gk_helper.py"
  ( . "$DEST/env.sh"
    python3 -c "import vllm, torch; from vllm import LLM; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    cp "$work/pins.txt" "$DEST/.gk_pins.txt"
    python3 "$DEST/.gk_helper.py" check --target "$DEST" --live --pins "$DEST/.gk_pins.txt" > "$DEST/requires-check.txt" 2>&1 || true
    grep -E 'MISSING|CONFLICT|^check:' "$DEST/requires-check.txt" | head -20 | sed "s/^/$NAME requires: /" )
  echo "$NAME: . $DEST/env.sh ; pass additional_config={'gdn_prefill_backend': 'triton'} to LLM(...)"
  ;;
tools)
  tar xf "$payload" -C "$work"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$DEST" "$work"/whl/*.whl
  cat > "$DEST/env.sh" <<'ENV'
# statescope's CLI/notebook tools (papermill, nbclient, jupytext, plotly, ...), from gpu_kit.sh.
# A release's env.sh already adds /tmp/sstools behind itself; this one is for runs without vLLM.
case ":${PYTHONPATH:-}:" in *:/tmp/sstools:*) ;; *) export PYTHONPATH="/tmp/sstools${PYTHONPATH:+:$PYTHONPATH}";; esac
case ":$PATH:" in *:/tmp/sstools/bin:*) ;; *) export PATH="/tmp/sstools/bin:$PATH";; esac
export JUPYTER_PATH=/tmp/sstools/share/jupyter
ENV
  cp "$work/gk_helper.py" "$DEST/.gk_helper.py"
  ( . "$DEST/env.sh"
    python3 -c "import papermill, nbclient, nbconvert, nbformat, jupytext, ipykernel, plotly, ipywidgets, anywidget; print('tools: papermill', papermill.__version__, 'plotly', plotly.__version__, 'ipykernel', ipykernel.__version__)"
    python3 "$DEST/.gk_helper.py" check --target "$DEST" --live > "$DEST/requires-check.txt" 2>&1 || true
    grep -E 'MISSING|CONFLICT|^check:' "$DEST/requires-check.txt" | head -20 | sed 's/^/tools requires: /' )
  ;;
esac
echo "$want" > "$DEST/.gk-installed"
rm -rf "$work"
echo "$NAME: installed in $DEST"
SHEOF
}

write_installer() {  # NAME KIND VERSION TORCH DEST FILE
  { echo '#!/usr/bin/env bash'
    echo "# install_$1.sh: generated by scripts/gpu_kit.sh; runs ON the device in the call that carries"
    echo "# the last chunk of $1 (earlier calls copied theirs into /tmp/gk). install_all.sh calls it."
    echo "NAME=$1 KIND=$2 VERSION=$3 TORCH=$4 DEST=$5"
    installer_body; } > "$6"
  chmod +x "$6"
}

exclude_chunks() {
  local ex="$ROOT/.git/info/exclude"
  [ -d "$ROOT/.git" ] || return 0
  mkdir -p "$ROOT/.git/info"
  grep -qxF '/.gk-*/' "$ex" 2>/dev/null || echo '/.gk-*/' >> "$ex"
}

# pip download into the cache; prints the paths of the files it saved or found there.
fetch() {  # ARGS... (requirements or -r FILE), already --no-deps
  mkdir -p "$CACHE/dl"
  local lg; lg=$(mktemp "${TMPDIR:-/tmp}/gk-pip.XXXXXX")
  if ! "$PY" -m pip download --no-deps "${PLAT[@]}" -d "$CACHE/dl" "$@" > "$lg" 2>&1; then
    grep -v '^WARNING: Location' "$lg" | tail -5 >&2; die "pip download $* failed"
  fi
  sed -n -E 's/^[[:space:]]*(Saved|File was already downloaded) (.*)$/\2/p' "$lg" | while read -r f; do
    case "$f" in /*) echo "$f";; *) echo "$CACHE/dl/$(basename "$f")";; esac; done
  rm -f "$lg"
}

# Split PAYLOAD into .gk-NAME-NN folders of CHUNK bytes; the last one gets NAME.manifest and the
# installer. Extra manifest lines (key value) come on stdin.
pack() {  # NAME PAYLOAD CHUNK INSTALLER
  local name=$1 payload=$2 chunk=$3 installer=$4 work n=0 last
  work=$(dirname "$payload")
  exclude_chunks
  rm -rf "$ROOT"/.gk-"$name"-[0-9][0-9]
  mkdir -p "$work/parts"
  split -b "$chunk" -d -a 2 --numeric-suffixes=1 "$payload" "$work/parts/$name.part"
  local man="$work/$name.manifest"
  { echo "name $name"; cat; echo "md5 $(md5sum "$payload" | cut -d' ' -f1)"
    echo "bytes $(stat -c %s "$payload")"; echo "count $(ls "$work/parts" | wc -l)"; } > "$man"
  for p in "$work"/parts/"$name".part*; do
    n=$((n + 1)); last=$(printf '.gk-%s-%02d' "$name" "$n")
    mkdir "$ROOT/$last"; mv "$p" "$ROOT/$last/"
    echo "part $(basename "$p") $(md5sum "$ROOT/$last/$(basename "$p")" | cut -d' ' -f1) $(stat -c %s "$ROOT/$last/$(basename "$p")") $last" >> "$man"
  done
  cp "$man" "$installer" "$ROOT/$last/"
  log "$name: $n chunk(s), $(stat -c %s "$payload") bytes -> .gk-$name-01..$last"
}

# xz -0 by default: on these binaries (libtorch, vLLM's .so) -6 saved 1.4% at 5x the CPU time
# (30 MB of _C_stable_libtorch.abi3.so: 18.08 MB at -0 in 23 s, 17.83 MB at -6 in 106 s, one busy core).
xz_dir() {  # DIR OUT.tar.xz : tar the tree (sorted, numeric owners) and xz it in blocks (parallel unpack)
  (cd "$1" && tar --sort=name --owner=0 --group=0 --numeric-owner -cf - .) \
    | nice -n 10 xz -T0 "${GK_XZ_LEVEL:--0}" > "$2"
}
# The stripped trees' xz are kept in $CACHE/xz (named by payload, version, preset and STRIP_REV, which
# changes whenever a strip list below changes), so a rebuild with other pins or chunk sizes is quick.
STRIP_REV=r1
xz_cache_name() { echo "$CACHE/xz/$1-$2${GK_XZ_LEVEL:--0}-$STRIP_REV.tar.xz"; }   # NAME VERSION

# ---------------------------------------------------------------------------------------------
# The torch kits: NAME -> torch version + companion wheels (what the image's CUDA 13.0 stack lacks
# for that torch). Each installs into /tmp/NAME; a release pinned to torch X.Y.Z needs torchXY
# (torch_kit_name). Measured/decided from each torch wheel's Requires-Dist and its .so files' NEEDED,
# RPATH and undefined symbols (readelf -d, nm -D), compared with 2.13's which ran on the image:
#   torch213: NCCL 2.29.7 (2.13 calls ncclCommResume, the image's 2.28.9 lacks it). The image's
#             triton 3.6.0 (2.13 wants 3.7.1) ran torch.compile; its cuDNN 9.19 (9.20 wanted) ran convs.
#   torch214: NCCL 2.30.7 (2.14 also calls ncclCommGrow/Revoke/GetUniqueId, ncclGather,
#             ncclWinGetUserPtr) and triton 3.8.0 (2.14 wants ~=3.8.0; vLLM 0.33's GDN/FLA kernels and
#             2.14's inductor are Triton; 3.6.0 is two minors behind). Left to the image as for 2.13:
#             cuda-toolkit 13.0.3 (same pin as 2.13; 2.14's new cudart/cublasLt symbols exist since
#             CUDA 11), cuda-bindings (same >=13.0.3,<14), nvshmem 3.4.5 and cusparseLt 0.8.1 (same pins,
#             same symbols as 2.13), cuDNN (9.24 wanted, image 9.19; no new cudnn symbol vs 2.13:
#             torch.backends.cudnn.version() complains as with 2.13; ~0.9 GB, not carried).
torch_kit_spec() {  # NAME -> "TORCH_VERSION COMPANION_REQ ..."
  case "$1" in
    torch213) echo "2.13.0 nvidia-nccl-cu13==2.29.7" ;;
    torch214) echo "2.14.0 nvidia-nccl-cu13==2.30.7 triton==3.8.0" ;;
    *) die "no torch kit $1 (known: torch213 torch214)" ;;
  esac
}
torch_kit_name() { local v=${1%.*}; echo "torch${v//./}"; }   # 2.14.0 -> torch214

cmd_torch_kit() {  # NAME [CHUNK_BYTES]
  local name=$1 chunk=${2:-$DEFAULT_CHUNK} work spec version req whl
  spec=($(torch_kit_spec "$name")); version=${spec[0]}
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gk-$name.XXXXXX"); work=$WORK
  fetch "torch==$version" "${spec[@]:1}" > /dev/null     # into $CACHE/dl
  local cached; cached=$(xz_cache_name "$name" "$version")
  if [ -f "$cached" ]; then log "$name: stripped tree from the cache ($cached)"; cp "$cached" "$work/$name.tar.xz"; else
  mkdir -p "$work/site"
  # torch without its C++ headers and protoc (nothing on the device compiles against them; measured);
  # torch/bin/torch_shm_manager stays (torch refuses to import without it). NCCL in full, dist-info
  # included so that importlib.metadata reports the NCCL that loads (torch's RPATH finds
  # ../../nvidia/nccl/lib). Triton (dist-info kept: its entry points name the backends and shadow the
  # image's triton's) without what an H200 (sm_90) run never loads: the CUPTI copies of the Proton
  # profiler (backends/nvidia/lib/cupti*, 278 MB) and ptxas-blackwell (used for arch >= 100 only).
  (cd "$work/site" && unzip -q "$CACHE"/dl/torch-$version-cp312-*.whl -x 'torch/include/*' 'torch/bin/protoc*')
  for req in "${spec[@]:1}"; do
    local pkg=${req%%==*} ver=${req#*==}
    whl=$(ls "$CACHE"/dl/"${pkg//-/_}"-"$ver"-*.whl | head -1)
    [ -f "$whl" ] || die "$name: no wheel for $req in $CACHE/dl"
    case "$pkg" in
      triton) (cd "$work/site" && unzip -q "$whl" -x 'triton/backends/nvidia/lib/cupti/*' \
                 'triton/backends/nvidia/lib/cupti-blackwell/*' 'triton/backends/nvidia/bin/ptxas-blackwell') ;;
      *) (cd "$work/site" && unzip -q "$whl") ;;
    esac
  done
  [ -x "$work/site/torch/bin/torch_shm_manager" ] || die "$name: torch/bin/torch_shm_manager missing"
  log "$name: xz of $(du -sh "$work/site" | cut -f1) (10-20 min on 2 busy cores)"
  xz_dir "$work/site" "$work/$name.tar.xz"
  rm -rf "$work/site"
  mkdir -p "$CACHE/xz"; cp "$work/$name.tar.xz" "$cached"
  fi
  write_installer "$name" "$name" "$version" own "/tmp/$name" "$work/install_$name.sh"
  printf 'kind %s\nversion %s\ndest /tmp/%s\n' "$name" "$version" "$name" | pack "$name" "$work/$name.tar.xz" "$chunk" "$work/install_$name.sh"
  cmd_plan > /dev/null
}

# PINS: a requirements file of name==version lines. A line ending in "# cond: REQUIREMENT" is a
# wheel shipped apart and installed only where the image's own version misses REQUIREMENT.
cmd_release() {
  local version=${1:?usage: gpu_kit.sh release VERSION PINS [CHUNK_BYTES]} pins=${2:?PINS}
  local chunk=${3:-$DEFAULT_CHUNK} work whl torch name="v$1"
  [ -f "$pins" ] || pins="$PINS_DIR/$pins"
  [ -f "$pins" ] || die "no pin list $2"
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gk-$name.XXXXXX"); work=$WORK
  whl=$(fetch "vllm==$version" | grep -E "/vllm-$version-" | head -1)
  [ -f "$whl" ] || die "vllm $version wheel not found"
  torch=$(unzip -p "$whl" '*.dist-info/METADATA' | sed -n -E 's/^Requires-Dist: torch==([0-9.]+).*/\1/p' | head -1)
  case "$torch" in
    2.11.0) torch=image ;;            # the image's torch 2.11.0+cu130
    2.13.0|2.14.0)                    # the torch213 / torch214 kit
      local kit; kit=$(torch_kit_name "$torch")
      [ -n "$(ls "$ROOT"/.gk-"$kit"-[0-9][0-9]/"$kit".manifest 2>/dev/null)" ] \
        || log "$name: needs the $kit kit on the device: bash scripts/gpu_kit.sh $kit (not built yet)" ;;
    *) die "vllm $version pins torch $torch: neither the image's 2.11.0 nor a kit's (torch213: 2.13.0, torch214: 2.14.0)" ;;
  esac
  mkdir -p "$work/p/whl" "$work/p/cond"
  local cached; cached=$(xz_cache_name vllm "$version")
  if [ -f "$cached" ]; then log "$name: stripped vLLM from the cache ($cached)"; cp "$cached" "$work/p/vllm.tar.xz"; else
  mkdir -p "$work/strip"
  # Not needed for an H200 run: the FlashAttention-2 binary (Hopper runs FA3), the SM100 (Blackwell)
  # FMHA headers, DeepGEMM's JIT headers, the Rust frontend binary (only with VLLM_USE_RUST_FRONTEND=1),
  # and DeepGEMM's extension builds for Pythons other than 3.12.
  (cd "$work/strip" && unzip -q "$whl" -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' \
      'vllm/third_party/fmha_sm100/*' 'vllm/third_party/deep_gemm/include/*' 'vllm/vllm-rs' \
      'vllm/third_party/deep_gemm/_C.cpython-310-*' 'vllm/third_party/deep_gemm/_C.cpython-311-*' \
      'vllm/third_party/deep_gemm/_C.cpython-313-*' 'vllm/third_party/deep_gemm/_C.cpython-314-*' \
      2>&1 | grep -v 'excluded filename not matched' || true)      # not every release has them all
  [ -f "$work/strip/vllm/__init__.py" ] || die "$name: unpacking $whl failed"
  log "$name: xz of $(du -sh "$work/strip" | cut -f1) (a few minutes)"
  xz_dir "$work/strip" "$work/p/vllm.tar.xz"
  rm -rf "$work/strip"
  mkdir -p "$CACHE/xz"; cp "$work/p/vllm.tar.xz" "$cached"
  fi
  # pinned wheels (comments stripped); "# cond:" lines go to cond/ with their requirement
  sed -E 's/#.*//; s/[[:space:]]+$//' "$pins" | grep -E '^[A-Za-z0-9]' > "$work/main.txt" || true
  grep -E '#[[:space:]]*cond:' "$pins" > "$work/condlines.txt" || true
  grep -vxF -f <(sed -E 's/[[:space:]]*#.*//' "$work/condlines.txt") "$work/main.txt" > "$work/main2.txt" || true
  [ -s "$work/main2.txt" ] && fetch -r "$work/main2.txt" | while read -r f; do cp "$f" "$work/p/whl/"; done
  : > "$work/p/cond.txt"
  while read -r line; do
    local req spec f
    req=$(echo "$line" | sed -E 's/[[:space:]]*#.*//'); spec=$(echo "$line" | sed -E 's/.*#[[:space:]]*cond:[[:space:]]*//')
    f=$(fetch "$req" | head -1); cp "$f" "$work/p/cond/"
    echo "$(basename "$f") $spec" >> "$work/p/cond.txt"
  done < "$work/condlines.txt"
  # one version of each package, and as many wheels as pins
  local nw np
  nw=$(ls "$work/p/whl" | wc -l); np=$(wc -l < "$work/main2.txt")
  [ "$nw" = "$np" ] || die "$name: $np pins but $nw wheels"
  ls "$work/p/whl" "$work/p/cond" | sed -E 's/-[0-9].*//' | tr 'A-Z_.' 'a-z--' | sort | uniq -d | grep . && die "$name: two versions of one package" || true
  helper_py > "$work/p/gk_helper.py"
  cp "$pins" "$work/p/pins.txt"
  (cd "$work/p" && tar cf "$work/$name.tar" vllm.tar.xz whl cond cond.txt gk_helper.py pins.txt)
  rm -rf "$work/p"
  write_installer "$name" release "$version" "$( [ "$torch" = image ] && echo image || echo "$torch")" "/tmp/vllm-$version" "$work/install_$name.sh"
  printf 'kind release\nversion %s\ntorch %s\ndest /tmp/vllm-%s\nwheels %s\n' "$version" "$torch" "$version" "$nw" \
    | pack "$name" "$work/$name.tar" "$chunk" "$work/install_$name.sh"
  cmd_plan > /dev/null
}

# The tools the CLI and `statescope render` need beyond the image: pyproject's dependencies and its
# `notebooks` extra, less kaleido (PNG export drives a Chrome the device lacks: statescope's figures
# code reports 'no Chrome' and goes on) and jupyterlab (serves notebooks; the device only executes
# them). The closure is resolved for Python 3.12 / manylinux x86_64 with versions held to the image's
# known ones and to the newest release pin list (one version of each package on PYTHONPATH).
cmd_tools() {
  local chunk=${1:-$DEFAULT_CHUNK} work
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gk-tools.XXXXXX"); work=$WORK
  helper_py > "$work/gk_helper.py"
  "$PY" - "$ROOT/pyproject.toml" > "$work/reqs.txt" <<'PYEOF'
import sys, tomllib, re
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
skip = {"kaleido", "jupyterlab"}
for r in p["dependencies"] + p["optional-dependencies"]["notebooks"]:
    if re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() not in skip:
        print(r)
PYEOF
  # constraints: the image's known versions, then the newest release's pins
  "$PY" - "$work/gk_helper.py" > "$work/cons.txt" <<'PYEOF'
import runpy, sys
h = runpy.run_path(sys.argv[1])
for n, v in h["IMAGE_VERSIONS"].items():
    if n not in ("torch", "torchvision", "torchaudio", "triton"):
        print(f"{n}=={v}")
PYEOF
  local newest
  newest=$(ls "$PINS_DIR"/wheel_pins_*.txt 2>/dev/null | sort -V | tail -1 || true)
  if [ -n "$newest" ]; then
    sed -E 's/#.*//; s/[[:space:]]+$//' "$newest" | grep -E '^[A-Za-z0-9]' | grep -viE '^torch' >> "$work/cons.txt" || true
  fi
  "$RPY" -m pip install -q --dry-run --ignore-installed --report "$work/report.json" "${PLAT[@]}" \
      --target "$work/t" -c "$work/cons.txt" -r "$work/reqs.txt" 2> >(grep -v '^WARNING: Location' >&2)
  "$PY" "$work/gk_helper.py" report "$work/report.json" "$work/tools.txt" --skip kaleido --skip jupyterlab >&2
  mkdir -p "$PINS_DIR"
  { echo "# statescope tools for the H200 (gpu_kit.sh tools): pyproject dependencies + the notebooks extra"
    echo "# less kaleido and jupyterlab, resolved for cp312 manylinux x86_64, less what the image has."
    echo "# Constraints: the image's known versions and $(basename "${newest:-none}"). Generated; do not edit."
    cat "$work/tools.txt"; } > "$PINS_DIR/tools_pins.txt"
  mkdir -p "$work/p/whl"
  fetch -r "$work/tools.txt" | while read -r f; do cp "$f" "$work/p/whl/"; done
  ls "$work/p/whl" | sed -E 's/-[0-9].*//' | tr 'A-Z_.' 'a-z--' | sort | uniq -d | grep . && die "tools: two versions of one package" || true
  cp "$work/gk_helper.py" "$PINS_DIR/tools_pins.txt" "$work/p/"
  (cd "$work/p" && tar cf "$work/tools.tar" whl gk_helper.py tools_pins.txt)
  write_installer tools tools "-" image /tmp/sstools "$work/install_tools.sh"
  printf 'kind tools\ndest /tmp/sstools\nwheels %s\n' "$(ls "$work/p/whl" | wc -l)" \
    | pack tools "$work/tools.tar" "$chunk" "$work/install_tools.sh"
  cmd_plan > /dev/null
}

# ---------------------------------------------------------------------------------------------
# Transfer plan. Payloads by size, biggest first; each full chunk is one call, in that order. The
# payloads' last (partial) chunks are then packed together, first-fit by size, into as few calls as
# fit (chunks + TREE_ALLOWANCE < 64 MiB; `carry` takes up to 8 paths). install_all.sh goes into a
# folder of the final call. `plan NAME ...` plans only those payloads (e.g. without v0.30.0).
install_all_body() {
cat <<'SHEOF'
want=("$@"); [ ${#want[@]} -gt 0 ] || want=($(awk '$1=="name"{print $2}' <<<"$MANIFEST"))
declare -A state
missing=0
for n in "${want[@]}"; do
  rows=$(awk -v n="$n" '$1=="name"{cur=$2} cur==n' <<<"$MANIFEST")
  [ -n "$rows" ] || { echo "unknown payload $n (known: $(awk '$1=="name"{printf "%s ", $2}' <<<"$MANIFEST"))"; exit 2; }
  printf '%s\n' "$rows" > "$GK/$n.manifest"          # the manifest even if its last chunk is missing
  ok=1
  while read -r tag part md5 bytes folder; do
    [ "$tag" = part ] || continue
    if [ ! -f "$GK/$part" ]; then echo "MISSING $folder ($part, $bytes bytes)"; ok=0
    elif [ "$(md5sum "$GK/$part" | cut -d' ' -f1)" != "$md5" ]; then echo "CORRUPT $folder ($part)"; ok=0; fi
  done <<<"$rows"
  [ -f "$GK/install_$n.sh" ] || ok=0
  if [ $ok = 1 ]; then state[$n]=ready; else state[$n]=missing; missing=1; fi
done
[ $missing = 0 ] || echo "=> a call carrying each MISSING/CORRUPT folder runs 'mkdir -p /tmp/gk && cp FOLDER/* /tmp/gk/'; then bash /tmp/gk/install_all.sh again (what is complete is installed now and skipped then)"
run() { bash "$GK/install_$1.sh" > "$GK/log-$1.txt" 2>&1; }
field() { awk -v n="$1" -v k="$2" '$1=="name"{cur=$2} cur==n && $1==k{print $2}' <<<"$MANIFEST"; }
t0=$(date +%s)
# the torch kits (torch213, torch214: kind = name) first, in parallel; then the releases, in parallel
pids=()
for n in "${want[@]}"; do
  [[ "$(field "$n" kind)" =~ ^torch[0-9]+$ ]] && [ "${state[$n]}" = ready ] || continue
  run "$n" & pids+=("$!:$n")
done
for p in "${pids[@]}"; do if wait "${p%%:*}"; then state[${p#*:}]=installed; else state[${p#*:}]=FAILED; fi; done
pids=()
for n in "${want[@]}"; do
  [ "$(field "$n" kind)" = release ] && [ "${state[$n]}" = ready ] || continue
  tv=$(field "$n" torch)
  if [ "$tv" != image ]; then
    kit="torch$(v=${tv%.*}; echo "${v//./}")"         # torch 2.14.0 -> torch214 (in /tmp/torch214)
    if [ ! -f "/tmp/$kit/.gk-installed" ]; then
      state[$n]="skipped (needs $kit for torch $tv: ${state[$kit]:-not in this transfer}; carry its chunks and run install_all.sh again)"; continue
    fi
  fi
  run "$n" & pids+=("$!:$n")
done
for p in "${pids[@]}"; do if wait "${p%%:*}"; then state[${p#*:}]=installed; else state[${p#*:}]=FAILED; fi; done
if [ "${state[tools]:-}" = ready ]; then
  if run tools; then state[tools]=installed; else state[tools]=FAILED; fi
fi
rc=0
echo "== install_all: $(( $(date +%s) - t0 )) s (logs: $GK/log-NAME.txt)"
for n in "${want[@]}"; do
  echo "$n: ${state[$n]}"
  case "${state[$n]}" in
    # the check's rows read 'NAME requires:   CONFLICT ...' (its own indent after the prefix)
    installed) grep -E '^(torch |vllm |tools:)|requires: +(MISSING|CONFLICT|check)|already installed' "$GK/log-$n.txt" | head -30 | sed 's/^/    /' ;;
    FAILED) tail -15 "$GK/log-$n.txt" | sed 's/^/    /'; rc=4 ;;
    *) [ $rc != 0 ] || rc=3 ;;
  esac
done
for n in "${want[@]}"; do
  if [ "$(field "$n" kind)" = release ] && [ "${state[$n]}" = installed ]; then echo "use: . $(field "$n" dest)/env.sh"; fi
done
exit $rc
SHEOF
}

plan_py() {
cat <<'PLANEOF'
import sys
from pathlib import Path
root, limit, allowance, ia_body = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
only = sys.argv[5:]
budget = limit - allowance
man = {}
for m in sorted(root.glob(".gk-*/*.manifest")):
    rows = [l.split() for l in m.read_text().splitlines() if l.strip()]
    d = {r[0]: r[1] for r in rows if r[0] != "part"}
    d["parts"] = [r[1:] for r in rows if r[0] == "part"]        # part md5 bytes folder
    d["text"] = m.read_text()
    man[d["name"]] = d
if only:
    unknown = [n for n in only if n not in man]
    if unknown:
        sys.exit(f"gpu_kit plan: no chunks for {unknown} (have {sorted(man)})")
    man = {n: man[n] for n in only}
if not man:
    sys.exit("gpu_kit plan: no chunks yet: run torch213 / torch214 / release / tools first")
order = sorted(man, key=lambda n: (-int(man[n]["bytes"]), n))
size = {}
for n in order:
    for part, md5, b, folder in man[n]["parts"]:
        if not (root / folder / part).is_file():
            sys.exit(f"gpu_kit plan: {folder}/{part} is missing: rebuild {n}")
        size[folder] = sum(f.stat().st_size for f in (root / folder).iterdir()
                           if f.is_file() and f.name != "install_all.sh")
full, tails = [], []
for n in order:
    ps = man[n]["parts"]
    for i, (part, md5, b, folder) in enumerate(ps):
        (tails if i == len(ps) - 1 else full).append(folder)   # a payload's last chunk is partial
calls = [[f] for f in full]
bins = []
for f in sorted(tails, key=lambda t: -size[t]):               # first fit decreasing
    for b in bins:
        if sum(size[x] for x in b) + size[f] + 16384 <= budget and len(b) < 8:
            b.append(f)
            break
    else:
        bins.append([f])
calls += sorted(bins, key=lambda b: -sum(size[x] for x in b))
final = calls[-1][0]
for p in root.glob(".gk-*/install_all.sh"):
    p.unlink()
ia = root / final / "install_all.sh"
ia.write_text(
    "#!/usr/bin/env bash\n"
    "# install_all.sh: generated by scripts/gpu_kit.sh plan. Runs ON the device in the final transfer call.\n"
    "# Checks every part's md5, names chunk folders that did not arrive, installs each complete payload\n"
    "# (the torch kits torch213/torch214 first, the releases in parallel, then tools) and reports.\n"
    "# Usage: bash /tmp/gk/install_all.sh [NAME ...]   (default: all planned: " + " ".join(order) + ")\n"
    "set -uo pipefail\n"
    'GK=${GK_DIR:-/tmp/gk}; here=$(cd "$(dirname "$0")" && pwd); mkdir -p "$GK"\n'
    '[ "$here" = "$GK" ] || cp -n "$here"/* "$GK"/ 2>/dev/null || true\n'
    "MANIFEST=$(cat <<'MAN'\n" + "".join(man[n]["text"] for n in order) + "MAN\n)\n"
    + Path(ia_body).read_text())
ia.chmod(0o755)
size[final] += ia.stat().st_size
total = sum(size.values())
print("# transfer plan: payloads biggest first, full chunks one per call, last chunks packed together")
print(f"{'payload':10s} {'bytes':>11s} {'chunks':>6s}  kind version torch -> installs into")
for n in order:
    d = man[n]
    print(f"{n:10s} {int(d['bytes']):11d} {len(d['parts']):6d}  {d.get('kind')} {d.get('version', '-')} "
          f"torch={d.get('torch', '-')} -> {d.get('dest')}")
print(f"{'all':10s} {total:11d} {len(size):6d}  (chunk folders, bytes on disk) in {len(calls)} device calls")
print()
over = False
for i, c in enumerate(calls, 1):
    s = sum(size[f] for f in c)
    ok = s + allowance < limit
    over |= not ok
    cmd = "mkdir -p /tmp/gk && cp " + " ".join(f"{f}/*" for f in c) + " /tmp/gk/"
    if i == len(calls):
        cmd += " && bash /tmp/gk/install_all.sh"
    print(f"{i:2d}  {s:9d} B {'ok' if ok else 'OVER'}  carry [" + ", ".join(f'"{f}"' for f in c) + "]")
    print(f"      {cmd}")
print()
print("# then, in that call or any later call of the lease:  . /tmp/vllm-VERSION/env.sh   (adds /tmp/sstools)")
print(f"# each call: its chunks + {allowance} B for the stripped tree stay under {limit} B"
      + ("" if not over else "  -- OVER: rebuild with a smaller CHUNK_BYTES or strip the tree"))
PLANEOF
}

cmd_plan() {
  local t rc=0; t=$(mktemp -d "${TMPDIR:-/tmp}/gk-plan.XXXXXX")
  plan_py > "$t/plan.py"; install_all_body > "$t/body.sh"
  "$PY" "$t/plan.py" "$ROOT" "$LIMIT" "$TREE_ALLOWANCE" "$t/body.sh" "$@" || rc=$?
  rm -rf "$t"; return $rc
}

# Candidate pin list for a release, made the way ../shared/gpu/README.md describes: its Requires-Dist
# less the kernels and torch-stack wheels, resolved for cp312 manylinux x86_64 with the image's known
# versions held (torch as the release pins it), less what the image has. Prints its choices; a
# person still reads the release's imports before the list goes into gpu_pins/.
cmd_resolve() {
  local version=${1:?usage: gpu_kit.sh resolve VERSION [OUT]} out=${2:-/dev/stdout} work whl torch
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gk-resolve.XXXXXX"); work=$WORK
  helper_py > "$work/gk_helper.py"
  whl=$(fetch "vllm==$version" | grep -E "/vllm-$version-" | head -1)
  "$PY" "$work/gk_helper.py" requires "$whl" > "$work/all.txt"
  torch=$(sed -n -E 's/^torch==([0-9.]+).*/\1/p' "$work/all.txt" | head -1)
  "$PY" - "$work/gk_helper.py" "$work/all.txt" "$torch" > "$work/reqs.txt" 2> "$work/why.txt" <<'PYEOF'
import runpy, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon
h = runpy.run_path(sys.argv[1])
drop = {canon(n) for n in h["DROPPED"]} | {"torch", "torchaudio", "triton"}
image = {canon(n) for n in h["IMAGE_NAMES"]} - {"torchvision"}
for line in open(sys.argv[2]):
    r = Requirement(line.strip())
    n = canon(r.name)
    if n in drop:
        print(f"drop {r.name}: {h['DROPPED'].get(n, 'the torch stack: image or a torch kit')}", file=sys.stderr)
    elif n in image:   # the image has it, with its own dependencies; a floor above it is a cond wheel
        v = h["IMAGE_VERSIONS"].get(r.name) or h["IMAGE_VERSIONS"].get(n)
        ok = "?" if v is None else ("ok" if r.specifier.contains(v, prereleases=True) else "TOO OLD")
        print(f"image {r.name}{r.specifier} (image: {v or 'version unknown'}: {ok})", file=sys.stderr)
    else:
        print(str(r).split(";")[0])
PYEOF
  { "$PY" - "$work/gk_helper.py" <<'PYEOF'
import runpy, sys
h = runpy.run_path(sys.argv[1])
# numpy is left free: mistral-common pins numpy<2.4 on Python <= 3.12, the image has 2.5.2 (0.28.0
# ran that way); pip then picks an older numpy, which is dropped as the image's.
for n, v in h["IMAGE_VERSIONS"].items():
    if n not in ("torch", "torchvision", "torchaudio", "triton", "nvidia-nccl-cu13", "numpy"):
        print(f"{n}=={v}")
PYEOF
    echo "torch==$torch+gkstub"; } > "$work/cons.txt"
  mkdir -p "$work/stub"; "$PY" "$work/gk_helper.py" stub torch "$torch" "$work/stub" > /dev/null
  "$RPY" -m pip install -q --dry-run --ignore-installed --report "$work/report.json" "${PLAT[@]}" \
      --find-links "$work/stub" --target "$work/t" -c "$work/cons.txt" -r "$work/reqs.txt" 2> >(grep -v '^WARNING: Location' >&2)
  cat "$work/why.txt" >&2
  local keep=(); [ "$torch" = 2.11.0 ] || keep=(--keep torchvision)
  "$PY" "$work/gk_helper.py" report "$work/report.json" "$work/pins.txt" "${keep[@]}" \
      --skip torch --skip triton --skip cuda-toolkit --skip cuda-bindings --skip cuda-pathfinder >&2
  grep -viE '^(nvidia-|cuda-)' "$work/pins.txt" > "$out" || true
}

# Local test, no GPU: every shipped wheel installs with pip --no-index --no-deps --target into a Python
# 3.12 venv's target dir, and every Requires-Dist of what ships is found (in the target, the release's
# torch kit or the image model) at a version it accepts.
cmd_check() {
  local what=${1:?usage: gpu_kit.sh check VERSION|tools} work name t213=()
  [ -x "$VENV312/bin/python" ] || die "no venv at $VENV312: /root/.pyenv/versions/3.12.1/bin/python -m venv $VENV312 && $VENV312/bin/pip install packaging"
  if [ "$what" = tools ]; then name=tools; else name="v$what"; fi
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gk-check.XXXXXX"); work=$WORK
  cat "$ROOT"/.gk-"$name"-[0-9][0-9]/"$name".part* > "$work/payload"
  local man; man=$(ls "$ROOT"/.gk-"$name"-*/"$name".manifest)
  [ "$(md5sum "$work/payload" | cut -d' ' -f1)" = "$(awk '$1=="md5"{print $2}' "$man")" ] || die "$name: payload md5 mismatch"
  mkdir -p "$work/x" "$work/target"
  tar xf "$work/payload" -C "$work/x"
  local wheels=(); shopt -s nullglob; wheels=("$work"/x/whl/*.whl "$work"/x/cond/*.whl); shopt -u nullglob
  "$VENV312/bin/python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
      --target "$work/target" "${wheels[@]}" 2>&1 | grep -v '^WARNING: Location' || true
  echo "pip --no-index --no-deps --target: $(ls -d "$work"/target/*.dist-info | wc -l) dists installed from ${#wheels[@]} wheels"
  if [ -f "$work/x/vllm.tar.xz" ]; then
    xz -dc "$work/x/vllm.tar.xz" | tar x -C "$work/target"
    local tv; tv=$(awk '$1=="torch"{print $2}' "$man")
    [ "$tv" = image ] || t213=(--torch-kit "$tv")
  fi
  local ns=(); [ -f "$work/x/pins.txt" ] && ns=(--pins "$work/x/pins.txt")
  helper_py > "$work/gk_helper.py"    # this script's helper (the payload's copy may be older)
  "$VENV312/bin/python" "$work/gk_helper.py" check --target "$work/target" --image-model "${t213[@]}" "${ns[@]}" --strict
}

cmd_pytest() {
  local venv=${1:-$ROOT/.venv} site
  site=$(echo "$venv"/lib/python3*/site-packages)
  [ -d "$site/_pytest" ] || { echo "gpu_kit pytest: no pytest in $site" >&2; return 2; }
  rm -rf "$ROOT/.gk-pytest" && mkdir -p "$ROOT/.gk-pytest/site"
  local d
  for d in pytest _pytest pluggy iniconfig packaging pygments py.py; do
    cp -r "$site/$d" "$ROOT/.gk-pytest/site/"
  done
  cp -r "$site"/pytest-*.dist-info "$site"/pluggy-*.dist-info "$site"/iniconfig-*.dist-info "$ROOT/.gk-pytest/site/"
  find "$ROOT/.gk-pytest" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$ROOT/.gk-pytest"
}

case "${1:-}" in
  pytest)   shift; cmd_pytest "$@" ;;
  release)  shift; cmd_release "$@" ;;
  torch213|torch214) cmd_torch_kit "$@" ;;
  tools)    shift; cmd_tools "$@" ;;
  plan)     shift; cmd_plan "$@" ;;
  resolve)  shift; cmd_resolve "$@" ;;
  check)    shift; cmd_check "$@" ;;
  helper)   helper_py ;;              # print the Python helper (gk_helper.py)
  help|-h|--help) sed -n '2,42p' "$0" ;;
  *) sed -n '2,32p' "$0"; exit 2 ;;
esac
