"""The scheduler's pure policies: functions of snapshots, no runner asked and no clock read,
so tests and the cluster simulator (benchmarks/cluster_sim.py) call the same code: placement
(which runner takes a request, what to do about the cluster's size), fair share between
tenants (VTC) and how a request moves (recompute or copy its KV)."""
