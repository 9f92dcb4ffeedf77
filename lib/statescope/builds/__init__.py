"""Builds: run the same experiment on many vLLM builds, each in its own cached environment.

What it does: the public face of the builds modules, with the names other code imports:

- ``statescope.builds.spec``: ``BuildSpec`` (PyPI release, wheel file or URL, per-commit wheel,
  plus ``+patch:NAME`` runtime patches), ``Build``, ``BuildFailed``, ``builds_dir``;
- ``statescope.builds.install``: ``ensure_build`` (uv or pip, cached by install key, install log
  kept), ``list_builds``, ``remove_build``, ``pip_config``, ``uv_options``, ``find_uv``;
- ``statescope.builds.run``: ``run_cell`` (an experiment in the build's own interpreter),
  ``build_matrix``, ``plant_regression`` (PLANTED), ``build_probe`` (a bisection probe);
- ``statescope.builds.releases``: the real-release experiment (releases x CPU copy semantics,
  EMULATED where statescope's kernels emulate a GPU ordering) and its committed results;

The command line (``statescope build add|list|remove``, ``statescope matrix``) lives in
``statescope.cli.builds``.

``python -m statescope.builds run-cell REQUEST.json`` is the build-side entry (``__main__``).

What it deliberately does not do: build vLLM from source, share an environment between specs that
install different things, or delete environments on its own.
"""
from __future__ import annotations

from statescope.builds.census import census_installed, census_for_release, installed_brief
from statescope.builds.install import (COMMIT_INDEX, ensure_build, find_uv, list_builds, pip_config,
                                       remove_build, uv_options)
from statescope.builds.run import (MATRIX_COLUMNS, BuildMatrix, CellResult, build_matrix,
                                   build_probe, build_seed_probe, plant_regression, run_cell)
from statescope.builds.spec import (BUILDS_ENV, LIGHT_DEPS, PATCH_SEP, REPO, Build, BuildFailed,
                                    BuildSpec, builds_dir)

__all__ = ["census_installed", "census_for_release", "installed_brief", "BUILDS_ENV", "COMMIT_INDEX", "LIGHT_DEPS", "MATRIX_COLUMNS", "PATCH_SEP", "REPO", "Build",
           "BuildFailed", "BuildMatrix", "BuildSpec", "CellResult", "build_matrix", "build_probe", "build_seed_probe", "builds_dir", "ensure_build",
           "find_uv", "list_builds", "pip_config", "plant_regression", "remove_build", "run_cell",
           "uv_options"]
