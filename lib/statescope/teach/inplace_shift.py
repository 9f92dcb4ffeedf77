"""Lesson 5: the same-block left shift, and what a barrier-less parallel copy does to it.

What it does: ``interleave`` plays an in-place left shift of a small conv window (``n`` bytes,
shift ``s``) lane by lane, as a tiled parallel copy with no barrier between loads and stores
would, for one interleaving: ``memmove`` (all loads, then all stores), ``low_to_high``,
``high_to_low`` (the worst case, and ``statescope.patches.cpu_kernels``' ``barrierless_tiles``
semantics), or ``random_warps`` (warps of lanes in a random order, lanes inside a warp in
lock-step). Each frame labels every byte with the source position it now holds.
``animation`` turns the frames into a plotly animation; ``corruption_table`` counts wrong bytes
per interleaving and shift. ``check_matches_kernel`` proves the animation's worst case is the
engine's CPU copy kernel semantics byte for byte, and ``check_engine_shift`` runs the real engine
with that copy and shows that exactly the requests with an in-place shift diverge.

What it deliberately does not do: model GPU memory ordering beyond "a lane loads then stores".
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import pandas as pd

from statescope.teach.lesson import LessonCheck

ORDERS = ("memmove", "low_to_high", "high_to_low", "random_warps")


def _lane_order(m: int, order: str, warp: int, rng: random.Random) -> list[list[int]]:
    """Groups of lanes that load together then store together, in execution order."""
    if order == "low_to_high":
        return [[j] for j in range(m)]
    if order == "high_to_low":
        return [[j] for j in reversed(range(m))]
    warps = [list(range(a, min(a + warp, m))) for a in range(0, m, warp)]
    rng.shuffle(warps)
    return warps


def interleave(n: int, shift: int, tile: int, order: str = "high_to_low", warp: int = 4,
               seed: int = 0) -> list[np.ndarray]:
    """Frames of an in-place ``dst[i] = src[i + shift]`` over ``n`` bytes: source label per byte."""
    if order not in ORDERS:
        from statescope.errors import InputError

        raise InputError(f"interleave order={order!r}: expected one of {ORDERS}")
    buf = np.arange(n)
    frames = [buf.copy()]
    length = n - shift
    if order == "memmove":
        buf[:length] = buf[shift:].copy()
        return frames + [buf.copy()]
    rng = random.Random(seed)
    for start in range(0, length, tile):
        m = min(tile, length - start)
        for group in _lane_order(m, order, warp, rng):
            loaded = [buf[start + j + shift] for j in group]
            for j, value in zip(group, loaded):
                buf[start + j] = value
            frames.append(buf.copy())
    return frames


def wrong_bytes(final: np.ndarray, shift: int) -> int:
    length = len(final) - shift
    return int((final[:length] != np.arange(shift, shift + length)).sum())


def animation(n: int = 32, shift: int = 8, tile: int = 16, order: str = "high_to_low",
              warp: int = 4) -> Any:
    """A plotly animation: top row the correct result, bottom row the buffer as lanes store."""
    import plotly.graph_objects as go

    frames = interleave(n, shift, tile, order, warp)
    right = interleave(n, shift, tile, "memmove")[-1]

    def z(buf: np.ndarray) -> np.ndarray:
        return np.vstack([right, buf])

    def text(buf: np.ndarray) -> list[list[str]]:
        # ✗: a byte already stored (no longer its own label) that holds the wrong source byte.
        good = [f"{v}" for v in right]
        return [good, [f"{v}" + ("✗" if i < n - shift and v != i and v != right[i] else "")
                       for i, v in enumerate(buf)]]

    last = frames[-1]  # the figure opens on the end result (what a static render shows)
    base = go.Heatmap(z=z(last), text=text(last), texttemplate="%{text}", colorscale="Viridis",
                      colorbar={"title": {"text": "source byte"}, "len": 0.8},
                      y=["memmove (correct)", f"{order} (live)"])
    fig = go.Figure(base, frames=[go.Frame(data=[go.Heatmap(z=z(f), text=text(f))], name=str(k))
                                  for k, f in enumerate(frames)])
    steps = [{"args": [[str(k)], {"frame": {"duration": 0, "redraw": True}, "mode": "immediate"}],
              "label": str(k), "method": "animate"} for k in range(len(frames))]
    fig.update_layout(
        title=f"left shift by {shift} B in a {n} B window, {tile} B tiles, {order}: "
              f"{wrong_bytes(frames[-1], shift)} wrong bytes (✗)",
        height=320, width=900, margin=dict(t=60, b=40), yaxis_autorange="reversed",
        xaxis_title="byte in the window (label = source byte it holds)", yaxis_title="copy",
        updatemenus=[{"type": "buttons", "x": 0, "y": -0.35, "buttons": [
            {"label": "play", "method": "animate",
             "args": [None, {"frame": {"duration": 120, "redraw": True}, "fromcurrent": True}]}]}],
        sliders=[{"steps": steps, "active": len(frames) - 1, "currentvalue": {"prefix": "lane store "},
                  "y": -0.2}])
    return fig


def corruption_table(n: int = 64, tile: int = 16, shifts: tuple[int, ...] = (1, 4, 8, 16, 24),
                     seeds: int = 20) -> pd.DataFrame:
    """Wrong bytes after the copy, per interleaving and shift (random warps: mean over seeds)."""
    rows = []
    for s in shifts:
        row = {"shift (bytes)": s, "shift < tile": s < tile}
        for order in ORDERS:
            runs = seeds if order == "random_warps" else 1
            row[order] = float(np.mean([wrong_bytes(interleave(n, s, tile, order, seed=k)[-1], s)
                                        for k in range(runs)]))
        rows.append(row)
    return pd.DataFrame(rows)


def check_matches_kernel(n: int = 64, tile: int = 16) -> LessonCheck:
    """The animation's worst case = statescope.patches.cpu_kernels' barrierless copy, for every shift."""
    import torch

    from statescope.patches import cpu_kernels

    bad = []
    for s in range(1, n):
        flat = torch.arange(n, dtype=torch.uint8)
        cpu_kernels.tiled_copy(flat, s, 0, n - s, tile)  # the kernel's own per-row routine
        ours = interleave(n, s, tile, "high_to_low")[-1]
        if not np.array_equal(flat.numpy()[:n - s], ours[:n - s]):
            bad.append(s)
    return LessonCheck("the animation's barrier-less copy is the engine's CPU copy kernel, byte for byte",
                 not bad, f"{n - 1 - len(bad)}/{n - 1} shifts agree ({n} B window, {tile} B tiles)",
                 {"disagreeing shifts": bad})


def check_engine_shift(lesson: Any, n_prompts: int = 8, tile: int = 8192) -> LessonCheck:
    """Real engine: memmove vs barrier-less tiles; exactly the in-place-shift requests diverge."""
    from statescope.patches import cpu_kernels
    from statescope.diverge.digest_diff import first_divergence, shifts_by_request
    from statescope.capture.session import boundary_prompts

    prompts = boundary_prompts(lesson.block_size, n_prompts)
    clean, _ = lesson.capture(prompts, max_tokens=16)
    cpu_kernels.set_copy_semantics("barrierless_tiles", tile)
    try:
        faulty, _ = lesson.capture(prompts, max_tokens=16)
    finally:
        cpu_kernels.set_copy_semantics("memmove")
    shifts = shifts_by_request(faulty)
    div = first_divergence(clean, faulty)
    shifted = {r.req_id: r.req_steps for r in shifts.itertuples() if r.req_steps}
    diverged = {r.req_id_b: r for r in div.itertuples() if r.first_step is not None
                and not pd.isna(r.first_step)}
    at_shift = all(rid in diverged and int(diverged[rid].first_step) == min(st)
                   and "conv" in list(diverged[rid].kinds) for rid, st in shifted.items())
    ok = bool(shifted) and at_shift and set(diverged) <= set(shifted)
    return LessonCheck("a barrier-less in-place shift corrupts exactly the shifted requests, conv first", ok,
                 f"{len(shifted)} of {len(prompts)} requests shifted a window in place; "
                 f"{len(diverged)} diverged, all at their shift step: {at_shift}",
                 {"shifted (req: steps)": shifted,
                  "diverged (req: first step)": {k: int(v.first_step) for k, v in diverged.items()}})
