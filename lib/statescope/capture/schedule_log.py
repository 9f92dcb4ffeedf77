"""What the scheduler of an in-process engine scheduled, step by step: chunks, encoder inputs, images.

What it does: ``ScheduleLog(engine)`` wraps the ``schedule`` method of the engine core's scheduler
(an ``OfflineEngine``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) for as long as it is open, and records
for every request of every step: tokens already computed, tokens scheduled, and which of its
multimodal items (images) had their encoder run in that step. ``images`` keeps each request's image
spans (``mm_position`` offset and length, in prompt tokens). ``chunks(req)`` lists a request's
prefill chunks as ``(start, end)``; ``cut_images(req, block_size)`` the chunk ends that fall
strictly inside one of its images, with whether the end is a block boundary — the align-mode
question "what does vLLM do when a block-aligned chunk end lands inside an image?".

What it deliberately does not do: change any scheduling decision, or work across processes (a
``vllm serve`` scheduler lives in the engine-core process: use capture there).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from statescope.errors import InputError


@dataclass
class ScheduledRequest:
    step: int
    req_id: str
    computed: int          # tokens computed before this step
    scheduled: int         # tokens scheduled in this step (prefill chunk, or 1 + drafts)
    encoder_inputs: list[int] = field(default_factory=list)  # image indices encoded this step


class ScheduleLog:
    def __init__(self, engine: Any) -> None:
        try:
            self.scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
        except AttributeError as exc:
            raise InputError("ScheduleLog: expected an in-process OfflineEngine "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0)") from exc
        self.rows: list[ScheduledRequest] = []
        self.images: dict[str, list[tuple[int, int]]] = {}
        self.prompt_len: dict[str, int] = {}
        self._step = 0
        self._orig = None

    def __enter__(self) -> "ScheduleLog":
        sched, orig = self.scheduler, self.scheduler.schedule
        self._orig = orig

        def schedule(*args: Any, **kwargs: Any):
            before = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
            out = orig(*args, **kwargs)
            enc = getattr(out, "scheduled_encoder_inputs", {}) or {}
            for rid, n in out.num_scheduled_tokens.items():
                req = sched.requests.get(rid)
                if rid not in self.images and req is not None:
                    self.images[rid] = [(f.mm_position.offset, f.mm_position.length)
                                        for f in (req.mm_features or [])]
                    self.prompt_len[rid] = req.num_prompt_tokens
                self.rows.append(ScheduledRequest(self._step, rid, before.get(rid, 0), int(n),
                                                  list(enc.get(rid, []))))
            self._step += 1
            return out

        sched.schedule = schedule
        return self

    def __exit__(self, *exc: object) -> None:
        if self._orig is not None:
            del self.scheduler.schedule  # the instance attribute; the class's method shows again
            self._orig = None

    def requests(self) -> list[str]:
        return list(dict.fromkeys(r.req_id for r in self.rows))

    def chunks(self, req_id: str) -> list[tuple[int, int, list[int]]]:
        """Prefill chunks of ``req_id``: (start, end, images encoded in that step)."""
        n = self.prompt_len.get(req_id, 0)
        return [(r.computed, r.computed + r.scheduled, r.encoder_inputs) for r in self.rows
                if r.req_id == req_id and r.computed < n]

    def cut_images(self, req_id: str, block_size: int) -> list[dict]:
        """Chunk ends strictly inside an image of ``req_id`` (the prompt's last chunk excluded)."""
        out = []
        for start, end, encoded in self.chunks(req_id):
            if end >= self.prompt_len.get(req_id, 0):
                continue
            for i, (off, length) in enumerate(self.images.get(req_id, [])):
                if off < end < off + length:
                    out.append({"chunk": (start, end), "image": i, "image_span": (off, off + length),
                                "end_on_block_boundary": end % block_size == 0,
                                "image_encoded_in_chunk": i in encoded})
        return out
