"""Workload: what the engine is asked to do — GUI-agent traces (schema, presets, episodes), the GUI
action language, screenshots and block-boundary geometry.
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "PRESETS": "episodes", "preset_trace": "episodes", "run_episodes": "episodes",
    "shared_prefix_episodes": "episodes", "summarize_requests": "episodes",
    "GeometryPadder": "geometry", "render_png": "screenshots", "TraceStep": "trace",
    "build_messages": "trace", "episodes_of": "trace", "prompt_sha": "trace",
    "read_trace": "trace", "write_trace": "trace",
})
