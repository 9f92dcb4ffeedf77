"""Share: what leaves the machine — notebook rendering, export, the issue summary, the scrubber, the
environment manifest and figure export.
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "markdown_copy": "export", "notebook_paths": "render", "render_all": "render",
    "render_for_sharing": "render", "run_notebook": "render", "run_notebooks": "render",
    "Scrubber": "scrub", "SecretLeak": "scrub", "check_tree": "leakcheck", "find_secrets": "scrub",
    "summary_markdown": "summary",
})
