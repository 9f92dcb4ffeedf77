"""CLI: the ``statescope`` command, one module per command family.

``statescope.cli.main`` is the entry function (``from statescope.cli import main``), not the
module of the same name: importing ``statescope.cli.main`` makes Python bind the submodule as
the package's attribute, which would shadow the function, so the package keeps ``main`` as a
property the import system cannot overwrite. The module stays importable by its path
(``from statescope.cli.main import build_parser``, ``python -m statescope.cli.main``).
"""
import sys
import types

from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "build_parser": "main", "main": "main",
})


class _CliPackage(types.ModuleType):
    @property
    def main(self):
        from statescope.cli.main import main

        return main

    @main.setter
    def main(self, value) -> None:  # the import system binding the submodule: keep the function
        pass


sys.modules[__name__].__class__ = _CliPackage
