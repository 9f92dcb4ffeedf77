"""Matrix and bisection cells on a Ray cluster (one GPU host, or a fleet).

What it does: runs the cells of ``statescope.builds`` -- one experiment in one build's own
environment -- as Ray tasks that ask for their resources (a GPU each on a GPU cluster), retries
what the cluster loses, records every cell in a resumable run store as it finishes, and chooses a
Bayesian bisection's probes in batches that fill the free workers:

- ``statescope.cluster.session``: connect to a cluster, or start a local one and remove it;
- ``statescope.cluster.plan``: ``CellPlan`` (what a cell measures, and its id), ``matrix_plan``;
- ``statescope.cluster.cells``: a cell as a Ray task (guarded build interpreter, atomic publish,
  files shipped back when the store is not shared);
- ``statescope.cluster.ledger``: the run's store (one record per cell, resume, recovery);
- ``statescope.cluster.driver``: submission, retries, timeouts, recording;
- ``statescope.cluster.matrix``: ``ray_matrix``; ``statescope.cluster.bisect``: ``ray_bisect``;
- ``statescope.cluster.batches``: ``BatchedSearch`` (batched probe choice by expected
  information); ``statescope.cluster.sim``: SIMULATED device-hours of batched bisection.

The command line (``statescope matrix --ray``, ``statescope bisect --ray``) lives in
``statescope.cli.cluster``.

What it deliberately does not do: anything without Ray (the sequential paths in
``statescope.builds.run`` stay as they were), provision machines, or install builds other than
through ``statescope.builds.install`` on the node a cell lands on.
"""
