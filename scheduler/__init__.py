"""Cluster control plane: runners (threads or Ray actors) behind one Scheduler, placement,
migration, fair share, autoscale and DistKV's KV groups (docs/cluster.md, docs/distkv.md).
build.py starts one from a ClusterSpec (the frontend turns its flags into that spec)."""
