"""Bayesian bisection for a flaky change point over an ordered list (builds, commits, setting values).

What it does: the public face of the bisection modules, with the names other code imports
:

- ``statescope.bisect.model``: ``RatePrior`` (the flaky-bug asymmetry as a prior on the good/bad
  failure rates) and ``ChangePointPosterior`` (posterior over the change location, expected
  information of a probe);
- ``statescope.bisect.search``: ``bayesian_bisect`` (probe where information is largest, stop at a
  stated confidence or budget; find-regression and find-fix modes), ``plain_bisect`` (textbook
  baseline), ``bisect_settings`` (one setting axis);
- ``statescope.bisect.result``: ``BisectResult`` / ``ProbeRecord`` (probes, posterior after each,
  answer, JSON, heatmap);
- ``statescope.bisect.confirmed``: ``confirmed_bisect`` (the command's default: endpoints
  first, a seed set calibrated on the known-bad end, an answer confirmed on both sides of it or
  "inconclusive"; ``OUTCOMES``), with ``statescope.bisect.seeds.SeedPool`` (seed sets drawn
  from a pool, never repeated on one item);
- ``statescope.bisect.sim``: ``FlakyOracle``, ``SeedOracle`` and ``compare_methods`` (SYNTHETIC oracles);

The command line (``statescope bisect``) lives in ``statescope.cli.bisect``.

What it deliberately does not do: run experiments or install builds (a probe is any callable;
``statescope.builds.build_probe`` makes one that runs a build's environment), model more than one
change, or treat requests of one engine lifetime as dependent.
"""
from __future__ import annotations

from statescope.bisect.model import MODES, ChangePointPosterior, RatePrior
from statescope.bisect.result import BisectResult, ProbeRecord
from statescope.bisect.confirmed import OUTCOMES, confirmed_bisect
from statescope.bisect.search import Probe, bayesian_bisect, bisect_settings, plain_bisect
from statescope.bisect.seeds import SeedPool
from statescope.bisect.sim import FlakyOracle, SeedOracle, compare_methods

__all__ = ["MODES", "OUTCOMES", "BisectResult", "ChangePointPosterior", "FlakyOracle", "Probe",
           "ProbeRecord", "RatePrior", "SeedOracle", "SeedPool", "bayesian_bisect",
           "bisect_settings", "compare_methods", "confirmed_bisect", "plain_bisect"]
