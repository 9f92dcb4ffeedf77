"""Render the GUI-agent language's screenshot specs as real PNG images.

What it does: ``render_png(spec)`` draws a window (title bar, widgets as labelled boxes, textbox
values) with Pillow from the deterministic spec ``statescope.workload.guilang`` attaches to each step, and
``data_url(png)`` wraps it for an OpenAI ``image_url`` content part. Same spec, same bytes.

What it deliberately does not do: make images a model can read — the text-only tiny models never
see them, and the tiny VLM (``data/models/tiny-vl``) has an untrained vision tower: for both the
observation text is the screenshot. The PNGs exist so that vLLM's multimodal path (image tokens in
the prompt, multimodal hashes in prefix-cache keys, the encoder cache) gets the reported request
shape (1–3 images per step).
"""
from __future__ import annotations

import base64
import io


def render_png(spec: dict, scale: float = 0.25) -> bytes:
    """PNG bytes of one screenshot spec (``width``, ``height``, ``title``, ``widgets``)."""
    from PIL import Image, ImageDraw

    w, h = max(16, int(spec["width"] * scale)), max(16, int(spec["height"] * scale))
    img = Image.new("RGB", (w, h), (245, 246, 248))
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, 0, w, max(6, int(28 * scale))], fill=(52, 73, 94))
    draw.text((4, 1), str(spec.get("title", ""))[:60], fill=(255, 255, 255))
    colors = {"textbox": (255, 255, 255), "button": (93, 173, 226), "text": (245, 246, 248)}
    for wd in spec.get("widgets", []):
        x0, y0, x1, y1 = (int(v * scale) for v in wd["bbox"])
        draw.rectangle([x0, y0, x1, y1], fill=colors.get(wd["role"], (200, 200, 200)),
                       outline=(90, 90, 90))
        label = f'{wd["id"]}:{wd["label"]}' + (f'={wd["value"]}' if wd.get("value") else "")
        draw.text((x0 + 2, y0 + 1), label[:24], fill=(0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_part(spec: dict, scale: float = 0.25) -> dict:
    """An OpenAI chat content part holding the rendered screenshot."""
    return {"type": "image_url", "image_url": {"url": data_url(render_png(spec, scale))}}
