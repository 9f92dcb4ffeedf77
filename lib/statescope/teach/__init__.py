"""Teach: the guided tour of how hybrid-state caching breaks (state, align mode, in-place shift, the
accepted-count race), each section ending in a check on the real engine.
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "Lesson": "lesson", "LessonCheck": "lesson", "varied_prompt": "lesson",
})
