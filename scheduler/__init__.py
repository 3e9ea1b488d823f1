"""Cluster control plane: runners (threads or Ray actors) behind one Scheduler, placement,
migration, fair share, autoscale and DistKV's KV groups (docs/cluster.md, docs/distkv.md)."""
