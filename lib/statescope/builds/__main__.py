"""``python -m statescope.builds run-cell REQUEST.json``: the build-side entry, run by a build's own
interpreter (``statescope.builds.run``). Nothing else is reachable from here."""
import sys

from statescope.builds.cell import run_cell_here

if sys.argv[1:2] == ["run-cell"] and len(sys.argv) == 3:
    sys.exit(run_cell_here(sys.argv[2]))
sys.exit("usage: python -m statescope.builds run-cell REQUEST.json")
