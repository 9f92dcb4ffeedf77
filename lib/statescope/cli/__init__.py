"""CLI: the ``statescope`` command, one module per command family.
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "build_parser": "main", "main": "main",
})
