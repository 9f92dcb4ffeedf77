#!/usr/bin/env bash
# gpu_tree.sh: make the working tree small enough to travel beside a kit chunk, and put it back.
#
# Why: a device call carries the whole working tree (tracked files included) plus its chunk, 64 MiB at
# most. By 2026-12-04 the tracked tree had grown to ~76 MB (data/results/gpu ~39 MB, the three tiny
# models ~25 MB, the rendered gallery ~8 MB), so no kit call fitted. A campaign needs the code, the
# tests, tiny-gui and the few committed files it reads (KEEP); the rest waits outside the checkout.
#
#   gpu_tree.sh slim      move SLIM's paths to $GK_STASH (default /work/gpukit/stash), KEEP's files
#                         copied back in place; prints the tracked bytes that will travel
#   gpu_tree.sh restore   move them back; refuses if the stash is missing; git status must be clean
#   gpu_tree.sh size      the bytes of the working tree a device call carries (tracked + untracked
#                         not ignored)
#
# What it deliberately does not do: touch git (no stash, no commit) or anything ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=${GK_STASH:-/work/gpukit/stash}
SLIM=(data/results docs/gallery docs/gallery-gpu data/models/tiny-qwen35 data/models/tiny-vl)
KEEP=(data/results/gpu/minimal_reproducer_0.26.0/at_two_seqs/repro/repro.py)

size() {
  git ls-files -z --cached --others --exclude-standard \
    | python3 -c "import os,sys; print(sum(os.path.getsize(p) for p in sys.stdin.read().split('\0') if p and os.path.isfile(p)))"
}

case "${1:-}" in
  slim)
    [ -e "$STASH/.slimmed" ] && { echo "gpu_tree: already slimmed ($STASH/.slimmed); restore first" >&2; exit 1; }
    mkdir -p "$STASH"
    for p in "${SLIM[@]}"; do
      [ -e "$p" ] || continue
      mkdir -p "$STASH/$(dirname "$p")"; mv "$p" "$STASH/$p"
    done
    for k in "${KEEP[@]}"; do mkdir -p "$(dirname "$k")"; cp "$STASH/$k" "$k"; done
    touch "$STASH/.slimmed"
    echo "gpu_tree: slimmed; $(size) bytes travel (limit 67108864 with the chunk)" ;;
  restore)
    [ -e "$STASH/.slimmed" ] || { echo "gpu_tree: nothing to restore ($STASH/.slimmed missing)" >&2; exit 1; }
    for k in "${KEEP[@]}"; do rm -f "$k"; done
    for p in "${SLIM[@]}"; do
      [ -e "$STASH/$p" ] || continue
      [ -d "$p" ] && find "$p" -depth -type d -empty -delete   # the folders KEEP made
      [ -e "$p" ] && { echo "gpu_tree: $p exists again; move it aside, then restore" >&2; exit 1; }
      mkdir -p "$(dirname "$p")"; mv "$STASH/$p" "$p"
    done
    rm -f "$STASH/.slimmed"
    git status --short | grep -q '^ D' && { echo "gpu_tree: tracked files still missing:" >&2; git status --short | grep '^ D' | head >&2; exit 1; }
    echo "gpu_tree: restored; $(size) bytes" ;;
  size) size ;;
  *) sed -n 2,16p "$0"; exit 2 ;;
esac
